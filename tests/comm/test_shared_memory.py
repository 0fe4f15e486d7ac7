"""The C++ engine's shared-memory channel: ranks on one host reduce-scatter and all-gather through it.

It must give the same bits as the point-to-point exchange it replaces (the same sums in the same order),
over several chunks and with several operations in flight; every rank must take the same decision
(``ZERO_KERNELS_SHM=0`` on one rank, ranks on different nodes, a segment rank 0 cannot create: sockets
everywhere); a peer that dies or never comes is an error naming it, not a hang; the segment's name never
outlives the handshake.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from zero_kernels import _ext
from zero_kernels.comm import CommError, make_engine

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
SIZES = (1, 7, 1000, (1 << 20) + 3)  # the last spans several chunks at 2 and 3 ranks


@pytest.fixture(scope="module", autouse=True)
def cpp_engine() -> None:
    try:
        _ext.load("comm")
    except _ext.ExtensionUnavailable as exc:
        pytest.skip(f"the shared-memory channel is the C++ engine's: {exc}")


def _segments() -> list[str]:
    """The segments in /dev/shm named by this job's rank 0 (the creator's pid is in the name): those of other jobs
    on the host, or left behind by a killed one, are not this test's."""
    pids = [None]
    if torch.distributed.get_rank() == 0:
        pids = [os.getpid()]
    torch.distributed.broadcast_object_list(pids, src=0)
    return sorted(p.name for p in Path("/dev/shm").glob(f"zero_kernels-{pids[0]}-*"))


def _bucket(rank: int, n: int, dtype: torch.dtype, world: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(world * n, generator=generator, dtype=torch.float64).to(dtype)


def _same_bits(rank: int, world: int) -> None:
    engine = make_engine(backend="cpp")
    assert engine.primitive_for("reduce_scatter", torch.empty(world)) == "reduce_scatter_shm"
    assert engine.primitive_for("all_gather", torch.empty(world, dtype=torch.uint8)) == "all_gather_shm"
    assert engine.primitive_for("reduce_scatter", torch.empty(world, dtype=torch.int64)) == "reduce_scatter_p2p"
    left = _segments()
    assert left == [], left  # unlinked once every rank opened it
    issued = []
    for i, (dtype, n) in enumerate((d, n) for d in DTYPES for n in SIZES):
        bucket = _bucket(rank, n, dtype, world, i)
        for out_dtype in (dtype, torch.float32):
            outs = [torch.empty(n, dtype=out_dtype) for _ in range(2)]
            for out, primitive in zip(outs, ("reduce_scatter_shm", "reduce_scatter_p2p")):
                issued.append(engine.reduce_scatter(out, bucket.clone(), name=f"rs{i}", primitive=primitive))
            fulls = [torch.empty(world * n, dtype=out_dtype) for _ in range(2)]
            for full, primitive in zip(fulls, ("all_gather_shm", "all_gather_p2p")):
                issued.append(engine.all_gather(full, bucket[:n], name=f"ag{i}", primitive=primitive))
            issued.append((outs, fulls, dtype, n))
    checks = [item for item in issued if isinstance(item, tuple)]
    for handle in (item for item in issued if not isinstance(item, tuple)):
        handle.wait()
    for outs, fulls, dtype, n in checks:
        assert torch.equal(outs[0], outs[1]), (dtype, n, (outs[0].double() - outs[1].double()).abs().max())
        assert torch.equal(fulls[0], fulls[1]), (dtype, n)
    ints = torch.arange(world * 5) * (rank + 1)
    out = torch.empty(5, dtype=torch.int64)
    engine.reduce_scatter(out, ints.clone(), name="ints").wait()
    assert torch.equal(out, torch.arange(world * 5)[rank * 5 : rank * 5 + 5] * sum(range(1, world + 1)))


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_the_channel_gives_the_bits_of_the_pairwise_exchange(spawn, world: int) -> None:
    spawn(_same_bits, world)


def _sums(rank: int, world: int) -> None:
    """All-reduces through the channel: sums within the dtype's rounding of the float64 sum, the same bits on every
    rank (each part is summed by one rank), whatever the size (fewer elements than ranks, parts of unequal length);
    max and min of floating-point and integer tensors exactly, a NaN winning as in torch.maximum."""
    import torch.distributed as dist

    engine = make_engine(backend="cpp")
    assert engine.shares_memory()
    for i, (dtype, n) in enumerate((d, n) for d in DTYPES for n in (*SIZES, world - 1, 2 * world + 1)):
        mine = _bucket(rank, n, dtype, 1, i)
        got = mine.clone()
        engine.all_reduce(got, name=f"sum{i}").wait()
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        want = torch.stack([t.double() for t in everyone]).sum(0)
        tol = {torch.float32: 1e-6, torch.float64: 1e-12}.get(dtype, 1e-2)
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * world)
        results = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(results, got)
        assert all(torch.equal(r, got) for r in results), (dtype, n)
    for op, fold in (("max", torch.maximum), ("min", torch.minimum)):
        for dtype in (torch.float64, torch.bfloat16, torch.int64, torch.int8):
            rows = [torch.tensor([r, -r, 3 * r - 2, 1]).to(dtype) for r in range(world)]
            got = rows[rank].clone()
            engine.all_reduce(got, op=op, name=op).wait()
            want = rows[0]
            for row in rows[1:]:
                want = fold(want, row)
            assert torch.equal(got, want), (op, dtype, got, want)
        nan = torch.tensor([float("nan") if rank == world - 1 else 1.0, float(rank)])
        engine.all_reduce(nan, op=op, name="nan").wait()
        assert nan[0].isnan() and nan[1] == fold(torch.tensor(0.0), torch.tensor(float(world - 1))), (op, nan)
    ints = torch.full((5,), rank + 1)
    engine.all_reduce(ints, name="ints").wait()
    assert torch.equal(ints, torch.full((5,), sum(range(1, world + 1))))
    wrapped = torch.full((3,), 100, dtype=torch.int8)  # wraps as torch's int8 sums do
    engine.all_reduce(wrapped, name="int8").wait()
    assert torch.equal(wrapped, (torch.full((3,), 100, dtype=torch.int8) * world)), wrapped


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_all_reduces_through_the_channel_are_the_same_on_every_rank(spawn, world: int) -> None:
    spawn(_sums, world)


def _sockets_everywhere(rank: int, world: int, case: str) -> None:
    from zero_kernels.comm import shared_memory

    if case == "one rank opts out" and rank == 1:
        os.environ["ZERO_KERNELS_SHM"] = "0"
    if case == "two nodes":
        os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if case == "no room":
        shared_memory.SEGMENT_BYTES, shared_memory.CHUNK_BYTES = 1 << 60, 1 << 56
    engine = make_engine(backend="cpp")
    assert engine.primitive_for("reduce_scatter", torch.empty(world)) == "reduce_scatter_p2p", case
    assert engine.shares_memory() is False
    bucket = torch.full((world * 3,), float(rank + 1))
    out = torch.empty(3)
    engine.reduce_scatter(out, bucket, name="rs").wait()
    assert torch.equal(out, torch.full((3,), float(sum(range(1, world + 1)))))
    with pytest.raises(ValueError, match="no channel is open"):
        engine.reduce_scatter(out, bucket, name="rs", primitive="reduce_scatter_shm")
    assert _segments() == []


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["one rank opts out", "two nodes", "no room"])
def test_every_rank_keeps_the_sockets_when_one_cannot_share(spawn, case: str) -> None:
    spawn(_sockets_everywhere, 2, case)


def _peer_dies(rank: int, world: int) -> None:
    engine = make_engine(backend="cpp")
    assert engine.shares_memory()
    if rank == 1:
        os._exit(0)
    started = time.monotonic()
    out = torch.empty(4)
    named = r"reduce_scatter of bucket 'grads' on rank 0 of 2 \(gloo\) failed: rank 1 \(process \d+\) exited$"
    with pytest.raises(CommError, match=named):
        engine.reduce_scatter(out, torch.ones(8), name="grads").wait()
    assert time.monotonic() - started < 10
    with pytest.raises(CommError, match="an earlier operation on the shared-memory channel failed"):
        engine.all_gather(torch.empty(8), out, name="params").wait()
    os._exit(0)  # the peer is gone: skip the process group's teardown


@pytest.mark.distributed
def test_a_peer_that_dies_is_named(spawn) -> None:
    spawn(_peer_dies, 2, timeout_s=300.0)


def _peer_never_comes(rank: int, world: int) -> None:
    engine = make_engine(backend="cpp")
    assert engine.shares_memory()
    if rank == 1:
        time.sleep(6)
        os._exit(0)
    late = r"failed: rank 1 did not reach this operation within the process group's timeout \(2 s\)"
    with pytest.raises(CommError, match=late):
        engine.all_gather(torch.empty(8), torch.ones(4), name="params").wait()
    os._exit(0)


@pytest.mark.distributed
def test_a_peer_that_never_comes_times_out(spawn) -> None:
    spawn(_peer_never_comes, 2, timeout_s=2.0)


def _lost_handle_finishes_first(rank: int, world: int) -> None:
    """Operation A's handle is lost (Ctrl-C after its issue), B writes the same output and is waited for: A is
    finished first, so its output never lands after B's (rank 1 comes late: A is still running when B is issued)."""
    engine = make_engine(backend="cpp")
    assert engine.shares_memory()
    for primitive in ("reduce_scatter_shm", "reduce_scatter_p2p"):
        out = torch.empty(3)
        if rank == 1:
            time.sleep(0.5)
        engine.reduce_scatter(out, torch.full((world * 3,), 1.0), name="a", primitive=primitive)  # handle lost
        engine.reduce_scatter(out, torch.full((world * 3,), 2.0), name="b", primitive=primitive).wait()
        engine.in_flight()  # a late finish of A here would overwrite B's sums
        engine.synchronize()
        assert torch.equal(out, torch.full((3,), 2.0 * world)), (primitive, out)


@pytest.mark.distributed
def test_a_lost_operation_finishes_before_a_later_one(spawn) -> None:
    spawn(_lost_handle_finishes_first, 2)


def _peer_dies_before_the_handshake(rank: int, world: int) -> None:
    """Rank 1 dies before its first exchange; rank 0 has created the segment when the handshake's first exchange
    fails: the segment's name is removed all the same (it used to stay in /dev/shm after the job, 0.5 MiB here)."""
    engine = make_engine(backend="cpp")
    torch.distributed.barrier()
    if rank == 1:
        os._exit(0)
    time.sleep(0.5)
    with pytest.raises(CommError, match="shared_memory.facts"):
        engine.reduce_scatter(torch.empty(4), torch.ones(8), name="grads").wait()
    left = sorted(p.name for p in Path("/dev/shm").glob(f"zero_kernels-{os.getpid()}-*"))
    assert left == [], left
    os._exit(0)  # the peer is gone: skip the process group's teardown


@pytest.mark.distributed
def test_a_peer_that_dies_before_the_handshake_leaves_no_segment(spawn) -> None:
    spawn(_peer_dies_before_the_handshake, 2, timeout_s=30.0)


def _different_operations(rank: int, world: int) -> None:
    """Rank 1 skips an all-gather rank 0 issues (a forward run on one rank only): both raise at the next operation,
    naming the two, before either reads what the other wrote for another one."""
    engine = make_engine(backend="cpp")
    assert engine.shares_memory()
    if rank == 0:
        engine.all_gather(torch.empty(2 * 64), torch.ones(64), name="extra")
    mismatch = r"the ranks issued different operations: rank \d runs (reduce_scatter|all_gather) \(\d+ bytes"
    with pytest.raises(CommError, match=mismatch):
        engine.reduce_scatter(torch.empty(32), torch.ones(64), name="grads").wait()
        engine.synchronize()
    with pytest.raises(CommError, match="an earlier operation on the shared-memory channel failed"):
        engine.all_gather(torch.empty(8), torch.ones(4), name="params").wait()


@pytest.mark.distributed
def test_ranks_that_issue_different_operations_raise(spawn) -> None:
    spawn(_different_operations, 2)
