"""Stages in lock-step with a single process running ``torch.optim.AdamW`` on the whole batch.

Each world size is one spawn; inside it every (stage, dtype) case and every feature case runs
and compares every parameter, element by element, after every step (stage 3 inside
``gathered_params``, which gives every parameter its full value).

Unused parameters. ``Net.extra`` gets no gradient in some steps. At stages 0-2 it is also called
on some ranks only (only where the rank's rows need it). Stage 3 gathers a module's parameters
with collectives, so every rank must call the same modules: there ``extra`` is called on every rank
whenever some rank's rows need it (on an empty slice of rows elsewhere), and on no rank otherwise.

Tolerances: ``tests.helpers.lockstep``.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.lockstep import LR, STAGES, WORLD_SIZES, accumulation_case, clip_ref, run_lockstep, two_groups


def matrix(rank: int, world: int) -> None:
    """Every stage x dtype, then the feature cases, on this world size."""
    for stage in STAGES:
        for dtype in (torch.float32, torch.bfloat16):
            run_lockstep(rank, world, f"stage {stage} {dtype}", dtype=dtype, stage=stage)
        run_lockstep(rank, world, f"stage {stage} zero_grad(set_to_none=False)", set_to_none=False, stage=stage)
        run_lockstep(rank, world, f"stage {stage} groups", groups=two_groups, stage=stage)
        norms: list = []
        opt = run_lockstep(rank, world, f"stage {stage} clip", before_ref_step=clip_ref(0.05, norms), stage=stage,
                           max_grad_norm=0.05)  # fmt: skip
        assert max(norms) > 0.05, f"clipping never active: norms {norms}"
        assert opt.last_step.grad_norm == pytest.approx(norms[-1], rel=1e-4)
        sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)  # noqa: E731
        run_lockstep(rank, world, f"stage {stage} StepLR", sched=sched, stage=stage)
        adam = lambda g: torch.optim.Adam(g, lr=LR, weight_decay=0.1)  # noqa: E731
        run_lockstep(rank, world, f"stage {stage} Adam", stage=stage, adam_w_mode=False, weight_decay=0.1, ref_opt=adam)
        for mode in ("no_sync", "accumulation_steps", "backward"):
            accumulation_case(rank, world, stage, mode)


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"world{w}")
def test_matches_torch_adamw(spawn, world: int) -> None:
    spawn(matrix, world)
