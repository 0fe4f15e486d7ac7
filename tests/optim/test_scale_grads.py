"""``opt.scale_grads_(factor)``: the gradients scaled after backward, as ``p.grad *= factor`` scales them.

torchtune's loop sums the loss over tokens and divides the gradients by the token count once it is known
(``training.scale_grads``: ``p.grad *= factor`` over the model's parameters), then clips and logs the norm. At
stages 2 and 3 ``p.grad`` is None after backward, so that loop scales nothing; ``scale_grads_`` is the call that
reaches the sharded gradients. Against a single process running ``torch.optim.AdamW`` on the whole batch with
``p.grad *= factor`` and torch's clip, at every stage on 1 and 2 ranks, clipping active: scaled then clipped,
clipped then scaled, scaled twice: the same norms and weights; a step refused before any update keeps the scale
and the clip for the call that follows. A non-finite or negative factor, a call inside the accumulation window, a
gradient after it and ranks given different factors raise; ``zero_grad`` drops it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_kernels as zk
from tests.helpers.lockstep import LR, ROWS, Net, batch, make_models, step_and_compare
from zero_kernels.agreement import RanksDisagree

STAGES = (0, 1, 2, 3)
MAX_NORM = 0.05
SUM = 20.0  # the loss is summed, not averaged: its gradients are SUM times too large until scaled


def _opt(model: Net, stage: int, **kwargs) -> zk.ShardedFusedAdam:
    extra = {"stage3_param_persistence_threshold": 10} if stage == 3 else {}
    return zk.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=13, eps=1.0, **extra, **kwargs)


def _backward(model: Net, ref: Net, rank: int, world: int, step: int) -> None:
    x = batch(step, world * ROWS)
    (model(x[rank * ROWS : (rank + 1) * ROWS]) * SUM).backward()
    (ref(x) * SUM).backward()


def _scale_ref(ref: Net, factor: float) -> None:
    for p in ref.parameters():
        if p.grad is not None:
            p.grad *= factor


def matches_in_place_scaling(rank: int, world: int, stage: int) -> None:
    """Scaled then clipped, clipped then scaled, scaled twice: the norms and the weights as the reference's.
    Adam's ``eps`` is 1 on both sides, so the update follows the gradients' size (with 1e-8 it hides the scale)."""
    model, ref = make_models(torch.float32)
    opt, ropt = _opt(model, stage), torch.optim.AdamW(ref.parameters(), lr=LR, eps=1.0)
    for step in range(3):
        _backward(model, ref, rank, world, step)
        if step == 0:
            opt.scale_grads_(torch.tensor(1 / SUM))  # torchtune passes a tensor
            _scale_ref(ref, 1 / SUM)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM if step < 2 else float("inf"))
        expected = nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM if step < 2 else float("inf"))
        assert float(norm) == pytest.approx(float(expected), rel=1e-5), f"stage {stage} step {step}: norm"
        if step == 1:
            opt.scale_grads_(1 / SUM)
            _scale_ref(ref, 1 / SUM)
        if step == 2:
            for factor in (0.5, 0.1):
                opt.scale_grads_(factor)
                _scale_ref(ref, factor)
            measured = opt.clip_grad_norm_(float("inf"))
            assert float(measured) == pytest.approx(float(expected) * 0.05, rel=1e-5), f"stage {stage}: scaled norm"
        step_and_compare(opt, ropt, model, ref, f"stage {stage} world {world} scale_grads_ step {step}")


def refusals(rank: int, world: int, stage: int) -> None:
    """A gradient after the scale raises (at the step on several ranks); ``zero_grad`` drops the scale with the
    gradients."""
    model, ref = make_models(torch.float32)
    opt, ropt = _opt(model, stage), torch.optim.AdamW(ref.parameters(), lr=LR, eps=1.0)
    for bad in (float("nan"), -0.5):
        with pytest.raises(ValueError, match=f"factor={bad}: give a finite number >= 0"):
            opt.scale_grads_(bad)
    _backward(model, ref, rank, world, 0)
    opt.scale_grads_(0.5)
    with pytest.raises(RuntimeError, match="or scale_grads_ scaled them"):
        _backward(model, ref, rank, world, 1)  # on one rank it raises here already
        opt.step()
    opt.zero_grad()
    ropt.zero_grad()
    _backward(model, ref, rank, world, 2)
    step_and_compare(opt, ropt, model, ref, f"stage {stage} world {world} after zero_grad: unscaled")


def _scaled_and_clipped(rank: int, world: int, stage: int) -> tuple[Net, Net, zk.ShardedFusedAdam, torch.optim.AdamW]:
    """A backward, then a scale and a clip asked of the step (the reference's gradients scaled and clipped)."""
    model, ref = make_models(torch.float32)
    opt, ropt = _opt(model, stage), torch.optim.AdamW(ref.parameters(), lr=LR, eps=1.0)
    _backward(model, ref, rank, world, 0)
    opt.scale_grads_(1 / SUM)
    _scale_ref(ref, 1 / SUM)
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    assert float(nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)) > MAX_NORM, "clipping inactive"
    return model, ref, opt, ropt


def refused_then_retried(rank: int, world: int, stage: int) -> None:
    """A step refused before any update (a NaN lr) keeps the scale and the clip asked for: called again once the
    lr is fixed, it applies them (they were dropped: the retry ran unscaled and unclipped)."""
    model, ref, opt, ropt = _scaled_and_clipped(rank, world, stage)
    opt.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match="is nan"):
        opt.step()
    opt.param_groups[0]["lr"] = LR
    step_and_compare(opt, ropt, model, ref, f"stage {stage} world {world} retried after a refused step")


def saved_in_between(rank: int, world: int, stage: int, folder: str) -> None:
    """A checkpoint saved between the scale (and a clip) and the step keeps them with the window: the resumed
    optimizer's step applies them, and refuses a later gradient (they were lost: 5e-3 off AdamW)."""
    model, ref, opt, ropt = _scaled_and_clipped(rank, world, stage)
    path = f"{folder}/stage{stage}"
    zk.checkpoint.save(path, model, opt)
    resumed, _ = make_models(torch.float32)
    opt2 = _opt(resumed, stage)
    zk.checkpoint.load(path, resumed, opt2)
    assert opt2.grad_edits() == opt.grad_edits() is not None
    step_and_compare(opt2, ropt, resumed, ref, f"stage {stage} world {world} resumed between scale and step")
    fresh, _ = make_models(torch.float32)
    opt3 = _opt(fresh, stage)
    zk.checkpoint.load(path, fresh, opt3)
    with pytest.raises(RuntimeError, match="or scale_grads_ scaled them"):
        fresh(batch(1, ROWS)).backward()  # on one rank it raises here already
        opt3.step()


def measured_then_saved(rank: int, world: int, stage: int, folder: str) -> None:
    """A norm only measured (``clip_grad_norm_(inf)``, to log it) clips nothing, so a later backward is taken before
    the step, and so it is after a checkpoint saved in between (it was refused there)."""
    model, ref = make_models(torch.float32)
    opt, ropt = _opt(model, stage), torch.optim.AdamW(ref.parameters(), lr=LR, eps=1.0)
    _backward(model, ref, rank, world, 0)
    opt.clip_grad_norm_(float("inf"))
    path = f"{folder}/measured{stage}"
    zk.checkpoint.save(path, model, opt)
    resumed, _ = make_models(torch.float32)
    opt2 = _opt(resumed, stage)
    zk.checkpoint.load(path, resumed, opt2)
    _backward(resumed, ref, rank, world, 1)
    step_and_compare(opt2, ropt, resumed, ref, f"stage {stage} world {world} a measure saved, then a backward")


def checkpoint_cases(rank: int, world: int, folder: str) -> None:
    for stage in STAGES:
        saved_in_between(rank, world, stage, folder)
        measured_then_saved(rank, world, stage, folder)


def all_cases(rank: int, world: int) -> None:
    for stage in STAGES:
        matches_in_place_scaling(rank, world, stage)
        refusals(rank, world, stage)
        refused_then_retried(rank, world, stage)


def disagreeing(rank: int, world: int) -> None:
    model, ref = make_models(torch.float32)
    opt = _opt(model, 2)
    _backward(model, ref, rank, world, 0)
    opt.scale_grads_(0.5 if rank == 0 else 0.25)
    with pytest.raises(RanksDisagree, match="scale_grads_"):
        opt.step()


def test_one_process_every_stage() -> None:
    all_cases(0, 1)


@pytest.mark.distributed
def test_ranks_every_stage(spawn) -> None:
    spawn(all_cases, 2, timeout_s=300.0)


@pytest.mark.distributed
def test_a_checkpoint_in_between_keeps_them(spawn, tmp_path) -> None:
    spawn(checkpoint_cases, 2, str(tmp_path), timeout_s=300.0)


@pytest.mark.distributed
def test_ranks_given_different_factors_are_refused(spawn) -> None:
    spawn(disagreeing, 2, timeout_s=120.0)


def test_inside_the_accumulation_window_it_is_refused() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=2, gradient_accumulation_steps=2)
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="scale_grads_ on accumulation micro-step 1 of 2"):
        opt.scale_grads_(0.5)
