"""qgZ (``comm.quantized``): the two-hop int4 reduce-scatter against a float64 sum of every rank's input.

Nodes are emulated in the spawned ranks' environment (``GROUP_RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, read by ``comm.groups.node_groups``): 2 nodes x 2 ranks (nodes interleaved over
the global ranks, so routing by rank number alone would be wrong), 3 nodes x 1 rank and 1 node x 3
ranks; in fp32, bf16 and fp16, for sizes smaller than a block and not divisible by
anything.

The bound, per output element of rank r = (node d, local l) at position j (with qmax = 7):
- hop 1: every rank s quantizes, for column l, the chunks of ranks (0, l), (1, l), ... in node order,
  padded to whole blocks; the element lies in block (d * n + j) // block of that piece, so s adds at
  most max|block| / qmax / 2;
- hop 2: rank (e, l) requantizes its node's partial sum for node d: the element lies in block j // block
  of that row, whose absmax is at most the exact one plus the hop-1 error inside the block, so node e
  adds at most that / qmax / 2.
The sum of these, plus float32 rounding of the sums (2**-20 of the sum of magnitudes) and of the output
dtype (one ulp of the result and of the bound), is what each element may differ from the float64 sum.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tests.helpers.dist import run_ranks_checked

QMAX = 7
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (1, 7, 333)  # elements per rank's chunk: less than a block, and across several blocks of BLOCK
BLOCK = 64

# name: (world size, node of each rank)
GRIDS = {
    "2 nodes x 2, interleaved": (4, [0, 1, 0, 1]),
    "3 nodes x 1": (3, [0, 1, 2]),
    "1 node x 3": (3, [0, 0, 0]),
}


def _emulate(rank: int, nodes_of: list[int]) -> list[list[int]]:
    """Set this rank's launcher environment; the grid of global ranks, by node then local rank."""
    grid: dict[int, list[int]] = {}
    for r, node in enumerate(nodes_of):
        grid.setdefault(node, []).append(r)
    rows = [grid[node] for node in sorted(grid)]
    node = nodes_of[rank]
    os.environ.update(GROUP_RANK=str(node), LOCAL_RANK=str(grid[node].index(rank)), LOCAL_WORLD_SIZE=str(len(rows[0])))
    return rows


def _inputs(world: int, n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Every rank's input (world chunks of n), magnitudes spread over a few decades."""
    out = []
    for s in range(world):
        g = torch.Generator().manual_seed(seed * 100 + s)
        x = (
            torch.randn(world * n, generator=g)
            * torch.logspace(-1, 1, world * n)[torch.randperm(world * n, generator=g)]
        )
        out.append(x.to(dtype))
    return out


def _block_max(values: torch.Tensor, block: int) -> torch.Tensor:
    """Per element, the absmax of its block (values padded with zeros to whole blocks)."""
    pad = (-values.numel()) % block
    blocks = torch.cat([values.abs(), values.new_zeros(pad)]).view(-1, block)
    return blocks.amax(1).repeat_interleave(block)[: values.numel()]


def _bound(xs: list[torch.Tensor], rows: list[list[int]], rank: int, n: int, block: int) -> torch.Tensor:
    """The derived per-element bound (module docstring) for ``rank``'s output, in float64."""
    nodes, local = len(rows), len(rows[0])
    d, lr = next((e, row.index(rank)) for e, row in enumerate(rows) if rank in row)
    x64 = [x.double().view(-1, n) for x in xs]
    column = [rows[e][lr] for e in range(nodes)]
    hop1 = []  # per source: its hop-1 error bound over the column piece (nodes * n)
    for s in range(len(xs)):
        piece = x64[s][column].reshape(-1)
        hop1.append(_block_max(piece, block) / QMAX / 2 if local > 1 else torch.zeros_like(piece))
    total = sum(h[d * n : (d + 1) * n] for h in hop1)
    if nodes > 1:
        for e in range(nodes):
            partial = sum(x64[s][column].reshape(-1) for s in rows[e])[d * n : (d + 1) * n]
            err1 = sum(hop1[s] for s in rows[e])[d * n : (d + 1) * n]
            total = total + (_block_max(partial, block) + _block_max(err1, block)) / QMAX / 2
    magnitude = sum(x[rank].abs() for x in x64)
    return total + magnitude * 2.0**-20


def _check_sums(rank: int, world: int, nodes_of: list[int]) -> list[str]:
    import zero_kernels.kernels as codec
    from zero_kernels.comm import TorchCommEngine
    from zero_kernels.comm.quantized import QuantizedReduceScatter

    rows = _emulate(rank, nodes_of)
    qrs = QuantizedReduceScatter(TorchCommEngine(), codec, block=BLOCK)
    problems = []
    for dtype in DTYPES:
        for n in SIZES:
            xs = _inputs(world, n, dtype, seed=n)
            exact = sum(x.double() for x in xs).view(world, n)[rank]
            inp = xs[rank].clone()
            out = inp.narrow(0, rank * n, n) if n == 7 else torch.full((n,), 5.0, dtype=dtype)  # aliasing, as stage 2
            qrs.reduce_scatter(out, inp, name=f"{dtype}.{n}").wait()
            err = (out.double() - exact).abs()
            bound = _bound(xs, rows, rank, n, BLOCK)
            bound = bound + torch.finfo(dtype).eps * (exact.abs() + bound)
            if not bool((err <= bound).all()):
                j = int((err - bound).argmax())
                problems.append(f"{dtype} n={n}: [{j}] {out[j].item()} vs {exact[j].item()}, bound {bound[j].item()}")
            if not bool(err.gt(0).any()) and n > 1 and dtype == torch.float32:
                problems.append(f"{dtype} n={n}: exact to the last bit: nothing was quantized")
    qrs.reduce_scatter(torch.empty(0), torch.empty(0), name="empty").wait()  # nothing to send: no error
    problems += _check_non_finite(rank, world, qrs)
    return problems + _check_exact_routing(rank, world, qrs) + _check_bytes(world, rows, qrs)


def _check_non_finite(rank: int, world: int, qrs) -> list[str]:
    """An inf on one rank, bound for the last rank: that rank's output is not finite there."""
    n = 50
    inp = torch.randn(world * n, dtype=torch.bfloat16)
    if rank == 0:
        inp[(world - 1) * n + 3] = float("inf")
    out = torch.empty(n, dtype=torch.bfloat16)
    qrs.reduce_scatter(out, inp, name="overflow").wait()
    if rank == world - 1 and bool(out[3].isfinite()):
        return ["an inf gradient was reduced to a finite value"]
    return []  # other ranks may see NaN too (their values shared its block): the step's check is global


def _check_exact_routing(rank: int, world: int, qrs) -> list[str]:
    """Inputs every quantization represents exactly (each rank's values are +-7 c_s, one sign pattern for
    all ranks, c_s powers of two): the result must be exactly 7 sign sum(c_s), chunk by chunk."""
    n = 97
    sign = torch.where(torch.rand(world * n, generator=torch.Generator().manual_seed(3)) < 0.5, -1.0, 1.0)
    out = torch.empty(n)
    qrs.reduce_scatter(out, 7.0 * 2.0**-rank * sign, name="exact").wait()
    expected = 7.0 * sum(2.0**-s for s in range(world)) * sign.view(world, n)[rank]
    return [] if torch.equal(out, expected) else [f"exact inputs: {int((out != expected).sum())} of {n} differ"]


def _check_bytes(world: int, rows: list[list[int]], qrs) -> list[str]:
    nodes, local = len(rows), len(rows[0])
    problems = []
    if local > 1 and qrs.bytes["intra"] == 0:
        problems.append("nothing was quantized inside the node")
    if nodes > 1 and qrs.bytes["inter"] == 0:
        problems.append("nothing was quantized across nodes")
    if nodes == 1 and qrs.bytes["inter"] != 0:
        problems.append(f"one node, yet {qrs.bytes['inter']} bytes across nodes")
    return problems


@pytest.mark.distributed
@pytest.mark.parametrize("grid", list(GRIDS))
def test_sum_within_the_two_hop_bound(grid: str) -> None:
    world, nodes_of = GRIDS[grid]
    run_ranks_checked(_check_sums, world, nodes_of)


def _check_feedback(rank: int, world: int, nodes_of: list[int]) -> list[str]:
    import zero_kernels.kernels as codec
    from zero_kernels.comm import TorchCommEngine
    from zero_kernels.comm.quantized import ErrorFeedback, QuantizedReduceScatter

    _emulate(rank, nodes_of)
    engine = TorchCommEngine()
    plain = QuantizedReduceScatter(engine, codec, block=BLOCK)
    loco = QuantizedReduceScatter(engine, codec, block=BLOCK, error_feedback=ErrorFeedback(0.5, 1000))
    reset = QuantizedReduceScatter(engine, codec, block=BLOCK, error_feedback=ErrorFeedback(0.5, 2))
    n, steps = 301, 8
    xs = _inputs(world, n, torch.float32, seed=5)
    exact = sum(x.double() for x in xs).view(world, n)[rank]
    outs: dict[str, list[torch.Tensor]] = {"plain": [], "loco": [], "reset": []}
    for _ in range(steps):
        for name, qrs in (("plain", plain), ("loco", loco), ("reset", reset)):
            out = torch.empty(n)
            qrs.reduce_scatter(out, xs[rank].clone(), name="bucket").wait()
            outs[name].append(out.double())
    problems = []
    single = (outs["plain"][0] - exact).abs().max().item()
    mean = (torch.stack(outs["loco"]).mean(0) - exact).abs().max().item()
    if not mean <= 0.5 * single:
        problems.append(f"error feedback: mean of {steps} reductions off by {mean:.3g}, one without it {single:.3g}")
    if not torch.equal(outs["loco"][0], outs["plain"][0]):
        problems.append("the first reduction with error feedback differs from the plain one (no error yet)")
    if torch.equal(outs["reset"][1], outs["reset"][0]) or not torch.equal(outs["reset"][2], outs["reset"][0]):
        problems.append("reset_T=2: the third reduction must start again from no error, the second must not")
    overflow = xs[rank].clone()
    overflow[::7] = float("inf")
    loco.reduce_scatter(torch.empty(n), overflow, name="bucket").wait()
    out = torch.empty(n)
    loco.reduce_scatter(out, xs[rank].clone(), name="bucket").wait()
    if not bool(out.isfinite().all()):
        problems.append("after an overflow step the error feedback keeps the next reductions non-finite")
    return problems


@pytest.mark.distributed
def test_error_feedback_cancels_over_reductions_and_resets() -> None:
    run_ranks_checked(_check_feedback, 4, [0, 0, 1, 1])


def _check_index_moves(rank: int, world: int, nodes_of: list[int]) -> list[str]:
    """Every ``Tensor.to`` of the host index tensors over 3 buckets: at most one per tensor and device (a copy
    from pageable memory per bucket is a host sync per bucket on a GPU), and both tensors are used."""
    import zero_kernels.kernels as codec
    from zero_kernels.comm import TorchCommEngine
    from zero_kernels.comm.quantized import QuantizedReduceScatter

    _emulate(rank, nodes_of)
    qrs = QuantizedReduceScatter(TorchCommEngine(), codec, block=BLOCK)
    indices = {id(qrs._intra_order): "_intra_order", id(qrs._inter_rows): "_inter_rows"}
    moves: list[tuple[str, str]] = []
    real = torch.Tensor.to

    def spy(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if id(self) in indices:
            moves.append((indices[id(self)], str(args[0] if args else kwargs)))
        return real(self, *args, **kwargs)

    torch.Tensor.to = spy  # type: ignore[method-assign]
    try:
        for k in range(3):
            qrs.reduce_scatter(torch.empty(10), torch.randn(10 * world), name=f"b{k}").wait()
    finally:
        torch.Tensor.to = real  # type: ignore[method-assign]
    names = {name for name, _ in moves}
    return [] if len(moves) == len(set(moves)) == 2 and len(names) == 2 else [f"index tensors moved: {moves}"]


@pytest.mark.distributed
def test_index_tensors_reach_the_device_once() -> None:
    run_ranks_checked(_check_index_moves, 4, [0, 1, 0, 1])


def _check_logs_once_and_refuses_a_subgroup(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    import zero_kernels.kernels as codec
    from zero_kernels.comm import TorchCommEngine
    from zero_kernels.comm.quantized import QuantizedReduceScatter

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("zero_kernels")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    qrs = QuantizedReduceScatter(TorchCommEngine(), codec)
    for k in range(3):
        qrs.reduce_scatter(torch.empty(10), torch.randn(10 * world), name=f"b{k}").wait()
    told = [r.getMessage() for r in records if "qgZ" in r.getMessage()]
    problems = [] if len(told) == 1 and "bytes" in told[0] else [f"logged {told}"]
    sub = dist.new_group(ranks=[1, 0])
    if rank < 2:
        try:
            QuantizedReduceScatter(TorchCommEngine(sub), codec)
            problems.append("a data-parallel subgroup was accepted")
        except ValueError as exc:
            problems += [] if "default process group" in str(exc) else [str(exc)]
    return problems


@pytest.mark.distributed
def test_logs_once_and_refuses_a_subgroup() -> None:
    run_ranks_checked(_check_logs_once_and_refuses_a_subgroup, 3)


def test_loco_param_is_checked() -> None:
    from zero_kernels.comm.quantized import ErrorFeedback

    assert ErrorFeedback.from_loco(None) is None
    assert ErrorFeedback.from_loco({"err_beta": 0.5, "reset_T": 8}) == ErrorFeedback(0.5, 8)
    assert ErrorFeedback.from_loco({}) == ErrorFeedback(0.8, 1024)
    for bad, words in (({"err_beta": 1.0}, "err_beta"), ({"reset_T": 0}, "reset_T"), ({"beta": 0.1}, "unknown")):
        with pytest.raises(ValueError, match=words):
            ErrorFeedback.from_loco(bad)


def test_one_rank_copies() -> None:
    import zero_kernels.kernels as codec
    from zero_kernels.comm import TorchCommEngine
    from zero_kernels.comm.quantized import QuantizedReduceScatter

    x = torch.randn(11, dtype=torch.bfloat16)
    out = torch.empty(11, dtype=torch.bfloat16)
    QuantizedReduceScatter(TorchCommEngine(), codec).reduce_scatter(out, x).wait()
    assert torch.equal(out, x)
