"""An optimizer that is collected takes its hooks off the model: a learning-rate finder, a notebook or a search that
builds optimizer after optimizer on one model left every dead one's gradient hooks and forward pre-hook in place
(300 optimizers: 12000 gradient hooks, forward and backward 3x slower), and their parameter table entries."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import zero_kernels as zk
from zero_kernels.stages import grad_ready


def _hooks(model: nn.Module) -> tuple[int, int, int]:
    """(gradient hooks on the parameters, forward pre-hooks on the model, ``owners`` entries of its parameters)."""
    params = list(model.parameters())
    grads = sum(len(p._post_accumulate_grad_hooks or {}) for p in params)
    owned = sum(id(p) in grad_ready.owners for p in params)
    return grads, len(model._forward_pre_hooks), owned


@pytest.mark.parametrize("given", ["model", "parameters"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_collected_optimizer_leaves_no_hook(stage: int, given: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    before = _hooks(model)
    for _ in range(3):
        opt = zk.ShardedFusedAdam(model if given == "model" else model.parameters(), lr=1e-2, stage=stage)
        model(torch.randn(2, 4)).sum().backward()  # given the parameters, the first forward finds the model
        opt.step()
        opt.zero_grad()
        one = _hooks(model)
        del opt
        gc.collect()
        model(torch.randn(2, 4)).sum().backward()  # a pre-hook whose optimizer is gone takes itself off here
        model.zero_grad()
    assert one[0] == len(list(model.parameters())) and one[2] > 0, "the live optimizer's hooks were not counted"
    assert _hooks(model) == before, f"stage {stage}: hooks left by collected optimizers"
