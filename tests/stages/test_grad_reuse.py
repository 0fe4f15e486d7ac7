"""Stages 0 and 1 keep ``p.grad`` (stage 0: the mean over ranks, stage 1: the local gradient), so a
step that reuses it behaves as ``torch.optim.AdamW`` with DDP-averaged gradients: a second
``step()`` without a new backward, and a loop that never clears gradients (each backward adds to
``p.grad``). Compared after every step, element by element, with AdamW on the whole batch.

Stages 2 and 3 forget the gradients at each step, as DeepSpeed does (documented): a second ``step()`` without a
backward or ``zero_grad()`` updates nothing and logs a warning, once per optimizer; after ``zero_grad()`` it is
silent, as it is at stages 0 and 1.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zero_kernels as zk
import zero_kernels.optim as zo
from tests.helpers.check import assert_close
from tests.helpers.dist import run_ranks_checked
from tests.helpers.lockstep import BUCKET, LR, ROWS, WORLD_SIZES, batch, compare, make_models, two_groups


def _loop(rank: int, world: int, stage: int, mode: str) -> None:
    """``twice``: two steps per backward, then zero_grad; ``never``: no zero_grad at all."""
    model, ref = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(two_groups(model), lr=LR, stage=stage, reduce_bucket_size=BUCKET, module=model)
    ropt = torch.optim.AdamW(two_groups(ref), lr=LR)
    for step in range(4):
        x = batch(step, world * ROWS)
        model(x[rank * ROWS : (rank + 1) * ROWS]).backward()
        ref(x).backward()
        local = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        for _ in range(2 if mode == "twice" else 1):
            opt.step()
            ropt.step()
            compare(model, ref, f"stage {stage} {mode} step {step}")
        for n, p in model.named_parameters():  # stage 0 may average its (equal) means again: rounding only
            if n in local:
                what = f"stage {stage} {mode} step {step}: the step changed {n}.grad"
                assert_close(p.grad, local[n], rtol=0 if stage == 1 else 1e-6, what=what)
        if mode == "twice":
            opt.zero_grad()
            ropt.zero_grad()


def _body(rank: int, world: int) -> list[str]:
    problems = []
    for stage in (0, 1):
        for mode in ("twice", "never"):
            try:
                _loop(rank, world, stage, mode)
            except AssertionError as err:
                problems.append(str(err))
    return problems


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"world{w}")
def test_steps_that_reuse_p_grad_match_adamw(world: int) -> None:
    run_ranks_checked(_body, world)


SPENT = "step() without a backward or zero_grad() since the last step"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_on_dropped_gradients_says_so_once(stage: int, caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=stage)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        opt.step()  # after zero_grad(): nothing to apply, as AdamW
        assert SPENT not in caplog.text
        for _ in range(2):
            model(x).square().mean().backward()
            opt.step()
            with opt.gathered_params():
                before = [p.detach().clone() for p in model.parameters()]
            opt.step()  # AdamW applies p.grad again; stages 2-3 dropped it at the last step
            with opt.gathered_params():
                changed = any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
            assert changed == (stage < 2), f"stage {stage}: the second step changed the parameters: {changed}"
    assert caplog.text.count(SPENT) == (1 if stage >= 2 else 0), caplog.text


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_grad_keeping_zeros_gives_no_gradient_to_a_parameter_that_never_had_one(stage: int) -> None:
    """``zero_grad(set_to_none=False)`` before every backward, ``extra`` never used: AdamW leaves its ``p.grad`` None
    and never updates it (no weight decay, no step count); the other parameters as AdamW's, element by element."""
    model, ref = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=BUCKET, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    for step in range(3):
        for o in (opt, ropt):
            o.zero_grad(set_to_none=False)
        model(batch(step, ROWS)).backward()
        ref(batch(step, ROWS)).backward()
        opt.step()
        ropt.step()
        with opt.gathered_params():
            compare(model, ref, f"stage {stage} step {step}")
    state = opt.full_state_dict()["state"]
    extra = [i for i, (n, p) in enumerate(model.named_parameters()) if p.requires_grad and n.startswith("extra.")]
    assert extra and all(i not in state or float(state[i]["step"]) == 0 for i in extra), state.keys()


@pytest.mark.parametrize("clear", ["model.zero_grad()", "nothing"])
@pytest.mark.parametrize("stage", [2, 3])
def test_each_step_uses_only_the_backward_since_the_last_step_without_opt_zero_grad(stage: int, clear: str) -> None:
    """Stages 2-3 without ``opt.zero_grad()`` (``model.zero_grad()``, or no clearing at all): each step uses the
    gradients of the backward since the last step only, as AdamW with ``zero_grad()`` every step, element by
    element (the step forgets which buckets its reductions wrote, so the next reduction overwrites them)."""
    model, ref = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=BUCKET)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(3):
        if clear == "model.zero_grad()":
            model.zero_grad()
        ropt.zero_grad()
        model(batch(step, ROWS)).backward()
        ref(batch(step, ROWS)).backward()
        opt.step()
        ropt.step()
        with opt.gathered_params():
            compare(model, ref, f"stage {stage} {clear} step {step}")
