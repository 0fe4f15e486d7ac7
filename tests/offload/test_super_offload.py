"""SuperOffload (``offload_optimizer.super_offload``, stage 3, the state in host memory): the host Adam of each
bucket runs during backward, and the step keeps it only where the step's own update would read the same. The run
is the one without it, bit for bit, whatever happens between backward and the step: a step that clips or skips, a
learning rate changed, accumulation, the state read or a parameter edited, ``zero_grad()``; a state tensor taken
before backward and written after it is refused."""

from __future__ import annotations

import copy
from typing import Callable, Optional

import pytest
import torch
from torch import nn

import zero_kernels as zk
import zero_kernels.optim as zo
from tests.helpers.dist import run_ranks
from tests.offload.exactness import assert_same, copying, pair_case

HOST = {"device": "cpu"}
SPECULATE = {"device": "cpu", "super_offload": True}


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def _opt(model: nn.Module, offload: dict, **extra) -> zo.ShardedFusedAdam:
    kwargs = dict(lr=2e-2, stage=3, reduce_bucket_size=256, stage3_param_persistence_threshold=0, weight_decay=0.1)
    return zo.ShardedFusedAdam(model, offload_optimizer=offload, **{**kwargs, **extra})


def _backward(model: nn.Module, opt: zo.ShardedFusedAdam, step: int, dtype: torch.dtype, scale: float = 1.0) -> None:
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(step)).to(dtype)
    loss = model(x).float().square().mean() * scale
    opt.backward(loss) if opt.scales_loss else loss.backward()


Between = Callable[[nn.Module, zo.ShardedFusedAdam, int], None]


def _pair(
    dtype: torch.dtype, between: Optional[Between] = None, steps: int = 4, **extra
) -> tuple[zo.ShardedFusedAdam, zo.ShardedFusedAdam]:
    """Train with the host tier and with SuperOffload side by side, ``between`` called on both after each backward,
    and compare after every step; returns (plain, speculating)."""
    plain = _model(dtype)
    fast = copy.deepcopy(plain)
    a, b = _opt(plain, HOST, **extra), _opt(fast, SPECULATE, **extra)
    for step in range(steps):
        for model, opt in ((plain, a), (fast, b)):
            _backward(model, opt, step, dtype)
            if between is not None:
                between(model, opt, step)
            opt.step()
            opt.zero_grad()
        assert_same(a, b, plain, fast, f"{dtype} step {step}")
    return a, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_updates_run_during_backward_are_kept_and_exact(dtype: torch.dtype) -> None:
    a, b = _pair(dtype)
    spec = b._pipeline.speculation
    buckets = sum(len(buf.layout.buckets) for buf in b._pipeline.buffers)
    assert spec.ran == spec.kept == 4 * buckets  # every bucket of every step, none updated again
    assert not spec.guesses
    state = 12 if dtype == torch.bfloat16 else 8  # bytes per element: master (bf16), moments
    params = 2 if dtype == torch.bfloat16 else 4
    shard = sum(buf.layout.shard_numel for buf in b._pipeline.buffers)
    copies = sum(t.untyped_storage().nbytes() for t in spec.copies())
    assert copies == shard * (state + params)  # the state before each update and the new parameters
    assert b.memory_report()["host"] == a.memory_report()["host"] + copies


def test_from_a_gpu_the_bus_carries_what_it_carries_without_it() -> None:
    """The tier copying as from a GPU: a kept update's gradients went down during backward, once, and its new
    parameters go up at the step, as without speculation."""
    with copying():
        a, b = _pair(torch.bfloat16)
    assert b._pipeline.speculation.kept == b._pipeline.speculation.ran > 0
    ours, theirs = b._pipeline.tier.traffic(), a._pipeline.tier.traffic()
    assert ours["down"] == theirs["down"] > 0 and ours["up"] == theirs["up"] > 0


def test_updates_start_as_their_reductions_end() -> None:
    """By the time backward reaches the first layer, every later unit's reduction has ended and its update has been
    handed over (not held until the round ends with the collectives still counted in flight)."""
    model = _model(torch.bfloat16)
    opt = _opt(model, SPECULATE)
    spec, seen = opt._pipeline.speculation, []
    x = torch.randn(6, 24, dtype=torch.bfloat16, requires_grad=True)
    x.register_hook(lambda grad: seen.append(len(spec.guesses)))  # the last gradient backward computes
    model(x).float().square().mean().backward()
    later = [buf for buf in opt._pipeline.buffers if all(p is not model[0].weight for p in buf.params)]
    assert seen == [sum(len(buf.layout.buckets) for buf in later)]  # all but the first layer's, reduced after it
    opt.step()


def test_a_step_that_clips_or_skips_rolls_back_and_is_exact() -> None:
    def inf_at_two(model: nn.Module, opt: zo.ShardedFusedAdam, step: int) -> None:
        if step == 2:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.view(-1)[0] = float("inf")
                    break

    a, b = _pair(torch.bfloat16, max_grad_norm=0.02)  # every step clips
    assert b._pipeline.speculation.ran > 0 and b._pipeline.speculation.kept == 0
    a, b = _pair(torch.bfloat16, steps=4, max_grad_norm=100.0)  # none does
    assert b._pipeline.speculation.kept == b._pipeline.speculation.ran > 0
    a, b = _pair(torch.float16, fp16={"enabled": True, "initial_scale_power": 24, "loss_scale_window": 2})
    assert a.skipped_steps == b.skipped_steps >= 1  # the first steps overflow: their updates undone


def test_what_happens_between_backward_and_step_is_taken_as_without_it() -> None:
    def between(model: nn.Module, opt: zo.ShardedFusedAdam, step: int) -> None:
        p = model[2].weight
        if step == 0:
            opt.param_groups[0]["lr"] = 1e-2  # the scheduler moved it: rolled back, updated at the new rate
        if step == 1:
            opt.state[p]["exp_avg"].mul_(0.5)  # through the door: rolled back first, then written
        if step == 2:
            with opt.gathered_params(), torch.no_grad():
                model[0].bias.add_(0.125)  # an edit: that unit's update read other parameters
        if step == 3:
            opt.zero_grad()  # the gradients go: the state is as before this backward
            _backward(model, opt, 10, torch.bfloat16)
        if step == 4:
            zk.safe_set_full_grad(model[4].weight, torch.full((4, 16), 0.25))  # another gradient for that unit
        if step == 5:
            model[4].bias.data = torch.full((4,), 0.5, dtype=torch.bfloat16)  # a value given to a freed parameter
        if step == 6:
            with torch.no_grad():  # a write into a shard that no door sees: the update adopts it
                opt._pipeline.buffers[0].param_shard[:4].add_(1.0)

    _pair(torch.bfloat16, between, steps=7)


def test_accumulation_keeps_the_update_of_the_last_micro_step() -> None:
    plain = _model(torch.bfloat16)
    fast = copy.deepcopy(plain)
    a, b = _opt(plain, HOST, gradient_accumulation_steps=3), _opt(fast, SPECULATE, gradient_accumulation_steps=3)
    for step in range(6):
        for model, opt in ((plain, a), (fast, b)):
            _backward(model, opt, step, torch.bfloat16)
            opt.step()
            opt.zero_grad()
    assert_same(a, b, plain, fast, "after 2 windows")
    spec = b._pipeline.speculation
    buckets = sum(len(buf.layout.buckets) for buf in b._pipeline.buffers)
    assert spec.ran == spec.kept == 2 * buckets  # on the last micro-step of each window only


def _stepped_once() -> tuple[nn.Module, zo.ShardedFusedAdam]:
    """A model and its optimizer with SuperOffload after one step (the state made)."""
    model = _model(torch.bfloat16)
    opt = _opt(model, SPECULATE)
    _backward(model, opt, 0, torch.bfloat16)
    opt.step()
    opt.zero_grad()
    return model, opt


def test_zero_grad_rolls_every_update_back_and_lets_its_copies_go() -> None:
    model, opt = _stepped_once()
    before = copy.deepcopy(opt.full_state_dict()["state"])
    _backward(model, opt, 1, torch.bfloat16)
    assert opt._pipeline.speculation.guesses
    opt.zero_grad()
    assert not opt._pipeline.speculation.guesses
    assert all(buf.guessed is None for buf in opt._pipeline.buffers)
    after = opt.full_state_dict()["state"]
    assert all(torch.equal(after[i][k], before[i][k]) for i in before for k in before[i])


def test_a_state_tensor_taken_before_backward_and_written_after_it_is_refused() -> None:
    model, opt = _stepped_once()
    held = opt.state[model[0].weight]["exp_avg"]
    _backward(model, opt, 1, torch.bfloat16)
    held.zero_()
    with pytest.raises(RuntimeError, match="super_offload: the optimizer state of the buffer holding .* was written"):
        opt.step()


def _written_on_one_rank(rank: int, world: int) -> None:
    """Rank 1 writes through a state tensor taken before backward: every rank raises at the step, none waits."""
    model = _model(torch.bfloat16)
    opt = _opt(model, SPECULATE)
    _backward(model, opt, rank, torch.bfloat16)
    opt.step()
    opt.zero_grad()
    held = opt.state[model[0].weight]["exp_avg"]
    _backward(model, opt, 10 + rank, torch.bfloat16)
    if rank == 1:
        held.zero_()
    with pytest.raises(RuntimeError, match=r"was written between backward.*found on rank 1 of 2; every rank raises"):
        opt.step()


@pytest.mark.distributed
def test_a_state_written_on_one_rank_is_refused_on_every_rank() -> None:
    run_ranks(_written_on_one_rank, 2, timeout_s=30.0)


def _ranks(rank: int, world: int) -> None:
    torch.manual_seed(0)
    pair_case(rank, world, 3, torch.bfloat16, SPECULATE)


@pytest.mark.distributed
def test_the_lockstep_schedule_on_two_ranks_is_exact() -> None:
    """Accumulation under ``no_sync``, clipping, an inf and AMSGrad, at 2 ranks, against the run without offload."""
    run_ranks(_ranks, 2)
