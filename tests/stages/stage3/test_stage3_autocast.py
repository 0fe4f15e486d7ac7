"""Stage 3 with several micro-steps inside one ``torch.autocast`` region (forward, backward and step all inside, as
many loops write it). Autocast keeps its casts of parameters until the region ends, and the second micro-step took
the first one's: its backward failed on a freed parameter ("The size of tensor a (0) must match the size of tensor b
(17)"), or, for a parameter under ``stage3_param_persistence_threshold`` on 2 ranks, its gradient arrived after the
unit was reduced ("got a second gradient in one backward pass"). Such a loop trains next to ``torch.optim.AdamW``
running it (DESIGN.md's fp32 tolerances), and bit for bit as with autocast around the forward alone."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zero_kernels as zk
from tests.helpers import random_combinations as rc
from tests.helpers.dist import run_ranks_checked
from tests.helpers.lockstep import compare
from tests.offload import exactness

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


def _train(rank: int, world: int, case: rc.Case, whole: bool) -> tuple[zk.ShardedFusedAdam, dict[str, torch.Tensor]]:
    """Two updates of ``case``'s model, its micro-steps by ``gradient_accumulation_steps``, the forward under bf16
    autocast; ``whole``: the micro-steps and the step inside one autocast region."""
    model = rc.build_model(case)
    opt = zk.ShardedFusedAdam(rc.make_groups(case, model), module=model, stage=3,
                              gradient_accumulation_steps=case.accumulation, **case.options)  # fmt: skip
    rows = slice(rank * rc.ROWS, (rank + 1) * rc.ROWS)
    for update in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=whole):
            for micro in range(case.accumulation):
                x, ids = rc.batch(case, update, micro, world * rc.ROWS)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(x[rows], ids[rows], update * case.accumulation + micro)
                loss.backward()
                opt.step()
            opt.zero_grad()
    with opt.gathered_params():
        return opt, {n: p.detach().clone() for n, p in model.named_parameters()}


def _whole_against_forward(rank: int, world: int) -> list[str]:
    case = rc.draw(85)  # a frozen head weight beside its bias, three micro-steps
    case.options["stage3_param_persistence_threshold"] = 10**6  # every parameter persistent
    (a, wa), (b, wb) = (_train(rank, world, case, whole) for whole in (False, True))
    return exactness.differences(a, b, wa, wb, "after 2 updates")


@pytest.mark.distributed
def test_persistent_parameters_in_micro_steps_inside_one_region() -> None:
    run_ranks_checked(_whole_against_forward, 2)
