"""Every rank issues the same collectives in the same order, whatever its data (the collective-order audit).

A module that every rank runs may use one of its parameters only on some ranks (``if cond: y = y + x @
self.w2``, ``cond`` from the data). Stage 3 used to reduce a unit once all its parameters had a gradient,
else at the end of backward: the ranks then issued their gathers and reductions in different orders,
which aborted gloo ("Received data size doesn't match expected size") when the sizes differed and mixed
parameters with gradients silently when they matched. Here such models train at every stage, with and
without prefetch and gradient accumulation, next to ``torch.optim.AdamW`` on the whole batch (a gradient
missing on a rank counts as zero), while the audit of ``tests.helpers.audit`` (part of every spawned test) compares
the ranks' collectives after every step.
"""

from __future__ import annotations

import copy
import itertools
import os

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zero_kernels as zk
from tests.helpers import audit as _audit
from tests.helpers.check import assert_close
from tests.helpers.dist import run_ranks_checked
from zero_kernels import _ext
from zero_kernels.comm import CommError

LR, ROWS, STEPS = 2e-2, 3, 4


class Pair(nn.Module):
    """Two ``width x width`` weights; ``w2`` only when ``use_w2`` is set for the call (from the data)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(width, width) / width)
        self.w2 = nn.Parameter(torch.randn(width, width) / width)
        self.use_w2 = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.w1
        if self.use_w2:
            y = y + x @ self.w2
        return torch.tanh(y)


class CondNet(nn.Module):
    """``a``, then ``b`` whose ``w2`` the data switches, then ``c``: sizes differ (``equal=False``: as a
    ``Linear`` and the issue's model) or are all equal (every unit two weights of one width)."""

    def __init__(self, equal: bool) -> None:
        super().__init__()
        width = 8
        self.a = Pair(width) if equal else nn.Linear(width, 12)
        self.b = Pair(width if equal else 12)
        self.c = Pair(width) if equal else nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.b.use_w2 = bool(x[:, 0].sum() > 0)  # data-dependent, outside any leaf module
        return self.c(self.b(self.a(x))).square().mean()


def _batches(world: int, width: int = 8) -> list[torch.Tensor]:
    """Per step and rank: step 0 every rank uses w2, then only rank 0, then none, then only the last rank."""
    uses = [[True] * world, [r == 0 for r in range(world)], [False] * world, [r == world - 1 for r in range(world)]]
    out = []
    for step, use in enumerate(uses):
        x = torch.randn(world * ROWS, width, generator=torch.Generator().manual_seed(step))
        for r in range(world):
            rows = x[r * ROWS : (r + 1) * ROWS]
            rows[:, 0] = rows[:, 0].abs() * (1 if use[r] else -1)
        out.append(x)
    return out


def _train(rank: int, world: int, stage: int, equal: bool, accumulate: str, **zero) -> list[str]:
    """Train ``CondNet`` next to AdamW on the whole batch; what differs, after every step."""
    torch.manual_seed(0)
    model = CondNet(equal)
    ref = copy.deepcopy(model)
    micro = 2 if accumulate == "steps" else 1
    opt = zk.ShardedFusedAdam(model, lr=LR, weight_decay=0.1, stage=stage, gradient_accumulation_steps=micro,
                              stage3_param_persistence_threshold=0, **zero)  # fmt: skip
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    what = f"stage {stage} equal={equal} accumulate={accumulate} {zero}"
    failures = []
    for step, x in enumerate(_batches(world)):
        mine = x[rank * ROWS : (rank + 1) * ROWS]
        halves = (mine[:1], mine[1:]) if accumulate != "none" else (mine,)
        for k, part in enumerate(halves):
            weight = len(part) / len(mine) * (micro if accumulate == "steps" else 1)
            if accumulate == "no_sync" and k == 0:
                with opt.no_sync():
                    (model(part) * weight).backward()
                continue
            (model(part) * weight).backward()
            opt.step()  # with gradient_accumulation_steps=2, the first of the two only counts
            opt.zero_grad()
        sum(ref(x[r * ROWS : (r + 1) * ROWS]) for r in range(world)).div(world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with opt.gathered_params():
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                try:
                    assert_close(p, q, rtol=1e-5, atol=1e-6 * q.detach().abs().max().item(), what=name)
                except AssertionError as exc:
                    return [f"{what} step {step}: {exc}"]
    return failures


def _order_cases(rank: int, world: int) -> list[str]:
    failures = []
    for stage in (3, 0, 1, 2):
        for equal in (False, True):
            failures += _train(rank, world, stage, equal, "none", stage3_prefetch_bucket_size=0, reduce_bucket_size=64)
    for prefetch in (0, 1, 10_000):
        failures += _train(rank, world, 3, False, "none", stage3_prefetch_bucket_size=prefetch)
    for stage in (3, 2):
        for accumulate in ("no_sync", "steps"):
            failures += _train(rank, world, stage, True, accumulate, stage3_prefetch_bucket_size=0)
    return failures


@pytest.mark.distributed
@pytest.mark.parametrize("world", (2, 3), ids=lambda w: f"world{w}")
def test_data_dependent_parameter_use_keeps_collectives_in_order(world: int) -> None:
    run_ranks_checked(_order_cases, world, timeout_s=120)


class LeafOnSomeRanks(nn.Module):
    """``m1``'s input is ``x * scale`` where the call uses ``scale`` (from the data), else ``x`` itself: a tensor
    that autograd computed on some ranks and an input leaf on the others. ``m0a`` and ``m0b`` run before it, their
    backward after its, and all four units have one size. ``reentrant``: all of it in one segment of reentrant
    activation checkpointing (the calls the segment's backward recomputes decide it then)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        width = 8
        self.reentrant = reentrant
        self.scale = nn.Parameter(1 + torch.randn(width) / 10)
        self.m0a, self.m0b, self.m1, self.m2 = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor, use_scale: bool) -> torch.Tensor:
        if self.reentrant:
            return checkpoint(self.body, x.detach().requires_grad_(), use_scale, use_reentrant=True)
        return self.body(x, use_scale)

    def body(self, x: torch.Tensor, use_scale: bool) -> torch.Tensor:
        h0 = torch.tanh(self.m0b(torch.tanh(self.m0a(x))))
        h = x * self.scale if use_scale else x
        return self.m2(torch.tanh(self.m1(h)) + h0).square().mean()


def _input_leaf_on_some_ranks(rank: int, world: int, engines: list[str]) -> list[str]:
    """The end of ``m1``'s backward is not seen where its input is a leaf (its unit then waits for the end of
    backward), and is seen where it was computed: each rank put ``m1``'s reduction on its own side of ``m0a``'s gather.
    Same sizes on the point-to-point exchanges of the torch engine paired a rank's reduce-scatter with the other's
    all-gather, silently (0.054 off AdamW after 4 steps); the C++ engine raised "the ranks issued different
    operations". Every rank uses ``scale`` in the first step, then only rank 0 (a pass checked, then deferred ones).
    Inside a reentrant checkpoint segment, the recomputed calls decide it during the backward."""
    failures = []
    for kind, reentrant in itertools.product(engines, (False, True)):
        os.environ["ZERO_KERNELS_COMM"] = kind
        torch.manual_seed(0)
        model = LeafOnSomeRanks(reentrant)
        ref = copy.deepcopy(model)
        opt = zk.ShardedFusedAdam(model, lr=LR, weight_decay=0.0, stage=3, stage3_param_persistence_threshold=0,
                                  stage3_prefetch_bucket_size=0)  # fmt: skip
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
        for step in range(STEPS):
            xs = torch.randn(world, ROWS, 8, generator=torch.Generator().manual_seed(step))
            uses = [step == 0 or r == 0 for r in range(world)]
            model(xs[rank], uses[rank]).backward()
            opt.step()
            opt.zero_grad()
            sum(ref(xs[r], uses[r]) for r in range(world)).div(world).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        with opt.gathered_params():
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                try:
                    assert_close(p, q, rtol=1e-5, atol=1e-6, what=f"{kind} engine, reentrant={reentrant}: {name}")
                except AssertionError as exc:
                    failures.append(str(exc))
    return failures


@pytest.mark.distributed
def test_a_module_input_computed_on_some_ranks_only_keeps_reductions_in_order() -> None:
    engines = ["torch"] + (["cpp"] if _ext.available("comm") else [])
    run_ranks_checked(_input_leaf_on_some_ranks, 2, engines)


# -- the audit itself ---------------------------------------------------------------------------------------


def _audit_cases(rank: int, world: int) -> list[str]:
    """A collective recorded on one rank only is reported by the audit of the next step, on every rank."""
    failures = []
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # audited: the same collectives so far
    group = opt.pipeline.engine.group
    if not _audit.audited(group) or not any(op == "reduce_scatter" for op, _, _ in _audit.audited(group)[-1]):
        failures.append(f"the audit saw no reduce-scatter: {_audit.audited(group)}")
    model(torch.randn(2, 4)).sum().backward()
    if rank == 1:
        _audit._pending[group].insert(0, ("all_reduce", 1, "only on rank 1"))
    try:
        opt.step()
        failures.append("an extra collective on rank 1 passed the audit")
    except AssertionError as exc:
        if "first at #0" not in str(exc) or "only on rank 1" not in str(exc):
            failures.append(f"the audit's message does not name the difference: {exc}")
    return failures


@pytest.mark.distributed
def test_audit_reports_collectives_that_differ_between_ranks() -> None:
    run_ranks_checked(_audit_cases, 2)


# -- stage 3's gather check: deferred to the step after the first pass ----------------------------------------


class Chain(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))

    def forward(self, x: torch.Tensor, skip: int = -1) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i != skip:
                x = torch.tanh(layer(x))
        return x.square().mean()


def _control_counts(rank: int, world: int) -> list[str]:
    """Control collectives per iteration: the gather checks of the first pass, then only the step's exchange;
    a copy made on one rank alone (its hooks taken off and put back there) changes nothing."""
    failures = []
    torch.manual_seed(0)
    model = Chain()
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, stage3_param_persistence_threshold=0,
                              stage3_prefetch_bucket_size=64)  # fmt: skip
    plan = [-1, -1, -1, 2, 2, -1]  # iteration 3 leaves the order (layer 2 skipped): checked at once again
    for it, skip in enumerate(plan):
        if it == 2 and rank == 0:
            copy.deepcopy(opt)
        model(torch.randn(2, 8), skip).backward()
        opt.step()
        opt.zero_grad()
        records = _audit.audited(opt.pipeline.engine.group)[-1]
        checks = sum(name.startswith("stage3.check") for _, _, name in records)
        stats = sum(name == "step.stats" for _, _, name in records)
        first = it == 0 or skip != plan[it - 1]
        if (checks > 0) != first or stats != 1:
            failures.append(f"iteration {it}: {checks} gather checks, {stats} step exchanges (first pass: {first})")
    return failures


def _deferred_mismatch(rank: int, world: int) -> list[str]:
    """Gathers that differ in a deferred pass are found in the step's exchange: CommError on every rank, no update."""
    torch.manual_seed(0)
    model = Chain(2)
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, stage3_param_persistence_threshold=0)
    for _ in range(2):
        model(torch.randn(2, 8)).backward()
        opt.step()
        opt.zero_grad()
    model(torch.randn(2, 8)).backward()
    opt.pipeline._check_gathers([rank], "forward", True)  # as if rank r had gathered layer r
    with opt.gathered_params():
        before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
        return ["deferred gathers that differ passed the step"]
    except CommError as exc:
        text = str(exc)
    failures = []
    wants = ("since the last step", "in the forward: rank 0 gathers the parameters of 'layers.1'", "refused")
    for want in (*wants, "rank 1 gathers the parameters of 'layers.0'"):
        if want not in text:
            failures.append(f"{want!r} not in: {text}")
    with opt.gathered_params():
        if any(not torch.equal(p, q) for p, q in zip(model.parameters(), before)):
            failures.append("a refused step changed parameters")
    return failures


def _check_cases(rank: int, world: int) -> list[str]:
    return _control_counts(rank, world) + _deferred_mismatch(rank, world)


@pytest.mark.distributed
def test_stage3_gather_checks_after_the_first_pass_ride_the_step_exchange() -> None:
    run_ranks_checked(_check_cases, 2)


# -- the torch engine's point-to-point forms: a reduce-scatter never takes a peer's all-gather ---------------


def _crossed_p2p(rank: int, world: int) -> list[str]:
    """Rank 0 reduce-scatters while rank 1 all-gathers, each sending its peer 4 elements: they used to pair (rank 0's
    sum took rank 1's shard, rank 1's gather rank 0's chunk, no error); each now waits for a tag of its own kind and
    fails at the group's timeout."""
    from zero_kernels.comm.torch_engine import TorchCommEngine

    engine = TorchCommEngine()
    try:
        if rank == 0:
            engine.reduce_scatter(torch.empty(4), torch.ones(8), primitive="reduce_scatter_p2p").wait()
        else:
            engine.all_gather(torch.empty(8), torch.full((4,), 2.0), primitive="all_gather_p2p").wait()
    except CommError:
        return []
    return [f"rank {rank}'s {'reduce-scatter' if rank == 0 else 'all-gather'} took its peer's other operation"]


@pytest.mark.distributed
def test_a_reduce_scatter_and_an_all_gather_of_one_size_do_not_pair() -> None:
    run_ranks_checked(_crossed_p2p, 2, timeout_s=5)
