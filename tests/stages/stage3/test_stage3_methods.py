"""Stage 3: a method of the model other than ``forward`` (``model.score(x)``, timm's ``forward_features``) that computes
with a parameter the model holds directly, then calls a sub-module.

Stage 3 gathers and reduces parameters around the forward calls of the modules that hold them. A parameter under
``stage3_param_persistence_threshold`` is kept whole, so such a method computes with it, but it shares its unit with
the other small parameters, which is reduced when the backward of the sub-module's call ends: its gradient arrives
after that. The backward raises an error that names the parameter and says so (it said only that an earlier backward
had raised or that reentrant checkpointing was in use); a freed parameter is refused at its use, naming it. The same
computation run through ``forward`` trains as ``torch.optim.AdamW``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zero_kernels as zk
from tests.helpers.lockstep import compare

LR = 1e-2


class Scorer(nn.Module):
    """``score`` reads ``w`` (held by this module) outside ``forward``, then calls ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.score(x)

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(x @ self.w))


def _rows() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(0))


def test_a_kept_whole_parameter_read_by_another_method_is_named() -> None:
    torch.manual_seed(0)
    model = Scorer()
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3)
    with pytest.raises(RuntimeError, match=r"'w'.*outside the forward.*stage3_param_persistence_threshold"):
        model.score(_rows()).sum().backward()
    opt.zero_grad()


def test_a_freed_parameter_read_by_another_method_is_named() -> None:
    torch.manual_seed(0)
    model = Scorer()
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, stage3_param_persistence_threshold=0)
    with pytest.raises(RuntimeError, match=r"'w'.*outside the forward of its model's modules"):
        model.score(_rows())
    opt.zero_grad()


def test_the_same_method_through_forward_trains_as_adamw() -> None:
    torch.manual_seed(0)
    model = Scorer()
    ref = copy.deepcopy(model)
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for _ in range(3):
        for m, o in ((model, opt), (ref, ropt)):
            m(_rows()).square().sum().backward()
            o.step()
            o.zero_grad()
    with opt.gathered_params():
        compare(model, ref, "through forward")
