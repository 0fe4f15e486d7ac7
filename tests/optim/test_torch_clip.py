"""torch's own gradient clipping on a ``ShardedFusedAdam``'s parameters: right, or an error (``torch_clip``).

Against a single process running ``torch.optim.AdamW`` on the whole batch and torch's clip, at every
stage on 1, 2 and 3 ranks, with clipping active:

1. ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``, also through a reference bound
   before zero_kernels was imported, and ``get_total_norm`` of the gradients then
   ``clip_grads_with_norm_``: the same norm and the same weights as the reference.
2. With the optimizer's own accumulation (``gradient_accumulation_steps=2``) at stage 0, where
   ``p.grad`` holds the sum of the micro-steps: still the reference's norm and weights.
3. What cannot be right raises ``ValueError`` on every rank: some of the parameters (stages 1-3 on
   several ranks; at stage 0 torch's clip of a subset runs, as with DDP), the parameters and others
   that have gradients, ``get_total_norm([])`` while stage 2-3 holds this step's gradients, and
   ``clip_grad_value_``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_ as clip_bound_early  # bound at import, before any optimizer exists

import zero_kernels as zk
from tests.helpers.lockstep import LR, ROWS, Net, batch, compare, make_models

STAGES = (0, 1, 2, 3)
MAX_NORM = 0.05
STAGE3 = {"stage3_param_persistence_threshold": 10}


def _opt(model: Net, stage: int, **kwargs) -> zk.ShardedFusedAdam:
    extra = STAGE3 if stage == 3 else {}
    return zk.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=13, **extra, **kwargs)


def _backward(model: Net, ref: Net, rank: int, world: int, step: int, scale: float = 1.0) -> None:
    x = batch(step, world * ROWS)
    (model(x[rank * ROWS : (rank + 1) * ROWS]) * scale).backward()
    (ref(x) * scale).backward()


def _clip(how: str, model: Net) -> torch.Tensor:
    if how == "clip_grad_norm_":
        return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    if how == "bound early":
        return clip_bound_early(model.parameters(), MAX_NORM)
    params = list(model.parameters())
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm)
    return norm


def matches_reference(rank: int, world: int, stage: int, how: str) -> None:
    """Item 1: torch's clip on the sharded model vs torch's clip on the whole-batch reference."""
    model, ref = make_models(torch.float32)
    opt, ropt = _opt(model, stage), torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(3):
        _backward(model, ref, rank, world, step)
        if how == "get_total_norm" and stage >= 2:  # p.grad is None: the list is empty, which raises (item 3)
            norm = opt.clip_grad_norm_(float("inf"))
            torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), MAX_NORM, norm)
        else:
            norm = _clip(how, model)
        expected = nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        assert float(expected) > MAX_NORM, "clipping inactive"
        assert float(norm) == pytest.approx(float(expected), rel=1e-5), f"stage {stage} {how} step {step}: norm"
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
        with opt.gathered_params():
            compare(model, ref, f"stage {stage} world {world} {how} step {step}")


def accumulated_stage0(rank: int, world: int) -> None:
    """Item 2: stage 0 with the optimizer's own accumulation: ``p.grad`` is a sum the step divides."""
    model, ref = make_models(torch.float32)
    opt, ropt = _opt(model, 0, gradient_accumulation_steps=2), torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(2):
        for micro in range(2):
            x = batch(10 * step + micro, world * ROWS)
            model(x[rank * ROWS : (rank + 1) * ROWS]).backward()
            (ref(x) / 2).backward()
            if micro == 1:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                expected = nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
                assert float(norm) == pytest.approx(float(expected), rel=1e-5), f"accumulated step {step}: norm"
            opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
        compare(model, ref, f"stage 0 accumulated step {step}")


def refusals(rank: int, world: int, stage: int) -> None:
    """Item 3: calls that cannot be made right raise ValueError, on every rank."""
    model, ref = make_models(torch.float32)
    opt = _opt(model, stage)
    _backward(model, ref, rank, world, 0)
    sharded = stage >= 2 or (stage == 1 and world > 1)
    some = [model.emb.weight, model.emb.bias]
    if sharded:
        with pytest.raises(ValueError, match=r"given 2 of the \d+ parameters.*opt\.clip_grad_norm_"):
            torch.nn.utils.clip_grad_norm_(some, MAX_NORM)
        with pytest.raises(ValueError, match="clip_grad_value_ cannot clip"):
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    else:
        torch.nn.utils.clip_grad_norm_(some, MAX_NORM)  # p.grad is the mean over ranks: torch's clip is right
    other = nn.Linear(2, 1)
    other(torch.ones(1, 2)).sum().backward()
    if sharded:
        with pytest.raises(ValueError, match="have gradients but are not trained by the ShardedFusedAdam"):
            torch.nn.utils.clip_grad_norm_([*model.parameters(), *other.parameters()], MAX_NORM)
    if stage >= 2:
        with pytest.raises(ValueError, match=r"get_total_norm was given no gradients.*opt\.clip_grad_norm_"):
            torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    assert float(torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)) > 0  # not ours: torch's own
    opt.step()


def all_cases(rank: int, world: int) -> None:
    for stage in STAGES:
        for how in ("clip_grad_norm_", "bound early", "get_total_norm"):
            matches_reference(rank, world, stage, how)
        refusals(rank, world, stage)
    accumulated_stage0(rank, world)


def test_one_process_every_stage() -> None:
    all_cases(0, 1)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_every_stage(spawn, world: int) -> None:
    spawn(all_cases, world, timeout_s=300.0)
