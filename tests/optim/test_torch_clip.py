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
4. ``norm_type`` inf, 1 and 3 at every stage: torch's ``clip_grad_norm_`` (and ``get_total_norm`` then
   ``clip_grads_with_norm_``) give the reference's norm and weights, also with fp16 loss scaling and two
   accumulation steps, and with stage 3's gradients in files (``offload_optimizer`` nvme); a NaN in one rank's
   shard makes the inf norm NaN on every rank; an order that
   measures no size (0, negative, NaN, not a number) raises ``ValueError`` naming ``norm_type``.
5. Several clips before one step compose as torch's do (stages 1-3 apply them at the step): two
   ``clip_grad_norm_`` calls, and a measure then ``clip_grads_with_norm_`` after a clip: each returned norm and the
   weights as the reference's.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_ as clip_bound_early  # bound at import, before any optimizer exists

import zero_kernels as zk
from tests.helpers.check import assert_close
from tests.helpers.lockstep import LR, ROWS, Net, batch, compare, extra_rows, local, make_models, step_and_compare

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
        step_and_compare(opt, ropt, model, ref, f"stage {stage} world {world} {how} step {step}")


def used_on_some_ranks(rank: int, world: int, stage: int) -> None:
    """A parameter only rank 0's rows use (``Net.extra`` at step 0): torch's clip over ``p.grad`` and a GradScaler's
    ``unscale_`` see its reduced gradient on every rank, as with DDP (at stage 0 ``p.grad`` was None on the other
    ranks: each clipped by another norm, or left it scaled, and the replicas drifted 1.8e-2 apart in 3 steps)."""
    model, ref = make_models(torch.float32)
    opt, ropt = _opt(model, stage), torch.optim.AdamW(ref.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(3):
        x, span = batch(step, world * ROWS), extra_rows(step, world)
        scaler.scale(model(x[rank * ROWS : (rank + 1) * ROWS], local(span, rank, stage))).backward()
        ref(x, span).backward()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        expected = nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        if stage < 2 or step > 0:  # stages 2-3 return the scaled norm before the first scaler.step (README)
            assert float(norm) == pytest.approx(float(expected), rel=1e-5), f"stage {stage} step {step}: norm"
        scaler.step(opt)
        scaler.update()
        ropt.step()
        for o in (opt, ropt):
            o.zero_grad()
        with opt.gathered_params():
            compare(model, ref, f"stage {stage} world {world} a parameter some ranks use, step {step}")


def after_no_sync(rank: int, world: int, stage: int, order: str) -> None:
    """Backward passes under ``no_sync()`` the step reduces (all of them, or one after the synchronised backward, which
    the README says counts too), then torch's clip: at stage 0 ``p.grad`` held this rank's own part there, which torch's
    clip measured and clipped on each rank alone (5.0e-2 off AdamW after 3 steps, 6.7e-2 with every backward under
    ``no_sync``, no error); the clip is routed to the optimizer, which reduces first."""
    model, ref = make_models(torch.float32)
    opt, ropt = _opt(model, stage), torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(3):
        for micro in range(2):
            x, span = batch(2 * step + micro, world * ROWS), extra_rows(2 * step + micro, world)
            loss = model(x[rank * ROWS : (rank + 1) * ROWS], local(span, rank, stage))
            if order == "every backward under no_sync" or micro == 1:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
            ref(x, span).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        expected = nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        assert float(norm) == pytest.approx(float(expected), rel=1e-5), f"stage {stage} {order} step {step}: norm"
        step_and_compare(opt, ropt, model, ref, f"stage {stage} world {world} {order}, torch's clip, step {step}")


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


def clipped_twice(rank: int, world: int, stage: int) -> None:
    """Item 5: clips before one step compose as torch's in-place clips do: the tighter of two holds and the second
    returns the norm the first left; ``opt.clip_grad_norm_(inf)`` after a clip measures what it left, and
    ``clip_grads_with_norm_`` with a given norm clips on top. Adam's ``eps`` is 1 on both sides, so the update
    follows the gradients' size (with 1e-8 it would hide a clip coefficient)."""
    model, ref = make_models(torch.float32)
    opt, ropt = _opt(model, stage, eps=1.0), torch.optim.AdamW(ref.parameters(), lr=LR, eps=1.0)
    for step in range(2):
        _backward(model, ref, rank, world, step)
        got = [torch.nn.utils.clip_grad_norm_(model.parameters(), 0.02)]
        want = [nn.utils.clip_grad_norm_(ref.parameters(), 0.02)]
        if step == 0:
            got.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
            want.append(nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        else:
            got.append(opt.clip_grad_norm_(float("inf")))
            want.append(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None]))
            torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), 0.01, got[-1])
            torch.nn.utils.clip_grads_with_norm_(list(ref.parameters()), 0.01, want[-1])
        assert float(want[0]) > MAX_NORM, "clipping inactive"
        for i, (g, w) in enumerate(zip(got, want)):
            assert float(g) == pytest.approx(float(w), rel=1e-5), f"stage {stage} step {step}: norm {i}"
        step_and_compare(opt, ropt, model, ref, f"stage {stage} world {world} clipped twice step {step}")


def clipped_by_both(rank: int, world: int, stage: int) -> None:
    """``opt.clip_grad_norm_`` and torch's ``clip_grad_norm_`` before one step, in either order, compose as two of
    torch's: at stage 0 ``p.grad`` is exact, so torch's own clip runs, unless the optimizer holds a clip asked for
    and not yet applied (it is then routed to the optimizer, which sees that clip)."""
    model, ref = make_models(torch.float32)
    opt, ropt = _opt(model, stage, eps=1.0), torch.optim.AdamW(ref.parameters(), lr=LR, eps=1.0)
    for step in range(2):
        _backward(model, ref, rank, world, step)
        want = [nn.utils.clip_grad_norm_(ref.parameters(), 0.02), nn.utils.clip_grad_norm_(ref.parameters(), 0.05)]
        if step == 0:
            got = [opt.clip_grad_norm_(0.02), torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)]
        else:
            got = [torch.nn.utils.clip_grad_norm_(model.parameters(), 0.02), opt.clip_grad_norm_(0.05)]
        assert float(want[0]) > 0.05, "clipping inactive"
        for i, (g, w) in enumerate(zip(got, want)):
            assert float(g) == pytest.approx(float(w), rel=1e-5), f"stage {stage} step {step}: norm {i}"
        step_and_compare(opt, ropt, model, ref, f"stage {stage} world {world} clipped by both, step {step}")


def measured_then_torch(rank: int, world: int) -> None:
    """Stage 0: ``opt.clip_grad_norm_(inf)`` only measures (to log the norm), so ``p.grad`` stays exact and torch's
    clip on a subset and ``clip_grad_value_`` run as usual after it (they were refused)."""
    model, ref = make_models(torch.float32)
    opt, ropt = _opt(model, 0, eps=1.0), torch.optim.AdamW(ref.parameters(), lr=LR, eps=1.0)
    _backward(model, ref, rank, world, 0)
    got = opt.clip_grad_norm_(float("inf"))
    want = nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None])
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for m in (model, ref):
        nn.utils.clip_grad_norm_([m.emb.weight, m.head.weight], 0.01)
        nn.utils.clip_grad_value_(list(m.parameters()), 1e-3)
    step_and_compare(opt, ropt, model, ref, f"stage 0 world {world} measured, then torch's clips")


def refusals(rank: int, world: int, stage: int) -> None:
    """Item 3: calls that cannot be made right raise ValueError, on every rank."""
    model, ref = make_models(torch.float32)
    opt = _opt(model, stage)
    _backward(model, ref, rank, world, 0)
    sharded = stage >= 2 or (stage == 1 and world > 1)
    some = [model.emb.weight, model.emb.bias]
    if sharded:
        with pytest.raises(ValueError, match=r"given 2 of the 9 parameters.*opt\.clip_grad_norm_"):  # not the frozen
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
    if sharded:  # all of the optimizer's parameters but its frozen one: accepted
        trainable = [p for p in model.parameters() if p.requires_grad]
        expected = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None])
        norm = torch.nn.utils.clip_grad_norm_(trainable, MAX_NORM)
        assert float(norm) == pytest.approx(float(expected), rel=1e-5), f"stage {stage}: norm of the trainable ones"
    opt.step()


NORM_TYPES = (math.inf, 1.0, 3.0)


def _norm_opt(model: Net, stage: int, how: str, scratch: str, rank: int) -> zk.ShardedFusedAdam:
    if how == "fp16 accumulated":  # the norm divides out the loss scale and the accumulation, as the step does
        return _opt(model, stage, fp16={"enabled": True, "initial_scale_power": 8}, gradient_accumulation_steps=2)
    if how == "files":
        nvme = Path(scratch) / f"nvme{rank}"
        nvme.mkdir(parents=True, exist_ok=True)
        return _opt(model, stage, offload_optimizer={"device": "nvme", "nvme_path": str(nvme)}, sub_group_size=32)
    return _opt(model, stage)


def _norm_backward(model: Net, ref: Net, opt: zk.ShardedFusedAdam, rank: int, world: int, step: int) -> None:
    micro = opt.gradient_accumulation_steps
    for m in range(micro):
        x = batch(10 * step + m, world * ROWS)
        opt.backward(model(x[rank * ROWS : (rank + 1) * ROWS]))  # times the loss scale, if any
        (ref(x) / micro).backward()
        if m + 1 < micro:
            opt.step()  # a micro-step: no update


def norm_types(rank: int, world: int, stage: int, norm_type: float, how: str, scratch: str = "") -> None:
    """Item 4: torch's clip of order ``norm_type`` on the sharded model vs on the whole-batch reference."""
    model, ref = make_models(torch.float32)
    opt, ropt = _norm_opt(model, stage, how, scratch, rank), torch.optim.AdamW(ref.parameters(), lr=LR)
    what = f"stage {stage} world {world} norm_type {norm_type} {how}"
    for step in range(3):
        _norm_backward(model, ref, opt, rank, world, step)
        expected = nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None], norm_type)
        max_norm = float(expected) / 2  # clipping active
        if how == "get_total_norm" and stage <= 1:  # p.grad is set at stages 0-1 only
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None], norm_type)
            torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), max_norm, norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)
        nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type=norm_type)
        assert float(norm) == pytest.approx(float(expected), rel=1e-5), f"{what} step {step}: norm"
        step_and_compare(opt, ropt, model, ref, f"{what} step {step}")


def bad_norm_types(rank: int, world: int, stage: int) -> None:
    """Item 4: orders that measure no size are refused, naming norm_type, on every rank."""
    model, ref = make_models(torch.float32)
    opt = _opt(model, stage)
    _backward(model, ref, rank, world, 0)
    for bad in (0, -1.0, -math.inf, math.nan, "two"):
        with pytest.raises(ValueError, match=r"clip_grad_norm_: norm_type must be a positive number or inf"):
            opt.clip_grad_norm_(MAX_NORM, bad)
    opt.step()


def nan_in_one_shard(rank: int, world: int, stage: int) -> None:
    """Item 4: a NaN in one element of the gradients makes the inf norm NaN on every rank (as torch's), whichever
    rank's shard holds it (a max all-reduce need not carry a NaN): the first and last element of each parameter."""
    names = [n for n, p in Net().named_parameters() if p.requires_grad]
    for name in names:
        for where in (0, -1):
            model, _ = make_models(torch.float32)
            opt = _opt(model, stage)
            x = batch(0, world * ROWS)
            nan = torch.tensor(math.nan) * model.get_parameter(name).flatten()[where]
            (model(x[rank * ROWS : (rank + 1) * ROWS]) + nan).backward()
            norm = opt.clip_grad_norm_(MAX_NORM, math.inf)
            assert math.isnan(float(norm)), f"stage {stage} world {world} {name}[{where}]: inf norm {float(norm)}"
            opt.zero_grad()


def norm_type_cases(rank: int, world: int, scratch: str) -> None:
    for stage in STAGES:
        for norm_type in NORM_TYPES:
            for how in ("clip_grad_norm_", "get_total_norm", "fp16 accumulated"):
                norm_types(rank, world, stage, norm_type, how)
        bad_norm_types(rank, world, stage)
        if stage < 3:  # stage 3 reads parameters only in a forward
            nan_in_one_shard(rank, world, stage)
    for norm_type in NORM_TYPES:
        norm_types(rank, world, 3, norm_type, "files", scratch)


def all_cases(rank: int, world: int) -> None:
    for stage in STAGES:
        for how in ("clip_grad_norm_", "bound early", "get_total_norm"):
            matches_reference(rank, world, stage, how)
        clipped_twice(rank, world, stage)
        clipped_by_both(rank, world, stage)
        used_on_some_ranks(rank, world, stage)
        for order in ("a no_sync backward after the synchronised one", "every backward under no_sync"):
            after_no_sync(rank, world, stage, order)
        refusals(rank, world, stage)
    accumulated_stage0(rank, world)
    measured_then_torch(rank, world)


def test_one_process_every_stage() -> None:
    all_cases(0, 1)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_every_stage(spawn, world: int) -> None:
    spawn(all_cases, world, timeout_s=300.0)


def test_norm_types_one_process(tmp_path: Path) -> None:
    norm_type_cases(0, 1, str(tmp_path))


@pytest.mark.distributed
def test_norm_types_on_ranks(spawn, tmp_path: Path) -> None:
    spawn(norm_type_cases, 2, str(tmp_path), timeout_s=600.0)


def test_a_clip_inside_the_accumulation_window_is_refused_and_names_the_remedy() -> None:
    """The gradients are complete only at the micro-step that updates: a clip before it raises, naming where to
    call it (and Accelerate's count, whose ``sync_gradients`` loops clip by); at that micro-step it clips."""
    import zero_kernels as zk

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=0, gradient_accumulation_steps=2)
    model(torch.randn(4, 3)).sum().backward()
    said = r"clip_grad_norm_ on accumulation micro-step 1 of 2: .*Accelerator\(gradient_accumulation_steps=\.\.\.\)"
    with pytest.raises(RuntimeError, match=said):
        opt.clip_grad_norm_(1.0)
    opt.step()
    model(torch.randn(4, 3)).sum().backward()
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])) / 2
    assert float(opt.clip_grad_norm_(1.0)) == pytest.approx(float(expected), rel=1e-6)


@pytest.mark.parametrize("stage", (0, 1, 2))  # stage 3 reads parameters only in a forward
def test_an_inf_gradient_under_an_inf_norm_clip_clips_nothing(stage: int) -> None:
    """An inf in one gradient element with ``skip_nonfinite_steps=False``: ``clip_grad_norm_(max_norm, inf)`` returns
    inf (torch's norm, not the largest finite float) and, the norm being non-finite, clips nothing (README, When
    things go wrong): the step is AdamW's on the unclipped gradients, the inf element NaN and every other element
    updated, for the last element of each parameter."""
    names = [n for n, p in Net().named_parameters() if p.requires_grad]
    for name in names:
        model, ref = make_models(torch.float32)
        opt, ropt = _opt(model, stage, skip_nonfinite_steps=False), torch.optim.AdamW(ref.parameters(), lr=LR)
        for m in (model, ref):
            (m(batch(0, ROWS)) + torch.tensor(math.inf) * m.get_parameter(name).flatten()[-1]).backward()
        norm = opt.clip_grad_norm_(MAX_NORM, math.inf)
        assert float(norm) == math.inf, f"stage {stage} {name}: inf norm {float(norm)}"
        opt.step()
        ropt.step()
        for (n, p), r in zip(model.named_parameters(), ref.parameters()):
            scale = r.detach().nan_to_num(0.0).abs().max().item()
            assert_close(p, r, rtol=1e-5, atol=1e-6 * scale, what=f"stage {stage} inf in {name}: {n}")
        assert model.get_parameter(name).flatten()[-1].isnan()
