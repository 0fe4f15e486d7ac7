"""DeepSpeed's tensor-fragment functions (``zk.safe_get_full_fp32_param`` and the rest, ``optim.fragments``).

Against a single process running ``torch.optim.AdamW`` on the whole batch, at every stage on 1 and 2 ranks (and
with ``gradient_accumulation_steps`` 2): the full gradient after backward is the reference's ``p.grad`` (after a
clip too), None for a parameter no rank used and for a frozen one; the full fp32 value and the moments after a
step are the reference's; the local pieces are what ``opt.state[p]`` shows. Values set (a gradient, a weight, the
moments) are what the step then uses: the run goes on equal to a reference given the same values. bf16: a full
fp32 value set is kept bit for bit (not the parameter's rounding of it), and the model reads it rounded at once.
Misuse raises: a parameter no optimizer trains, a wrong shape or key, inside the accumulation window, state
before the first step, a gradient arriving after one was set.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn

import zero_kernels as zk
from tests.helpers.check import assert_close
from tests.helpers.lockstep import LR, ROWS, Net, batch, compare, extra_rows, local, make_models, step_and_compare
from tests.offload.exactness import copying

STAGES = (0, 1, 2, 3)


def _opt(model: nn.Module, stage: int, **kwargs) -> zk.ShardedFusedAdam:
    extra = {"stage3_param_persistence_threshold": 10} if stage == 3 else {}
    return zk.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=13, **extra, **kwargs)


def _backward(model: Net, ref: Net, rank: int, world: int, step: int, stage: int, ref_scale: float = 1.0) -> None:
    x, span = batch(step, world * ROWS), extra_rows(step, world)
    mine = x[rank * ROWS : (rank + 1) * ROWS].to(model.emb.weight.dtype)
    model(mine, local(span, rank, stage)).backward()
    (ref(x, span) * ref_scale).backward()


def _close(actual, expected: torch.Tensor, what: str, atol: float = 1e-6) -> None:
    """As ``lockstep.compare``; ``atol`` relative to the tensor's largest magnitude (moments: a sum of gradients
    that cancel, whose small elements carry the absolute error of the large ones)."""
    assert actual is not None, f"{what}: None"
    assert actual.dtype == torch.float32 and actual.shape == expected.shape, f"{what}: {actual.dtype} {actual.shape}"
    assert_close(actual, expected, rtol=1e-5, atol=atol * expected.abs().max().item(), what=what)


def _named(model: Net, ref: Net) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
    return [(n, p, r) for (n, p), r in zip(model.named_parameters(), ref.parameters())]


def reads_match_adamw(rank: int, world: int, stage: int, **kwargs) -> None:
    """Gradients after backward (clipped at the second step), values and moments after each step, local pieces."""
    model, ref = make_models(torch.float32)
    opt, ropt = _opt(model, stage, **kwargs), torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(3):
        _backward(model, ref, rank, world, step, stage)
        if step == 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            assert float(nn.utils.clip_grad_norm_(ref.parameters(), 0.05)) > 0.05, "clipping inactive"
        for name, p, r in _named(model, ref):
            what = f"stage {stage} world {world} step {step} {name}"
            grad = zk.safe_get_full_grad(p)
            if r.grad is None:
                assert grad is None, f"{what}: a gradient for a parameter no rank used"
            else:
                _close(grad, r.grad, f"{what} grad")
            state = zk.safe_get_full_optimizer_state(p, "exp_avg")
            assert (state is None) == (step == 0 or not p.requires_grad), f"{what}: state before the first step"
        step_and_compare(opt, ropt, model, ref, f"stage {stage} world {world} step {step}")
        for name, p, r in _named(model, ref):
            what = f"stage {stage} world {world} after step {step} {name}"
            if not p.requires_grad:
                assert zk.safe_get_full_fp32_param(p) is None and zk.safe_get_full_grad(p) is None, what
                continue
            _close(zk.safe_get_full_fp32_param(p), r.detach(), f"{what} fp32 param")
            for key in ("exp_avg", "exp_avg_sq"):
                _close(zk.safe_get_full_optimizer_state(p, key), ropt.state[r][key], f"{what} {key}", atol=1e-5)
                shown = opt.state[p].get(key)
                piece = zk.safe_get_local_optimizer_state(p, key)
                assert torch.equal(piece, torch.empty(0) if shown is None else shown.reshape(-1)), f"{what} local {key}"
            shown = opt.state[p].get("exp_avg")
            assert zk.safe_get_local_fp32_param(p).numel() == (0 if shown is None else shown.numel()), what


def writes_reach_the_step(rank: int, world: int, stage: int, **kwargs) -> None:
    """A gradient set after backward (full and through the vectorized update), weights and moments set after a step:
    the run goes on as the reference given the same values."""
    model, ref = make_models(torch.float32)
    opt, ropt = _opt(model, stage, **kwargs), torch.optim.AdamW(ref.parameters(), lr=LR)
    _backward(model, ref, rank, world, 0, stage)
    g = torch.Generator().manual_seed(7)
    new = torch.randn(ref.emb.weight.shape, generator=g) * 0.1
    zk.safe_set_full_grad(model.emb.weight, new)
    ref.emb.weight.grad.copy_(new)
    _close(zk.safe_get_full_grad(model.emb.weight), new, "the gradient set, read back")
    zk.safe_update_full_grad_vectorized(list(model.parameters()), lambda grad, p: None if grad is None else grad * 0.5)
    for r in ref.parameters():
        if r.grad is not None:
            r.grad.mul_(0.5)
    step_and_compare(opt, ropt, model, ref, f"stage {stage} world {world} gradients set")
    weight, moment = torch.randn(ref.mid.weight.shape, generator=g), torch.rand(ref.head.bias.shape, generator=g)
    zk.safe_set_full_fp32_param(model.mid.weight, weight)
    zk.safe_set_full_optimizer_state(model.head.bias, moment, "exp_avg_sq")
    with torch.no_grad():
        ref.mid.weight.copy_(weight)
    ropt.state[ref.head.bias]["exp_avg_sq"].copy_(moment)
    with opt.gathered_params():
        assert torch.equal(model.mid.weight.detach(), weight), "the model reads a weight set at once"
    for step in (1, 2):
        _backward(model, ref, rank, world, step, stage)
        step_and_compare(opt, ropt, model, ref, f"stage {stage} world {world} after values set, step {step}")


def local_writes(rank: int, world: int, stage: int, **kwargs) -> None:
    """Each rank sets its own piece of the moments and of the fp32 value, as the full values cut: the same run as
    full sets (the model reads the local weight after the next step)."""
    model, ref = make_models(torch.float32)
    opt, ropt = _opt(model, stage, **kwargs), torch.optim.AdamW(ref.parameters(), lr=LR)
    _backward(model, ref, rank, world, 0, stage)
    step_and_compare(opt, ropt, model, ref, "first step")
    p, r = model.mid.weight, ref.mid.weight
    old = zk.safe_get_local_fp32_param(p)
    zk.safe_set_local_fp32_param(p, old * 2)
    zk.safe_set_local_optimizer_state(p, zk.safe_get_local_optimizer_state(p, "exp_avg") * 3, "exp_avg")
    with torch.no_grad():
        r.mul_(2)
    ropt.state[r]["exp_avg"].mul_(3)
    _close(zk.safe_get_full_fp32_param(p), r.detach(), "the full value after local writes")
    _backward(model, ref, rank, world, 1, stage)
    zk.safe_set_local_grad(p, zk.safe_get_local_grad(p) * 0.25)
    r.grad.mul_(0.25)
    step_and_compare(opt, ropt, model, ref, f"stage {stage} world {world} after local writes")


def accumulated(rank: int, world: int, stage: int) -> None:
    """With gradient_accumulation_steps 2 the gradient read (and set) is the one the step uses: the window's mean;
    inside the window it is refused."""
    model, ref = make_models(torch.float32)
    opt, ropt = _opt(model, stage, gradient_accumulation_steps=2), torch.optim.AdamW(ref.parameters(), lr=LR)
    _backward(model, ref, rank, world, 0, stage, ref_scale=0.5)
    with pytest.raises(RuntimeError, match="safe_get_full_grad on accumulation micro-step 1 of 2"):
        zk.safe_get_full_grad(model.head.weight)
    opt.step()
    _backward(model, ref, rank, world, 2, stage, ref_scale=0.5)
    _close(zk.safe_get_full_grad(model.head.weight), ref.head.weight.grad, "the window's gradient")
    zk.safe_set_full_grad(model.head.weight, ref.head.weight.grad * 3)
    ref.head.weight.grad.mul_(3)
    step_and_compare(opt, ropt, model, ref, f"stage {stage} world {world} accumulated, a gradient set")


def bf16_values_kept_exactly(rank: int, world: int, stage: int) -> None:
    """A full fp32 value set on a bf16 parameter is its master bit for bit (a step at lr 0 keeps it) and the model
    reads it rounded at once; a moment set is read back bit for bit."""
    model, ref = make_models(torch.bfloat16)
    opt = _opt(model, stage, weight_decay=0.0)
    _backward(model, ref, rank, world, 0, stage)
    opt.step()
    opt.zero_grad()
    p = model.mid.weight
    with pytest.raises(KeyError, match="holds exp_avg, exp_avg_sq \\(max_exp_avg_sq once its group uses AMSGrad"):
        zk.safe_get_local_optimizer_state(p, "max_exp_avg_sq")
    value = torch.randn(ref.mid.weight.shape, generator=torch.Generator().manual_seed(3))
    zk.safe_set_full_fp32_param(p, value)
    zk.safe_set_full_optimizer_state(p, value.abs(), "exp_avg_sq")
    with opt.gathered_params():
        assert torch.equal(p.detach(), value.to(torch.bfloat16)), "the model reads the value rounded"
    assert torch.equal(zk.safe_get_full_fp32_param(p), value), "the fp32 value read back"
    assert torch.equal(zk.safe_get_full_optimizer_state(p, "exp_avg_sq"), value.abs()), "the moment read back"
    opt.param_groups[0]["lr"] = 0.0
    _backward(model, ref, rank, world, 1, stage)
    opt.step()
    assert torch.equal(zk.safe_get_full_fp32_param(p), value), "a step at lr 0 kept the fp32 value set"
    before = zk.safe_get_full_fp32_param(model.mid.bias)
    with opt.gathered_params():
        model.mid.bias.data.mul_(2)  # an edit of the parameter: the master takes it, as the next step would
    assert torch.equal(zk.safe_get_full_fp32_param(model.mid.bias), (before.to(torch.bfloat16) * 2).float())
    replaced = torch.full(ref.head.weight.shape, 0.5, dtype=torch.bfloat16)
    model.head.weight.data = replaced.clone()  # followed, as by the step
    assert torch.equal(zk.safe_get_full_fp32_param(model.head.weight), replaced.float()), "a replaced .data"


def _scaled_steps(rank: int, world: int, stage: int, steps: int, between: Callable, what: str) -> None:
    """Steps under a GradScaler, ``between(model, ref, opt, step)`` after each backward; the weights and moments
    compared with AdamW's after each step."""
    model, ref = make_models(torch.float32)
    opt, ropt = _opt(model, stage), torch.optim.AdamW(ref.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(steps):
        x, span = batch(step, world * ROWS), extra_rows(step, world)
        scaler.scale(model(x[rank * ROWS : (rank + 1) * ROWS], local(span, rank, stage))).backward()
        ref(x, span).backward()
        between(model, ref, opt, scaler)
        scaler.step(opt)
        scaler.update()
        ropt.step()
        for o in (opt, ropt):
            o.zero_grad()
        name = f"stage {stage} world {world} GradScaler, {what}, step {step}"
        with opt.gathered_params():
            compare(model, ref, name)
        for p, r in ((model.mid.weight, ref.mid.weight), (model.emb.weight, ref.emb.weight)):
            for key in ("exp_avg", "exp_avg_sq"):
                _close(zk.safe_get_full_optimizer_state(p, key), ropt.state[r][key], f"{name} {key}", atol=1e-5)


def set_under_grad_scaler(rank: int, world: int, stage: int) -> None:
    """A gradient set under a GradScaler is what the update uses, also at the first step, before the optimizer has
    seen the scaler (the step then divides the scale out of the set value too: it is multiplied in at the step)."""
    values = torch.Generator().manual_seed(0)

    def set_one(model: Net, ref: Net, opt: zk.ShardedFusedAdam, scaler: torch.amp.GradScaler) -> None:
        new = torch.randn(ref.mid.weight.shape, generator=values) * 0.1
        zk.safe_set_full_grad(model.mid.weight, new)
        ref.mid.weight.grad.copy_(new)

    _scaled_steps(rank, world, stage, 2, set_one, "a gradient set")


def read_before_unscale(rank: int, world: int, stage: int) -> None:
    """A gradient read (which reduces stage 1's gradients early), then ``scaler.unscale_(opt)`` and the step, from the
    first step on: the update unscales what the read reduced (stage 1 on 2 ranks used the still-scaled shard: moments
    1023x and 1048575x AdamW's, no error)."""

    def read_then_unscale(model: Net, ref: Net, opt: zk.ShardedFusedAdam, scaler: torch.amp.GradScaler) -> None:
        zk.safe_get_full_grad(model.head.weight)
        scaler.unscale_(opt)

    _scaled_steps(rank, world, stage, 3, read_then_unscale, "a gradient read before unscale_")


def misuse(rank: int, world: int, stage: int) -> None:
    model, ref = make_models(torch.float32)
    opt = _opt(model, stage)
    stray = nn.Parameter(torch.ones(3))
    assert zk.safe_get_full_fp32_param(stray) is None and zk.safe_get_local_grad(stray) is None
    for setter in (zk.safe_set_full_fp32_param, zk.safe_set_full_grad):
        with pytest.raises(ValueError, match="not trained by any live ShardedFusedAdam"):
            setter(model.frozen, torch.zeros(5))
    with pytest.raises(ValueError, match=r"a value of shape \(3,\) for a parameter of shape \(5, 11\)"):
        zk.safe_set_full_fp32_param(model.mid.weight, torch.zeros(3))
    with pytest.raises(TypeError, match=r"None for the parameter of shape \(5, 11\).*requires_grad_\(False\)"):
        zk.safe_set_full_grad(model.mid.weight, None)  # was "Could not infer dtype of NoneType"
    with pytest.raises(KeyError, match="optim_state_key must be one of exp_avg, exp_avg_sq, max_exp_avg_sq"):
        zk.safe_get_full_optimizer_state(model.mid.weight, "momentum_buffer")
    with pytest.raises(RuntimeError, match="has not stepped yet"):
        zk.safe_set_full_optimizer_state(model.mid.weight, torch.zeros(5, 11), "exp_avg")
    _backward(model, ref, rank, world, 0, stage)
    zk.safe_set_full_grad(model.head.bias, torch.ones(1))
    with pytest.raises(RuntimeError, match="or safe_set_full_grad set one"):
        _backward(model, ref, rank, world, 1, stage)  # on one rank it may raise here already
        opt.step()


def all_cases(rank: int, world: int) -> None:
    for stage in STAGES:
        reads_match_adamw(rank, world, stage)
        writes_reach_the_step(rank, world, stage)
        local_writes(rank, world, stage)
        accumulated(rank, world, stage)
        bf16_values_kept_exactly(rank, world, stage)
        set_under_grad_scaler(rank, world, stage)
        read_before_unscale(rank, world, stage)
        misuse(rank, world, stage)


def offloaded_cases(rank: int, world: int, folder: str) -> None:
    """The state in host memory (copied down and up as from a GPU) at stage 2, on disk at stage 3 (the gradient
    shards in files too: a local gradient set reaches the file)."""
    with copying():
        for case in (reads_match_adamw, writes_reach_the_step, local_writes):
            case(rank, world, 2, offload_optimizer={"device": "cpu"}, sub_group_size=32)
    for case in (reads_match_adamw, writes_reach_the_step, local_writes):
        nvme = {"device": "nvme", "nvme_path": folder}  # files per rank
        case(rank, world, 3, offload_optimizer=nvme, sub_group_size=32)


def test_one_process_every_stage() -> None:
    all_cases(0, 1)


@pytest.mark.distributed
def test_ranks_every_stage(spawn) -> None:
    spawn(all_cases, 2, timeout_s=300.0)


@pytest.mark.distributed
def test_ranks_offloaded_state(spawn, tmp_path) -> None:
    spawn(offloaded_cases, 2, str(tmp_path), timeout_s=300.0)
