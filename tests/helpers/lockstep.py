"""Lock-step training against a single process running ``torch.optim.AdamW`` on the whole batch.

The model (``Net``: awkward sizes, a frozen parameter, one used in some steps only), its data by
step and rank, the element-wise comparison of every parameter (``compare``: the tolerances below),
and ``run_lockstep``, which trains ``steps`` steps of the optimizer under test next to the reference
and compares after each. Used by every test that
compares a ShardedFusedAdam with AdamW; in spawned ranks and in one process (world size 1).

Tolerances. fp32: the kernel is within 1.3e-6 relative of torch per step (DESIGN.md); the data
parallel gradients differ from the single-process ones only by summation order (~1e-7 relative),
so after a handful of steps ``rtol=1e-5`` holds, with ``atol = 1e-6 x`` the largest magnitude of
the parameter tensor for elements near zero. bf16: error against an fp32 AdamW run on the same
(bf16-rounded) start and data may be at most twice the error torch's own AdamW on bf16 params
makes against the same reference (max over each tensor), plus one bf16 ulp of the tensor's scale
for tensors where torch happens to be exact.
"""

from __future__ import annotations

import contextlib
import copy
import io
from typing import Callable, Optional

import torch
from torch import nn

import zero_kernels.optim as zo
from tests.helpers.check import assert_close

STAGES = (0, 1, 2, 3)
WORLD_SIZES = (1, 2, 3)
BUCKET = 13  # elements: parameters straddle buckets and shards
ROWS = 2  # rows per rank per micro-batch
LR = 2e-2


class Net(nn.Module):
    """Awkward sizes: 77, 1 (< world size), 60, a frozen 5, and ``extra`` unused in some steps."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 11)
        self.tiny = nn.Parameter(torch.tensor([1.3]))
        self.mid = nn.Linear(11, 5)
        self.frozen = nn.Parameter(torch.randn(5), requires_grad=False)
        self.extra = nn.Linear(5, 5)
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor, extra: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """``extra``: rows ``a:b`` (possibly none) go through ``self.extra``; None: it is not called."""
        h = torch.tanh(self.emb(x)) * self.tiny
        h = torch.tanh(self.mid(h) + self.frozen)
        if extra is not None:
            a, b = extra
            h = torch.cat([h[:a], h[a:b] + self.extra(h[a:b]), h[b:]])
        return self.head(h).square().mean()


def batch(step: int, rows: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, 6, generator=g).to(dtype)


def extra_rows(step: int, world: int) -> Optional[tuple[int, int]]:
    """Global rows that use ``extra``: rank 0's rows, none (not called), or all, by step."""
    return [(0, ROWS), None, (0, world * ROWS)][step % 3]


def local(span: Optional[tuple[int, int]], rank: int, stage: int) -> Optional[tuple[int, int]]:
    """This rank's part of ``span``; where it has none: None (not called), or at stage 3 an empty slice."""
    if span is None:
        return None
    lo, hi = rank * ROWS, (rank + 1) * ROWS
    a, b = max(span[0], lo) - lo, min(span[1], hi) - lo
    if b > a:
        return a, b
    return (0, 0) if stage == 3 else None


def make_models(dtype: torch.dtype) -> tuple[Net, Net]:
    """(model for the optimizer under test, fp32 reference), identical values."""
    torch.manual_seed(0)
    model = Net().to(dtype)
    return model, copy.deepcopy(model).float()


def compare(model: nn.Module, ref: nn.Module, what: str, torch_low: Optional[nn.Module] = None) -> None:
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        if torch_low is None:
            scale = r.detach().abs().max().item()
            assert_close(p, r, rtol=1e-5, atol=1e-6 * scale, what=f"{what} {name}")
            continue
        baseline = (dict(torch_low.named_parameters())[name].float() - r).abs().max().item()
        ulp = torch.finfo(p.dtype).eps * r.detach().abs().max().item()
        err = (p.float() - r).abs().max().item()
        assert err <= 2 * baseline + ulp, f"{what} {name}: error {err:.3g} > 2 x torch's {baseline:.3g} + {ulp:.3g}"


def step_and_compare(opt: zo.ShardedFusedAdam, ropt: torch.optim.Optimizer, model, ref, what: str) -> None:
    """Both optimizers step and clear their gradients; the gathered weights then equal the reference's."""
    for o in (opt, ropt):
        o.step()
        o.zero_grad()
    with opt.gathered_params():
        compare(model, ref, what)


def run_lockstep(
    rank: int,
    world: int,
    what: str,
    *,
    dtype: torch.dtype = torch.float32,
    steps: int = 4,
    groups: Callable[[Net], list] = lambda m: list(m.parameters()),
    before_ref_step: Callable[[Net, int], None] = lambda m, s: None,
    sched: Optional[Callable[[torch.optim.Optimizer], object]] = None,
    ref_opt: Callable[[list], torch.optim.Optimizer] = lambda g: torch.optim.AdamW(g, lr=LR),
    set_to_none: bool = True,
    stage: int = 1,
    **opt_kwargs,
) -> zo.ShardedFusedAdam:
    """Train ``steps`` steps next to torch's AdamW on the whole batch; compare after each step."""
    model, ref = make_models(dtype)
    low = copy.deepcopy(model) if dtype != torch.float32 else None
    opt = zo.ShardedFusedAdam(groups(model), lr=LR, reduce_bucket_size=BUCKET, stage=stage, module=model, **opt_kwargs)
    ropt = ref_opt(groups(ref))
    lopt = ref_opt(groups(low)) if low is not None else None
    scheds = [sched(o) for o in (opt, ropt, lopt) if o is not None] if sched else []
    for step in range(steps):
        x, span = batch(step, world * ROWS, dtype).float(), extra_rows(step, world)
        model(x[rank * ROWS : (rank + 1) * ROWS].to(dtype), local(span, rank, stage)).backward()
        ref(x, span).backward()
        before_ref_step(ref, step)
        if low is not None:
            low(x.to(dtype), span).backward()
            lopt.step()
            lopt.zero_grad()
        opt.step()
        check_padding(opt, f"{what} step {step}")
        ropt.step()
        opt.zero_grad(set_to_none=set_to_none)
        ropt.zero_grad(set_to_none=set_to_none)
        if not set_to_none:
            check_zeroed(model, stage, f"{what} step {step}")
        for s in scheds:
            s.step()
        with opt.gathered_params():
            compare(model, ref, f"{what} step {step}", low)
    return opt


def check_padding(opt: zo.ShardedFusedAdam, what: str) -> None:
    """The reduced gradient shard holds zeros wherever it holds no parameter (reused buckets included)."""
    pipeline = opt._pipeline
    for buf in pipeline.buffers:
        if buf.grad_shard is None:
            continue
        covered = torch.zeros(buf.grad_shard.numel(), dtype=torch.bool)
        for seg in buf.layout.segments(pipeline.shard_rank):
            covered[seg.shard_offset : seg.shard_offset + seg.numel] = True
        assert not buf.grad_shard[~covered].any(), f"{what}: gradient shard padding is not zero"


def check_zeroed(model: Net, stage: int, what: str) -> None:
    """After ``zero_grad(set_to_none=False)``: zeros in place where a gradient was kept (stages 0 and 1)."""
    for name, p in model.named_parameters():
        if not p.requires_grad or stage >= 2:
            assert p.grad is None, f"{what} {name}: stage {stage} keeps no gradient in p.grad"
        elif p.grad is not None:
            assert p.grad.shape == p.shape and not p.grad.any(), f"{what} {name}: gradient not zeroed"


def accumulation_case(rank: int, world: int, stage: int, mode: str) -> None:
    """Two micro-steps per update: ``no_sync`` on the first, ``gradient_accumulation_steps=2``, or
    ``backward`` twice, both synchronised (the second's reductions start while the first's may be in flight).
    """
    micro = 2
    model, ref = make_models(torch.float32)
    kwargs = {"gradient_accumulation_steps": micro} if mode == "accumulation_steps" else {}
    opt = zo.ShardedFusedAdam(model.parameters(), lr=LR, stage=stage, reduce_bucket_size=BUCKET, module=model, **kwargs)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(3):
        x = batch(step, micro * world * ROWS)
        for m in range(micro):
            rows = x[(m * world + rank) * ROWS : (m * world + rank + 1) * ROWS]
            if mode == "accumulation_steps":
                model(rows).backward()
                opt.step()
                opt.zero_grad()
                continue
            with opt.no_sync() if mode == "no_sync" and m < micro - 1 else contextlib.nullcontext():
                (model(rows) / micro).backward()
        if mode != "accumulation_steps":
            opt.step()
            opt.zero_grad()
        ref(x).backward()
        ropt.step()
        ropt.zero_grad()
        with opt.gathered_params():
            compare(model, ref, f"stage {stage} accumulation ({mode}) step {step}")


def two_groups(m: Net) -> list:
    return [
        {"params": [m.emb.weight, m.mid.weight, m.tiny], "lr": 5e-3},
        {"params": [m.emb.bias, m.mid.bias, m.extra.weight, m.extra.bias, m.frozen, m.head.weight, m.head.bias],
         "weight_decay": 0.3},
    ]  # fmt: skip


def clip_ref(max_norm: float, seen: list) -> Callable[[Net, int], None]:
    def clip(ref: Net, step: int) -> None:
        seen.append(float(nn.utils.clip_grad_norm_(ref.parameters(), max_norm)))

    return clip


STAGE3 = {"stage3_param_persistence_threshold": 10}  # emb, mid.weight, extra.weight are gathered units


def make_opt(model: Net, stage: int, **kwargs) -> zo.ShardedFusedAdam:
    extra = STAGE3 if stage == 3 else {}
    return zo.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=BUCKET, **extra, **kwargs)


def forward_backward(model: Net, ref: Net, rank: int, world: int, stage: int, step: int, micro: int = 0) -> None:
    """This rank's rows through ``model``, the whole batch through ``ref``."""
    x, span = batch(10 * step + micro, world * ROWS), extra_rows(step, world)
    model(x[rank * ROWS : (rank + 1) * ROWS].to(model.head.bias.dtype), local(span, rank, stage)).backward()
    ref(x, span).backward()


def step_beside_adamw(model: nn.Module, opt, ref: nn.Module, ropt: torch.optim.Optimizer, xs: list, rank: int) -> None:
    """One step of ``opt`` on this rank's batch ``xs[rank]`` and one of ``ropt`` on every rank's: the mean of the
    ranks' square-mean losses."""
    model(xs[rank]).square().mean().backward()
    opt.step()
    opt.zero_grad()
    sum(ref(x).square().mean() for x in xs).div(len(xs)).backward()
    ropt.step()
    ropt.zero_grad()


def deep_and_pickled_copies(
    model: Net, opt: zo.ShardedFusedAdam, stage: int
) -> dict[str, tuple[Net, zo.ShardedFusedAdam]]:
    """(model, optimizer) copied by ``copy.deepcopy`` (``"deepcopy"``) and through ``torch.save`` / ``torch.load``
    (``"pickle"``). At stage 3 the optimizer holds the module (its hooks): it is copied first, the module with it."""
    if stage == 3:
        opt2, model2 = copy.deepcopy((opt, model))
    else:
        model2, opt2 = copy.deepcopy((model, opt))
    data = io.BytesIO()
    torch.save(opt if stage == 3 else {"model": model, "opt": opt}, data)
    data.seek(0)
    loaded = torch.load(data, weights_only=False)
    opt3 = loaded if stage == 3 else loaded["opt"]
    model3 = opt3.pipeline.module if stage == 3 else loaded["model"]
    return {"deepcopy": (model2, opt2), "pickle": (model3, opt3)}
