"""Stage 3 with several micro-steps inside one ``torch.autocast`` region (forward, backward and step all inside, as
many loops write it): autocast keeps its casts of parameters until the region ends, and the second micro-step's
backward failed on a freed parameter ("The size of tensor a (0) must match the size of tensor b (17)"). It trains
next to ``torch.optim.AdamW`` running the same loop, with DESIGN.md's fp32 tolerances."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zero_kernels as zk
from tests.helpers.lockstep import compare

MICRO = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(17, 17), nn.Tanh(), nn.Linear(17, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_micro_steps_inside_one_autocast_region(dtype: torch.dtype) -> None:
    model = _model()
    ref = copy.deepcopy(model)
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=3, stage3_param_persistence_threshold=0, impl="torch")
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        for net, o in ((model, opt), (ref, ropt)):
            with torch.autocast("cpu", dtype=dtype):
                for micro in range(MICRO):
                    x = torch.randn(4, 17, generator=torch.Generator().manual_seed(step * MICRO + micro))
                    (net(x).square().mean() / MICRO).backward()
                o.step()
                o.zero_grad()
        with opt.gathered_params():
            compare(model, ref, f"step {step}")
