"""The C++ engine's two-level reduce-scatter, all-gather and all-reduce across nodes, on gloo ranks that play nodes.

Each rank is told its node and local rank as torchrun tells them (``GROUP_RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``). A reduce-scatter sums in another order than the pairwise exchange, so it is compared
with a float64 sum within float32 rounding; an all-gather moves bytes only and compares exactly. Several
operations are kept in flight at once, as the stages issue them, with other dtypes going out.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import zero_kernels.comm.cpp_engine as cpp_module
from tests.helpers.lockstep import step_beside_adamw
from zero_kernels import _ext
from zero_kernels.comm import make_engine

SIZES = (1, 7, 1000, 65539)


@pytest.fixture(scope="module", autouse=True)
def cpp_engine() -> None:
    try:
        _ext.load("comm")
    except _ext.ExtensionUnavailable as exc:
        pytest.skip(f"the two-level primitives are the C++ engine's: {exc}")


def _place(rank: int, local_size: int, strided: bool) -> None:
    node, local = (rank % 2, rank // 2) if strided else (rank // local_size, rank % local_size)
    os.environ.update(GROUP_RANK=str(node), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(local_size))


def _data(world: int, n: int, seed: int) -> list[torch.Tensor]:
    return [torch.randn(world * n, generator=torch.Generator().manual_seed(seed * 1000 + r)) for r in range(world)]


def _reduce_scatters(engine, rank: int, world: int) -> None:
    issued = []
    for i, n in enumerate(SIZES):
        for dtype, out_dtype in ((torch.float32, torch.float32), (torch.float32, torch.bfloat16)):
            inputs = _data(world, n, 2 * i + (dtype != out_dtype))
            out = torch.empty(n, dtype=out_dtype)
            issued.append((engine.reduce_scatter(out, inputs[rank].clone(), name=f"rs{n}"), out, inputs, n))
    for handle, out, inputs, n in issued:
        handle.wait()
        want = torch.stack([t.double() for t in inputs]).sum(0).narrow(0, rank * n, n)
        tol = 1e-5 if out.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.double(), want.to(out.dtype).double(), rtol=tol, atol=tol * world)


def _all_gathers(engine, rank: int, world: int) -> None:
    issued = []
    for i, n in enumerate(SIZES):
        shards = [t.narrow(0, 0, n).to(torch.bfloat16) for t in _data(world, n, 50 + i)]
        full = torch.empty(world * n, dtype=torch.float32)
        issued.append((engine.all_gather(full, shards[rank], name=f"ag{n}"), full, shards))
    for handle, full, shards in issued:
        handle.wait()
        assert torch.equal(full, torch.cat(shards).float())


def _all_reduces(engine, rank: int, world: int) -> None:
    """Sums in two levels (at every size: the threshold lowered), in place, of sizes the ranks divide and do not,
    several in flight with reduce-scatters between them; against the float64 sum."""
    cpp_module.NODES_ALL_REDUCE_BYTES = 0
    assert engine._two_levels(torch.empty(1), "sum")
    issued = []
    for i, n in enumerate(SIZES):
        for dtype in (torch.float32, torch.bfloat16):
            inputs = [t.to(dtype) for t in _data(world, n, 70 + i)]
            mine = inputs[rank].clone()
            issued.append((engine.all_reduce(mine, name=f"ar{n}"), mine, inputs, None))
            out, data = torch.empty(n), _data(world, n, 90 + i)
            issued.append((engine.reduce_scatter(out, data[rank].clone(), name=f"rs{n}"), out, data, n))
    for handle, got, inputs, n in issued:
        handle.wait()
        want = torch.stack([t.double() for t in inputs]).sum(0)
        want = want if n is None else want.narrow(0, rank * n, n)
        tol = 1e-5 if got.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.double(), want.to(got.dtype).double(), rtol=tol, atol=tol * world)


def _two_levels(rank: int, world: int, local_size: int, strided: bool, rows: list[list[int]], shm: bool) -> None:
    _place(rank, local_size, strided)
    os.environ["ZERO_KERNELS_SHM"] = str(int(shm))
    engine = make_engine(backend="cpp")
    assert engine.nodes == rows, engine.nodes
    assert engine.primitive_for("reduce_scatter", torch.empty(world)) == "reduce_scatter_nodes"
    assert engine.primitive_for("all_gather", torch.empty(world)) == "all_gather_nodes"
    _reduce_scatters(engine, rank, world)
    _all_gathers(engine, rank, world)
    _all_reduces(engine, rank, world)
    engine.synchronize()
    assert engine.in_flight() == 0
    assert engine.shares_memory() is shm  # the level within each node went through the node's channel


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world, local_size, strided, rows",
    [
        (4, 2, False, [[0, 1], [2, 3]]),
        (4, 2, True, [[0, 2], [1, 3]]),
        (6, 3, False, [[0, 1, 2], [3, 4, 5]]),
    ],
    ids=["2x2", "2x2-strided", "2x3"],
)
@pytest.mark.parametrize("shm", [True, False], ids=["node-channel", "sockets"])
def test_two_level_collectives_match_the_sums(spawn, world: int, local_size: int, strided: bool, rows, shm) -> None:
    spawn(_two_levels, world, local_size, strided, rows, shm)


def _channel_and_sockets(rank: int, world: int) -> None:
    """The level within each node through the node's channel and through the sockets sums the node-mates' chunks
    alike (this rank's own, plus the others' sum rounded to the dtype): the same bits, in every summed dtype."""
    _place(rank, 3, False)
    engines = {}
    for shm in (True, False):
        os.environ["ZERO_KERNELS_SHM"] = str(int(shm))
        engines[shm] = make_engine(backend="cpp")
        assert engines[shm].shares_memory() is shm
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for n in (3, 4099):
            data = _data(world, n, 7)[rank].to(dtype)
            outs = {shm: torch.empty(n, dtype=dtype) for shm in engines}
            for shm, engine in engines.items():
                engine.reduce_scatter(outs[shm], data.clone(), primitive="reduce_scatter_nodes").wait()
            assert torch.equal(outs[True], outs[False]), (dtype, n, (outs[True] - outs[False]).abs().max())


@pytest.mark.distributed
def test_channel_and_sockets_sum_within_the_node_alike(spawn) -> None:
    spawn(_channel_and_sockets, 6)


def _two_engines(rank: int, world: int) -> None:
    """Two engines on one group (two optimizers), their operations in flight together, each engine's second
    level posted by its own relay thread: each operation gets its own bytes."""
    _place(rank, 2, False)
    engines = [make_engine(backend="cpp"), make_engine(backend="cpp")]
    for n in (5, 64, 5000):
        issued = []
        for round_ in range(10):
            for e, engine in enumerate(engines):
                inputs = [torch.full((world * n,), float(1000 * e + 10 * round_ + r)) for r in range(world)]
                out, full = torch.empty(n), torch.empty(world * n)
                issued.append((engine.reduce_scatter(out, inputs[rank].clone(), name="rs"), out, sum(inputs)[:n]))
                issued.append(
                    (engine.all_gather(full, inputs[rank][:n], name="ag"), full, torch.cat([t[:n] for t in inputs]))
                )
        for handle, got, want in issued:
            handle.wait()
            assert torch.equal(got, want), (n, got[:3], want[:3])


@pytest.mark.distributed
def test_two_engines_on_one_group_keep_their_messages_apart(spawn) -> None:
    spawn(_two_engines, 4)


def _one_node(rank: int, world: int) -> None:
    _place(rank, world, False)
    engine = make_engine(backend="cpp")
    assert engine.nodes is None
    assert engine.primitive_for("reduce_scatter", torch.empty(world)) == "reduce_scatter_shm"
    with pytest.raises(ValueError, match="reduce_scatter_nodes"):
        engine.reduce_scatter(torch.empty(1), torch.empty(world), primitive="reduce_scatter_nodes")


@pytest.mark.distributed
def test_one_node_exchanges_within_the_host(spawn) -> None:
    spawn(_one_node, 2)


def _stage0_across_nodes(rank: int, world: int, shm: bool) -> None:
    """Stage 0 at 2 x 2: its gradient buckets (over ``NODES_ALL_REDUCE_BYTES``, sizes the ranks do not divide) are
    summed in two levels, and it trains as AdamW on the whole batch."""
    from zero_kernels import ShardedFusedAdam

    _place(rank, 2, False)
    os.environ["ZERO_KERNELS_SHM"] = str(int(shm))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(61, 301), torch.nn.Tanh(), torch.nn.Linear(301, 5))
    reference = copy.deepcopy(model)
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    opt = ShardedFusedAdam(model, lr=1e-2, weight_decay=0.01, stage=0, reduce_bucket_size=20000)
    engine = opt.pipeline.engine
    assert engine.nodes == [[0, 1], [2, 3]] and engine._two_levels(torch.empty(20000), "sum")
    for step in range(3):
        xs = [torch.randn(4, 61, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(world)]
        step_beside_adamw(model, opt, reference, adamw, xs, rank)
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize("shm", [True, False], ids=["node-channel", "sockets"])
def test_stage0_sums_its_buckets_in_two_levels_across_nodes(spawn, shm: bool) -> None:
    spawn(_stage0_across_nodes, 4, shm)


UNEVEN = ((0, 0, 2), (0, 1, 2), (1, 0, 1))  # (GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE): torchrun on 2 + 1 ranks


def _uneven_nodes(rank: int, world: int, stage: int) -> None:
    from zero_kernels import ShardedFusedAdam

    node, local, size = UNEVEN[rank]
    os.environ.update(GROUP_RANK=str(node), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(size))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))
    reference = copy.deepcopy(model)
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for module in (copy.deepcopy(model), model):  # a second optimizer in the job: no rank left in the first's exchanges
        opt = ShardedFusedAdam(module, lr=1e-2, weight_decay=0.01, stage=stage)
        engine = opt.pipeline.engine
        assert engine.kind == "cpp" and engine.nodes is None
        assert engine.primitive_for("reduce_scatter", torch.empty(world)) == "reduce_scatter_p2p"
    for step in range(3):
        xs = [torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(world)]
        step_beside_adamw(model, opt, reference, adamw, xs, rank)
    with opt.gathered_params():
        for got, want in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_uneven_nodes_train_with_the_direct_exchange(spawn, stage: int) -> None:
    spawn(_uneven_nodes, 3, stage)


def _uneven_nodes_zeropp(rank: int, world: int) -> None:
    from zero_kernels import ShardedFusedAdam

    node, local, size = UNEVEN[rank]
    os.environ.update(GROUP_RANK=str(node), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(size))
    model = torch.nn.Linear(7, 13)
    with pytest.raises(ValueError, match=r"ranks disagree on LOCAL_WORLD_SIZE: \[1, 2\]"):
        ShardedFusedAdam(model, stage=3, zero_quantized_gradients=True)


@pytest.mark.distributed
def test_uneven_nodes_refuse_zeropp_on_every_rank(spawn) -> None:
    """The keys that need nodes of equal size say so on every rank, after the engine chose the direct exchange."""
    spawn(_uneven_nodes_zeropp, 3)


BROKEN = {"missing": None, "not-an-integer": "two"}


def _one_rank_broken(rank: int, world: int, how: str) -> None:
    """Rank 3 alone has no LOCAL_WORLD_SIZE, or one that is not an integer: every rank still takes part in the
    one layout exchange (before, rank 3 skipped it or failed before it, and paired its next exchange with the
    others' layout exchange: a TypeError on three ranks, a device message on the fourth)."""
    from zero_kernels import ShardedFusedAdam

    _place(rank, 2, False)
    if rank == 3:
        os.environ.pop("LOCAL_WORLD_SIZE")
        if BROKEN[how] is not None:
            os.environ["LOCAL_WORLD_SIZE"] = BROKEN[how]
    opt = ShardedFusedAdam(torch.nn.Linear(3, 5), stage=2)
    assert opt.pipeline.engine.nodes is None  # not a regular grid: the direct exchange on every rank
    want = (
        r"ranks disagree on LOCAL_WORLD_SIZE" if how == "missing" else r"rank 3: LOCAL_WORLD_SIZE='two' is not an int"
    )
    with pytest.raises(ValueError, match=want):
        ShardedFusedAdam(torch.nn.Linear(3, 5), stage=3, zero_quantized_gradients=True)


@pytest.mark.distributed
@pytest.mark.parametrize("how", sorted(BROKEN))
def test_one_rank_with_a_broken_node_environment_does_not_split_the_exchanges(spawn, how: str) -> None:
    spawn(_one_rank_broken, 4, how)


def _node_mate_dies(rank: int, world: int) -> None:
    """Rank 3 (local rank 1 of node 1) exits: rank 2's channel names it by its rank in the group, not by its slot in
    the node's channel (before: `rank 1 (process ...) exited`, which named a rank of the other node)."""
    import time

    from zero_kernels.comm import CommError

    _place(rank, 2, False)
    engine = make_engine(backend="cpp")
    assert engine.shares_memory()
    if rank != 2:
        os._exit(0)  # rank 2's reduce-scatter waits on its node-mate first, through the channel
    started = time.monotonic()
    named = r"reduce_scatter of bucket 'grads' on rank 2 of 4 \(gloo\) failed: rank 3 \(process \d+\) exited$"
    with pytest.raises(CommError, match=named):
        engine.reduce_scatter(torch.empty(4), torch.ones(16), name="grads").wait()
    assert time.monotonic() - started < 10
    os._exit(0)  # the peers are gone: skip the process group's teardown


@pytest.mark.distributed
def test_a_node_mate_that_dies_is_named_by_its_rank(spawn) -> None:
    spawn(_node_mate_dies, 4, timeout_s=300.0)
