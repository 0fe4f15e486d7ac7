"""A parameter's gradient reaches the pipeline after every hook on the parameter (``stages.grad_ready``).

Against ``torch.optim.AdamW`` on the whole batch, stages 0-3 on 1 and 2 ranks (buckets of 13 elements, so that
stage 0 starts all-reduces from inside backward):

1. A post-accumulate-grad hook put on after the optimizer was built, which adds to ``p.grad`` when there is one
   (as such hooks guard): the update sees its edit, as the reference's does. Stage 2 used to take the gradient
   before the hook ran (the hook found ``p.grad`` None) and stage 0 to start reducing the buffer the hook then
   wrote into.
2. Parameters whose data went through another dtype between steps (``p.data = p.data.double()`` and back: autograd
   gives each a new gradient accumulator on the next backward): their gradients still reach the update, handed
   on during that backward and the next ones (stages 0-2 count each), not only picked up at its end; a hook put on
   after the optimizer still sees them first.
3. A hook put on after the optimizer that drops the gradient (``p.grad = None``, after which AdamW leaves the
   parameter alone): the parameter has none this round, at every stage (stages 0-2 raised an AttributeError).
4. A post-accumulate-grad hook that returns a value (``lambda p: p.grad.mul_(0.5)``): the backward raises torch's own
   error saying such hooks return None, as without the optimizer (stages 0-2 raised ``TypeError: 'NoneType' object
   is not reversible`` from the optimizer's hook, which torch runs after it with the hook table unset).
"""

from __future__ import annotations

import pytest
import torch

import zero_kernels as zk
from tests.helpers.lockstep import BUCKET, LR, ROWS, Net, batch, make_models, step_and_compare

STAGES = (0, 1, 2, 3)
NUDGE = 0.01
USED = 7  # parameters with a gradient: Net's but the frozen one and those of ``extra`` (not called)


def _nudge(p: torch.Tensor) -> None:
    if p.grad is not None:
        p.grad.add_(NUDGE)


def _train(
    rank: int, world: int, stage: int, what: str, between=lambda model, ref, step: None, handed: int = 0
) -> None:
    model, ref = make_models(torch.float32)
    extra = {"stage3_param_persistence_threshold": 10} if stage == 3 else {}
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=BUCKET, **extra)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(3):
        between(model, ref, step)
        x = batch(step, world * ROWS)
        arrived = opt.pipeline.grad_arrivals
        model(x[rank * ROWS : (rank + 1) * ROWS]).backward()
        ref(x).backward()
        if stage < 3:  # each gradient handed on by a hook during backward, not only picked up at its end
            expected = handed if handed and step > 0 else USED
            assert opt.pipeline.grad_arrivals - arrived == expected, f"stage {stage} {what} step {step}: handed on"
        step_and_compare(opt, ropt, model, ref, f"stage {stage} world {world} {what} step {step}")


def _hooks_after_optimizer(model: Net, ref: Net, step: int) -> None:
    if step == 0:
        for p in [*model.parameters(), *ref.parameters()]:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(_nudge)


def _drop(p: torch.Tensor) -> None:
    p.grad = None


def _drop_head_grads(model: Net, ref: Net, step: int) -> None:
    if step == 1:
        for p in [*model.head.parameters(), *ref.head.parameters()]:
            p.register_post_accumulate_grad_hook(_drop)


def _dtype_round_trip(model: Net, ref: Net, step: int) -> None:
    if step == 1:
        for p in model.parameters():
            if not p.requires_grad:
                continue
            p.data = p.data.double()
            p.data = p.data.float()


def _both(model: Net, ref: Net, step: int) -> None:
    _hooks_after_optimizer(model, ref, step)
    _dtype_round_trip(model, ref, step)


def all_cases(rank: int, world: int) -> None:
    for stage in STAGES:
        _train(rank, world, stage, "hook put on after the optimizer", _hooks_after_optimizer)
        _train(rank, world, stage, "data through float64 and back", _dtype_round_trip)
        _train(rank, world, stage, "both", _both)
        _train(rank, world, stage, "head's gradients dropped by a hook", _drop_head_grads, handed=USED - 2)


def test_one_process() -> None:
    all_cases(0, 1)


@pytest.mark.parametrize("stage", STAGES)
def test_hook_returning_a_value_gets_torchs_error(stage: int) -> None:
    model, _ = make_models(torch.float32)
    model.head.weight.register_post_accumulate_grad_hook(lambda p: p.grad.mul_(0.5))
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=stage)
    with pytest.raises(RuntimeError, match="post accumulate grad hooks should return None"):
        model(batch(0, ROWS)).backward()
    opt.zero_grad()


@pytest.mark.distributed
def test_two_ranks(spawn) -> None:
    spawn(all_cases, 2, timeout_s=300.0)
