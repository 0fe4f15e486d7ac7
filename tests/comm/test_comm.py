"""Comm engines against torch.distributed's own collectives, on gloo ranks.

Both engines run through the same bodies. Sums use integer-valued floats so that every reduction
order gives the same bits and results compare exactly; copies and max/min use normal random data.
Each spawn runs many checks (spawning costs seconds); the C++ engine is built once in the parent.
"""

from __future__ import annotations

import logging
import random
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from zero_kernels import _ext, comm, comm_objects
from zero_kernels.comm.engine_base import resolve_backend

SHARD_SIZES = (1, 7, 1000, 4099, 33, 65539, 2)


@pytest.fixture(scope="module")
def engine_names() -> list[str]:
    """Engines to test; the C++ one is built here so that spawned ranks load it from the cache."""
    try:
        _ext.load("comm")
    except _ext.ExtensionUnavailable:
        return ["torch"]
    return ["torch", "cpp"]


# ---------------------------------------------------------------- helpers run on every rank


def _ints(gen: torch.Generator, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randint(-50, 50, (n,), generator=gen).to(dtype)


def _ref_reduce_scatter(input: torch.Tensor, n: int) -> torch.Tensor:
    expected = torch.empty(n, dtype=input.dtype)
    dist.reduce_scatter(expected, list(input.clone().chunk(dist.get_world_size())))
    return expected


def _ref_all_gather(shard: torch.Tensor, world_size: int) -> torch.Tensor:
    parts = [torch.empty_like(shard) for _ in range(world_size)]
    dist.all_gather(parts, shard)
    return torch.cat(parts)


def _ref_all_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    expected = tensor.clone()
    dist.all_reduce(expected, op=comm.REDUCE_OPS[op])
    return expected


def _compute(gen: torch.Generator) -> None:
    a = torch.randn(48, 48, generator=gen)
    for _ in range(random.randint(0, 4)):
        a = torch.tanh(a @ a)


def _equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert torch.equal(actual, expected), f"{what}: {(actual != expected).sum().item()} elements differ"


def _engines(names: list[str]) -> list:
    return [comm.make_engine(backend=name) for name in names]


# ---------------------------------------------------------------- bodies


def _check_many_in_flight(engine, rank: int, world_size: int, gen: torch.Generator) -> None:
    """Every primitive, uneven sizes, all buckets in flight at once, compute before the waits."""
    primitives = [(op, p) for op in ("reduce_scatter",) for p in comm.REDUCE_SCATTER_PRIMITIVES]
    primitives += [("all_gather", p) for p in comm.ALL_GATHER_PRIMITIVES] + [("reduce_scatter", None)]
    primitives += [("all_gather", None)]
    jobs = []
    for op, primitive in primitives:
        for n in SHARD_SIZES:
            name = f"{op}.{primitive}.{n}"
            if op == "reduce_scatter":
                input = _ints(gen, n * world_size)
                expected = _ref_reduce_scatter(input, n)
                output = torch.full((n,), float("nan"))
                handle = engine.reduce_scatter(output, input, name=name, primitive=primitive)
            else:
                shard = torch.randn(n, generator=gen)
                expected = _ref_all_gather(shard, world_size)
                output = torch.full((n * world_size,), float("nan"))
                handle = engine.all_gather(output, shard, name=name, primitive=primitive)
            jobs.append((handle, output, expected, name))
            _compute(gen)
    for handle, output, expected, name in random.sample(jobs, len(jobs)):
        handle.wait()
        handle.wait()
        assert handle.is_completed()
        _equal(output, expected, f"{engine.kind} rank {rank} {name}")


def _check_all_reduce_and_casts(engine, rank: int, world_size: int, gen: torch.Generator) -> None:
    for op in comm.REDUCE_OPS:
        tensor = _ints(gen, 3001) if op == "sum" else torch.randn(3001, generator=gen)
        expected = _ref_all_reduce(tensor, op)
        handle = engine.all_reduce(tensor, op=op, name=f"ar.{op}")
        _compute(gen)
        handle.wait()
        _equal(tensor, expected, f"{engine.kind} rank {rank} all_reduce {op}")
    # bf16 buckets reduced, fp32 shards out; fp32 shards gathered as bf16 parameters.
    for primitive in comm.REDUCE_SCATTER_PRIMITIVES:
        input = _ints(gen, 517 * world_size, torch.bfloat16)
        expected = _ref_reduce_scatter(input, 517).float()
        output = torch.empty(517)
        engine.reduce_scatter(output, input, name="cast", primitive=primitive).wait()
        _equal(output, expected, f"{engine.kind} rank {rank} reduce_scatter bf16->fp32 {primitive}")
    for primitive in comm.ALL_GATHER_PRIMITIVES:
        shard = torch.randn(259, generator=gen)
        expected = _ref_all_gather(shard.bfloat16(), world_size)
        output = torch.empty(259 * world_size, dtype=torch.bfloat16)
        engine.all_gather(output, shard, name="cast", primitive=primitive).wait()
        _equal(output, expected, f"{engine.kind} rank {rank} all_gather fp32->bf16 {primitive}")


def _check_ordering_stress(engine, rank: int, world_size: int, seed: int) -> None:
    """60 buckets of random kinds and sizes; issues and waits in a random interleaving."""
    schedule = random.Random(seed)  # the same on every rank: collectives must match
    local = random.Random(seed * 31 + rank)  # wait order differs per rank
    gen = torch.Generator().manual_seed(seed * 7 + rank)
    buckets = []
    for i in range(60):
        kind, n = schedule.choice(("rs", "ag", "ar")), schedule.randint(1, 3000)
        if kind == "rs":
            input = _ints(gen, n * world_size)
            buckets.append((kind, f"b{i}", input, torch.empty(n), _ref_reduce_scatter(input, n)))
        elif kind == "ag":
            shard = torch.randn(n, generator=gen)
            buckets.append((kind, f"b{i}", shard, torch.empty(n * world_size), _ref_all_gather(shard, world_size)))
        else:
            tensor = _ints(gen, n)
            buckets.append((kind, f"b{i}", tensor, tensor, _ref_all_reduce(tensor, "sum")))
    pending = []
    for kind, name, input, output, _ in buckets:
        if kind == "rs":
            pending.append(engine.reduce_scatter(output, input, name=name))
        elif kind == "ag":
            pending.append(engine.all_gather(output, input, name=name))
        else:
            pending.append(engine.all_reduce(output, name=name))
        if local.random() < 0.3:
            local.shuffle(pending)
            for _ in range(local.randint(0, len(pending))):
                pending.pop().wait()
    local.shuffle(pending)
    for handle in pending:
        handle.wait()
    for _, name, _, output, expected in buckets:
        _equal(output, expected, f"{engine.kind} rank {rank} stress {name}")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _check_lifetime(engine, rank: int, world_size: int, gen: torch.Generator) -> None:
    """Buffers and handles dropped while in flight; a long run neither leaks handles nor memory."""
    expected, outputs, kept = [], [], []
    for i, n in enumerate(SHARD_SIZES * 3):
        input = _ints(gen, n * world_size)
        expected.append(_ref_reduce_scatter(input, n))
        outputs.append(torch.empty(n))
        handle = engine.reduce_scatter(outputs[-1], input, name=f"dropped{i}")
        del input  # the engine keeps the scratch buffer alive
        _ints(gen, n * world_size)  # fresh allocations that would reuse freed memory
        if i % 2:
            kept.append(handle)
        else:
            del handle  # dropped unwaited: synchronize() still completes it
    engine.synchronize()
    for i, (output, exp) in enumerate(zip(outputs, expected)):
        _equal(output, exp, f"{engine.kind} rank {rank} dropped{i}")
    del kept

    n = 1 << 14
    rss = []
    polled = not engine.primitive_for("reduce_scatter", torch.empty(n * world_size)).endswith("_p2p")
    for i in range(300):
        input = _ints(gen, n * world_size)
        output = torch.empty(n)
        handle = engine.reduce_scatter(output, input, name=f"long{i}")
        if i % 3 == 0 or i == 299:
            handle.wait()
        del handle, input, output
        if i == 299:  # finished operations are dropped as new ones are issued, not only at synchronize
            held = engine.in_flight()
            bound = 2 if polled else comm.MAX_HELD  # unwaited point-to-point operations are bounded
            assert held <= bound, f"{engine.kind} rank {rank}: {held} finished operations still held"
        if i in (50, 299):
            engine.synchronize()
            rss.append(_rss_bytes())
    assert engine.in_flight() == 0, f"{engine.kind} rank {rank}: {engine.in_flight()} operations still held"
    if engine.kind == "cpp":
        live = _ext.load("comm").live_ops()
        assert live == 0, f"rank {rank}: {live} C++ operations alive after synchronize"
    growth = rss[1] - rss[0]
    per_op = 3 * n * world_size * 4
    assert growth < 25 * per_op, f"{engine.kind} rank {rank}: RSS grew {growth} B over 250 operations"


def _collectives_body(rank: int, world_size: int, names: list[str]) -> None:
    for engine in _engines(names):
        assert (engine.rank, engine.world_size, engine.backend) == (rank, world_size, "gloo")
        random.seed(rank)
        gen = torch.Generator().manual_seed(1000 + rank)
        _check_many_in_flight(engine, rank, world_size, gen)
        _check_all_reduce_and_casts(engine, rank, world_size, gen)
        _check_ordering_stress(engine, rank, world_size, seed=5)
        if world_size == 2:
            _check_lifetime(engine, rank, world_size, gen)
        objects = comm_objects.all_gather_objects(engine, {"rank": rank, "text": "x" * 100 * rank})
        assert objects == [{"rank": r, "text": "x" * 100 * r} for r in range(world_size)], objects


def _errors_body(rank: int, world_size: int, names: list[str]) -> None:
    for engine in _engines(names):
        with pytest.raises(ValueError, match=rf"reduce_scatter of bucket 'odd' on rank {rank} of 2.*7 elements"):
            engine.reduce_scatter(torch.empty(3), torch.empty(7), name="odd")
        with pytest.raises(ValueError, match=rf"all_gather of bucket 'g' on rank {rank}.*contiguous"):
            engine.all_gather(torch.empty(4, 2).t(), torch.empty(4), name="g")
        with pytest.raises(ValueError, match=rf"all_reduce of bucket 'm' on rank {rank}.*'avg'"):
            engine.all_reduce(torch.empty(4), op="avg", name="m")
        with pytest.raises(ValueError, match=rf"reduce_scatter of bucket 'p' on rank {rank}.*'all_gather_list'"):
            engine.reduce_scatter(torch.empty(2), torch.empty(4), name="p", primitive="all_gather_list")

        # A peer that never joins: the process group's timeout surfaces as a named failure.
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
        timed = comm.make_engine(group, backend=engine.kind)
        timed.all_reduce(torch.ones(4), name="first").wait()  # both ranks: the C++ engine's channel is decided
        if rank == 0:
            start = time.perf_counter()
            handle = timed.all_reduce(torch.ones(16), name="late-bucket")
            for wait in (handle.wait, handle.wait, timed.synchronize):
                with pytest.raises(comm.CommError, match=r"all_reduce of bucket 'late-bucket' on rank 0 of 2"):
                    wait()
            if engine.kind == "cpp":  # a float sum first decides on shared memory with the peers: raised at issue
                with pytest.raises(comm.CommError, match=r"all_reduce of bucket 'late-sum' on rank 0 of 2 .*failed"):
                    comm.make_engine(group, backend="cpp").all_reduce(torch.ones(16), name="late-sum")
            assert time.perf_counter() - start < 30
        dist.barrier()
        # An engine does not keep its process group alive: after destroy_process_group() it says so,
        # and is torn down without deadlock.
        group = dist.new_group(backend="gloo")
        outliving = comm.make_engine(group, backend=engine.kind)
        tensor = torch.ones(1 << 12)
        outliving.all_reduce(tensor, name="last").wait()
        dist.destroy_process_group(group)
        del group
        gone = f"all_reduce of bucket 'after'.*process group of this {engine.kind} engine was destroyed"
        with pytest.raises(comm.CommError, match=gone):
            outliving.all_reduce(tensor, name="after")
        del outliving, tensor
        dist.barrier()
    if "cpp" in names:
        ext = _ext.load("comm")
        engine = ext.Engine(dist.group.WORLD)
        with pytest.raises(ValueError, match=rf"reduce_scatter of bucket 'raw' on rank {rank} of 2.*7 elements"):
            engine.reduce_scatter(torch.empty(3), torch.empty(7), "raw", ext.Primitive.all_reduce_slice)
        # The C++ engine holds its group weakly: once Python drops the group, c10d's object is gone.
        group = dist.new_group(backend="gloo")
        raw = ext.Engine(group)
        dist.destroy_process_group(group)
        del group
        with pytest.raises(RuntimeError, match="all_reduce of bucket 'gone'.*process group was destroyed"):
            raw.all_reduce(torch.ones(4), "sum", "gone")


def _group_errors_body(rank: int, world_size: int, names: list[str]) -> None:
    """An engine on the group of ranks 1 and 2 names its rank in that group and the global one; on the world, one."""
    group = dist.new_group([1, 2])
    for name in names:
        world = comm.make_engine(backend=name)
        with pytest.raises(ValueError, match=rf"'odd' on rank {rank} of 3 \(gloo\)"):
            world.reduce_scatter(torch.empty(3), torch.empty(7), name="odd")
        if rank == 0:
            continue
        engine = comm.make_engine(group, backend=name)
        said = rf"reduce_scatter of bucket 'odd' on rank {rank - 1} of 2 \(global rank {rank}\)"
        with pytest.raises(ValueError, match=said):
            engine.reduce_scatter(torch.empty(3), torch.empty(7), name="odd")
    dist.barrier()


# ---------------------------------------------------------------- tests


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_match_torch_distributed(spawn, engine_names: list[str], world_size: int) -> None:
    spawn(_collectives_body, world_size, engine_names)


@pytest.mark.distributed
def test_errors_name_operation_bucket_and_rank(spawn, engine_names: list[str]) -> None:
    spawn(_errors_body, 2, engine_names)


@pytest.mark.distributed
def test_errors_on_a_group_of_some_ranks_name_the_global_rank(spawn, engine_names: list[str]) -> None:
    spawn(_group_errors_body, 3, engine_names)


@pytest.mark.ext
def test_cpp_engine_builds(engine_names: list[str]) -> None:
    if "cpp" not in engine_names:
        with pytest.raises(_ext.ExtensionUnavailable) as info:
            _ext.load("comm")
        pytest.skip(f"C++ comm engine not buildable here: {info.value}")
    assert hasattr(_ext.load("comm"), "Engine")


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_world_size_one_is_local_and_complete(engine_names: list[str], backend: str) -> None:
    if backend not in engine_names:
        pytest.skip("C++ comm engine not buildable here")
    engine = comm.make_engine(backend=backend)
    assert (engine.rank, engine.world_size, engine.backend) == (0, 1, "local")
    input, output = torch.randn(10), torch.empty(10, dtype=torch.float64)
    handle = engine.reduce_scatter(output, input, name="solo")
    assert handle.is_completed()
    _equal(output, input.double(), "world size 1 reduce_scatter")
    full = torch.empty(10)
    engine.all_gather(full, input, name="solo").wait()
    _equal(full, input, "world size 1 all_gather")
    with pytest.raises(ValueError, match="reduce_scatter of bucket 'solo' on rank 0 of 1"):
        engine.reduce_scatter(torch.empty(3), input, name="solo")


def test_auto_falls_back_to_torch_with_one_log_line(monkeypatch, caplog) -> None:
    def unavailable(name: str):
        raise _ext.ExtensionUnavailable(f"cannot build zero_kernels extension '{name}': no compiler (test)")

    monkeypatch.setattr(_ext, "load", unavailable)
    _ext.warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        engines = [comm.make_engine(backend="auto") for _ in range(3)]
    assert all(isinstance(e, comm.TorchCommEngine) for e in engines)
    assert [r.getMessage() for r in caplog.records if "torch engine" in r.getMessage()] == [
        "cannot build zero_kernels extension 'comm': no compiler (test); zero_kernels comm uses the torch engine"
    ]
    with pytest.raises(_ext.ExtensionUnavailable, match="no compiler"):
        comm.make_engine(backend="cpp")
    with pytest.raises(ValueError, match="allowed: auto, cpp, torch"):
        comm.make_engine(backend="mpi")


@pytest.mark.parametrize(
    "name, config, cuda, want",
    [
        ("gloo", "cpu:gloo,cuda:gloo", False, "gloo"),
        ("undefined", "cpu:gloo", False, "gloo"),  # init_process_group() without a backend, no CUDA
        ("undefined", "cpu:gloo,cuda:nccl", True, "nccl"),  # the same with CUDA
        ("undefined", "cpu:gloo,cuda:nccl", False, "gloo"),
        ("cuda:nccl,cpu:gloo", "cuda:nccl,cpu:gloo", True, "nccl"),  # a per-device string given by hand
        ("cuda:nccl", "cuda:nccl", False, "nccl"),  # no backend for the CPU: the one there is
    ],
)
def test_the_backend_is_the_one_the_tensors_use(name: str, config: str, cuda: bool, want: str) -> None:
    assert resolve_backend(name, config, cuda) == want


def test_primitive_table_is_consulted() -> None:
    assert comm.choose_primitive("gloo", "reduce_scatter", 1 << 20) == "reduce_scatter_p2p"
    assert comm.choose_primitive("nccl", "reduce_scatter", 1 << 20) == "reduce_scatter_tensor"
    assert comm.choose_primitive("nccl", "all_gather", 1) == "all_gather_tensor"
    assert comm.choose_primitive("gloo", "all_gather", 1) == "all_gather_p2p"


def test_point_to_point_posts_every_receive_before_any_send(monkeypatch) -> None:
    """gloo tells a sender that its receiver is ready in-band, on the pair's socket: a receive posted after
    a send to the same peer waits behind that send's bytes, and on a slow link a pair's two directions
    then take turns (``python -m benchmarks links``; benchmarks/RESULTS.md has the measurement)."""
    posted = []
    monkeypatch.setattr(dist, "irecv", lambda t, peer, **kw: posted.append(("recv", peer)))
    monkeypatch.setattr(dist, "isend", lambda t, peer, **kw: posted.append(("send", peer)))
    engine = comm.TorchCommEngine()
    chunks = {peer: torch.zeros(3) for peer in (1, 2, 3)}
    engine._exchange("all_gather", "all_gather", chunks, {peer: torch.empty(3) for peer in chunks})
    assert [kind for kind, _ in posted] == ["recv"] * 3 + ["send"] * 3, posted
    assert sorted(peer for _, peer in posted[:3]) == sorted(peer for _, peer in posted[3:]) == [1, 2, 3]
