"""The step's statistics (``zero_kernels.stages.stats``) in one process, every rank of a world played here.

``exchange`` runs once per rank against fake engines: a first pass records the vector each rank
packs, a second hands every rank the rows of all (what the all-gather delivers) and, where host data
goes over a control engine of its own, sums the ranks' gradient columns (what the device all-reduce
does). Every rank's result is then checked against float64 references computed here from the
ranks' inputs: the OR of the gradient flags, the squared global norm (or NaN for a non-finite
gradient anywhere, fp16 included), the agreed step counts, every rank's ``extra``; and a
hyper-parameter or a step count on which ranks disagree raises ``RanksDisagree`` on every rank,
naming it, its values and the ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import pytest
import torch

from zero_kernels.agreement import RanksDisagree
from zero_kernels.comm.primitives import CommError
from zero_kernels.stages.buffers import GroupHyper
from zero_kernels.stages.stats import StepStats, exchange, grad_column, step_checks

CPU = torch.device("cpu")


class _Recorded(Exception):
    """Raised by the recording pass's all-gather: the rank's vector is known, nothing more is needed."""


class _Done:
    def wait(self) -> None:
        pass


@dataclass
class _Engine:
    """One rank's engine: records its packed vector (``rows`` None), or delivers every rank's (``rows``)."""

    world_size: int
    rank: int
    rows: Optional[list[torch.Tensor]] = None
    columns: Optional[list[torch.Tensor]] = None  # every rank's gradient column, for the device all-reduce
    recorded: Optional[torch.Tensor] = None
    calls: list[str] = field(default_factory=list)
    global_ranks: Optional[tuple[int, ...]] = None

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, name: str) -> _Done:
        self.calls.append(f"all_gather {name}")
        if self.rows is None:
            self.recorded = inp.clone()
            raise _Recorded
        assert torch.allclose(inp, self.rows[self.rank], rtol=0, atol=0, equal_nan=True), (
            "a rank packed another vector the second time"
        )
        out.view(self.world_size, -1).copy_(torch.stack(self.rows))
        return _Done()

    def all_reduce(self, t: torch.Tensor, op: str, name: str) -> _Done:
        self.calls.append(f"all_reduce {name}")
        assert op == "sum" and self.columns is not None
        t.copy_(sum(self.columns))
        return _Done()


def _rank_args(
    rank: int, *, views: Optional[list[torch.Tensor]] = None, norm: bool = True, **kw: Any
) -> dict[str, Any]:
    """One rank's arguments of ``exchange``: parameters 0-3, this rank holding the state of ``held``; the column of
    ``views`` (their squared norm, else their finiteness with ``norm`` False)."""
    args: dict[str, Any] = dict(
        has_grad={0: False, 1: False, 2: False, 3: False},
        column=None if views is None else grad_column(views, CPU, norm=norm),
        checks=[("lr", 0.1), ("max_grad_norm", math.nan)],
        counts={0: 0, 1: 0, 2: 0, 3: 0},
        held={0, 1, 2, 3},
        name=lambda i: f"params[{i}]",
        extra=(),
    )
    args.update(kw)
    return args


def _world(ranks: list[dict[str, Any]], *, own_control: bool = False) -> list[Union[StepStats, Exception]]:
    """Every rank's ``exchange``, or the error it raised."""
    world = len(ranks)
    rows = []
    for rank, args in enumerate(ranks[: world if world > 1 else 0]):
        engine = _Engine(world, rank)
        control = _Engine(world, rank) if own_control else engine
        with pytest.raises(_Recorded):
            exchange(engine, control, **args)
        rows.append(control.recorded)
    columns = [a["column"].clone() for a in ranks] if own_control else None  # each rank sums its own in place
    results: list[Union[StepStats, Exception]] = []
    for rank, args in enumerate(ranks):
        engine = _Engine(world, rank, rows, columns)
        control = _Engine(world, rank, rows) if own_control else engine
        try:
            results.append(exchange(engine, control, **args))
        except RanksDisagree as exc:
            results.append(exc)
        if world == 1:
            assert not engine.calls, f"a world of one communicated: {engine.calls}"
    return results


def _views(rank: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(n, generator=g).to(dtype) for n in (5, 17, 1)]


@pytest.mark.parametrize(
    "world, own_control", [(1, False), (2, False), (3, False), (2, True), (3, True)], ids=lambda v: str(v).lower()
)
def test_flags_norm_and_counts_combine_over_ranks(world: int, own_control: bool) -> None:
    ranks = []
    for rank in range(world):
        has = {i: i % world == rank for i in range(4)}  # parameter i has a gradient on rank i % world only
        held = {i for i in range(4) if i % 2 == rank % 2 or world == 1}
        counts = {i: 3 if i in held else 0 for i in range(4)}
        ranks.append(_rank_args(rank, views=_views(rank), has_grad=has, held=held, counts=counts, extra=(rank, 0.5)))
    expected_sq = sum(v.double().square().sum().item() for rank in range(world) for v in _views(rank))
    with_grad = set(range(4))  # every parameter has one on one rank
    for rank, got in enumerate(_world(ranks, own_control=own_control)):
        assert isinstance(got, StepStats), got
        assert got.with_grad == with_grad, f"rank {rank}: {got.with_grad}"
        held_somewhere = {i for r in ranks for i in r["held"]}
        assert got.counts == {i: 3 for i in held_somewhere}, f"rank {rank}: {got.counts}"
        assert got.grad_sq is not None and got.grad_sq.dtype == torch.float64
        assert got.grad_sq.item() == pytest.approx(expected_sq, rel=1e-6), f"rank {rank}"
        assert got.extra == [[float(r), 0.5] for r in range(world)], f"rank {rank}: {got.extra}"


def test_flags_are_an_or_and_no_views_no_column() -> None:
    ranks = [_rank_args(r, has_grad={0: r == 1, 1: False, 2: r == 0, 3: False}) for r in range(3)]
    for got in _world(ranks):
        assert isinstance(got, StepStats) and got.with_grad == {0, 2} and got.grad_sq is None


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_finiteness_without_a_norm(dtype: torch.dtype, bad: float) -> None:
    """norm=False: 0 when every gradient on every rank is finite (fp16 sums past its range stay finite), else NaN."""
    big = [torch.full((64,), 60000.0, dtype=dtype)]  # sums to 3.8e6: past fp16's largest value
    finite = [_rank_args(r, views=big + _views(r, dtype), norm=False) for r in range(2)]
    for got in _world(finite):
        assert isinstance(got, StepStats) and got.grad_sq is not None and got.grad_sq.item() == 0.0
    broken = _views(1, dtype)
    broken[1][3] = bad
    ranks = [_rank_args(0, views=_views(0, dtype), norm=False), _rank_args(1, views=broken, norm=False)]
    for got in _world(ranks):
        assert isinstance(got, StepStats) and got.grad_sq is not None and math.isnan(got.grad_sq.item())
    for got in _world(ranks, own_control=True):
        assert isinstance(got, StepStats) and got.grad_sq is not None and math.isnan(got.grad_sq.item())


def test_a_hyper_parameter_that_differs_raises_on_every_rank() -> None:
    ranks = [_rank_args(r, checks=[("lr", 0.1 if r != 2 else 0.2), ("max_grad_norm", math.nan)]) for r in range(3)]
    for got in _world(ranks):
        assert isinstance(got, RanksDisagree), got
        assert "lr" in str(got) and "0.1 on ranks 0-1" in str(got) and "0.2 on rank 2" in str(got), str(got)
    ranks = [_rank_args(r, checks=[("lr", 0.1), ("max_grad_norm", math.nan if r else 1.0)]) for r in range(2)]
    for got in _world(ranks):
        assert isinstance(got, RanksDisagree) and "1.0 on rank 0, None on rank 1" in str(got), str(got)


def test_a_step_count_that_differs_where_held_raises_on_every_rank() -> None:
    counts = [{0: 2, 1: 5, 2: 0, 3: 0}, {0: 2, 1: 0, 2: 0, 3: 0}, {0: 2, 1: 4, 2: 0, 3: 0}]
    held = [{0, 1}, {0}, {0, 1}]  # rank 1 holds none of params[1]: its 0 is not a count
    ranks = [_rank_args(r, counts=counts[r], held=held[r]) for r in range(3)]
    for got in _world(ranks):
        assert isinstance(got, RanksDisagree), got
        assert "params[1]" in str(got) and "5 on rank 0, None on rank 1, 4 on rank 2" in str(got), str(got)
    held = [{0, 1}, {0}, {0}]
    ranks = [_rank_args(r, counts=counts[r], held=held[r]) for r in range(3)]
    for got in _world(ranks):
        assert isinstance(got, StepStats) and got.counts == {0: 2, 1: 5}, got


def test_step_checks_name_every_value() -> None:
    hyper = [GroupHyper(0.1, 0.9, 0.999, 1e-8, 0.01, True), GroupHyper(0.2, 0.8, 0.99, 1e-6, 0.0, True, True, True)]
    checks = dict(step_checks(hyper, 0.25, None))
    assert checks["param_groups[1]['lr']"] == 0.2 and checks["param_groups[0]['betas'][1]"] == 0.999
    assert checks["param_groups[1]['amsgrad']"] == 1.0 and checks["param_groups[0]['maximize']"] == 0.0
    assert checks["param_groups[1]['eps']"] == 1e-6 and checks["param_groups[0]['weight_decay']"] == 0.01
    assert math.isnan(checks["max_grad_norm (gradient_clipping)"])
    assert dict(step_checks(hyper, 0.25, 2.0))["max_grad_norm (gradient_clipping)"] == 2.0
    assert checks["the gradient scale 1 / (loss scale or gradient_accumulation_steps) x scale_grads_"] == 0.25
    assert math.isnan(checks["clip_grad_norm_'s max_norm"])
    assert dict(step_checks(hyper, 0.25, None, 0.5))["clip_grad_norm_'s max_norm"] == 0.5
    assert len(checks) == 7 * 2 + 3


def test_a_row_from_another_collective_is_a_comm_error() -> None:
    """A rank that was in another collective (its forward's parameter all-gather, after a different number of
    micro-steps) sent no row of the exchange: a ``CommError`` saying so, not a disagreement on ``lr`` read from a
    parameter's values."""
    ranks = [_rank_args(r) for r in range(2)]
    rows = []
    for rank, args in enumerate(ranks):
        engine = _Engine(2, rank)
        with pytest.raises(_Recorded):
            exchange(engine, engine, **args)
        rows.append(engine.recorded)
    rows[1] = torch.full_like(rows[1], 4.67e-310)
    engine = _Engine(2, 0, rows)
    with pytest.raises(CommError, match=r"\(step\.stats\) met another collective on rank 1: "):
        exchange(engine, engine, **ranks[0])


class _Failing:
    """A wait that raises ``text`` as a ``CommError``, as an engine's does."""

    def __init__(self, text: str) -> None:
        self.text = text

    def wait(self) -> None:
        raise CommError(self.text)


@pytest.mark.parametrize(
    "text",
    [
        "zero_kernels comm: all_gather of bucket 'step.stats' on rank 1 of 2 (gloo) failed: Timed out waiting "
        "1800000ms for recv operation to complete",
        "zero_kernels comm: all_gather of bucket 'step.stats' on rank 1 of 2 (gloo) failed: the ranks issued different "
        "operations: rank 0 runs all_reduce's sum (384 bytes of Float, operation 38 on the channel) where this rank "
        "runs all_gather (416 bytes, operation 38 on the channel)",
    ],
    ids=["timeout", "other operation"],
)
def test_an_exchange_that_met_no_exchange_says_why(text: str) -> None:
    """A rank whose exchange timed out, or met another operation (a peer still in a backward's reduction after one
    more backward than this rank), says what most likely happened, as a row from another collective does; it named
    only the failed collective (a stage-0 run on the torch comm engine waited for the process group's timeout)."""
    engine = _Engine(2, 1)
    engine.all_gather = lambda out, inp, name: _Failing(text)  # type: ignore[method-assign]
    with pytest.raises(CommError) as caught:
        exchange(engine, engine, **_rank_args(1))
    message = str(caught.value)
    assert message.startswith(text) and "a rank ran another number of forwards, backwards or micro-steps" in message
