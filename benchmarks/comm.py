"""Comm engines on 2 gloo ranks: bandwidth per c10d primitive and size, and communication hidden
behind a backward-like compute loop.

Bandwidth rows time one operation (issue + wait, ranks aligned by a barrier, the primitives of a
size sampled in turn) on a full buffer of ``MB`` megabytes; ``GB/s`` is full-buffer bytes over the
median time of the slowest rank, and ``chosen`` marks the primitive the engine's table picks.

Overlap rows run a loop of matmuls (a stand-in for backward) that fills a gradient bucket every
few steps and reduce-scatters it. ``t_compute`` is the loop without communication, ``t_comm``
the same reduce-scatters alone, back to back; ``overlapped`` issues each reduce-scatter as its
bucket fills and waits at the end, ``synchronous`` waits for each one at once. ``hidden`` =
(t_compute + t_comm - t) / t_comm (``NOTES``, printed under the table): 1.0 means communication
cost nothing, 0 means none of it was hidden, below 0 that the run took longer than compute and
communication back to back (they competed for the cores). ``hidden_low``/``hidden_high`` is its
spread over the interleaved rounds. Bandwidth rows carry their rounds too (``rounds_ms``), so that
the summary gives each ratio with its spread. Each rank uses one compute thread
(``torch.set_num_threads(1)``); the 2 ranks share the machine's cores with gloo's own threads, so
on a 2-core machine compute and transfers compete.
"""

from __future__ import annotations

import os
import pickle
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zero_kernels import _ext, comm

from .common import best_vs_peer, end_rank, expect, free_port, progress

DESCRIPTION = "gloo collectives per primitive and size, and overlap of reduce-scatter with compute (2 ranks)"
NOTES = [
    "hidden = (t_compute + t_comm - t) / t_comm, t the step's time in that mode: the share of the communication "
    "time the step did not add to compute (1: all of it hidden; 0: none; below 0: the two slowed each other down); "
    "hideable = min(1, t_compute / t_comm), the most that can hide",
]

WORLD_SIZE = 2
PRIMITIVES = {
    "reduce_scatter": comm.REDUCE_SCATTER_PRIMITIVES,
    "all_gather": comm.ALL_GATHER_PRIMITIVES,
    "all_reduce": ("all_reduce",),
}


def _engines() -> list[str]:
    try:
        _ext.load("comm")  # built here once, so that the ranks load it from the cache
    except _ext.ExtensionUnavailable as exc:
        print(f"comm benchmark: C++ engine unavailable ({exc}); torch engine only")
        return ["torch"]
    return ["torch", "cpp"]


def _interleaved_samples(fns: dict, repeat: int) -> dict:
    """Seconds of each function per round (the slowest rank's), sampled round-robin so that all see the same
    machine load in each round; a first round warms up and is dropped."""
    samples: dict = {key: [] for key in fns}
    for _ in range(repeat + 1):
        for key, fn in fns.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            samples[key].append(time.perf_counter() - start)
    table = torch.tensor([s[1:] for s in samples.values()], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return dict(zip(fns, table.tolist()))


def _issue(engine, op: str, full: torch.Tensor, shard: torch.Tensor, primitive: str):
    if op == "reduce_scatter":
        return engine.reduce_scatter(shard, full, name="bench", primitive=primitive)
    if op == "all_gather":
        return engine.all_gather(full, shard, name="bench", primitive=primitive)
    return engine.all_reduce(full, name="bench")


def _primitives(engine, op: str) -> tuple[str, ...]:
    """The primitives of ``op`` to time on ``engine``: the shared ones, and the C++ engine's shared-memory ones
    where its ranks share memory (``shares_memory`` decides at the first call: collective)."""
    extra = tuple(p for p in engine.extra_primitives if p.startswith(op))
    if extra and not engine.shares_memory():
        extra = tuple(p for p in extra if not p.endswith("_shm"))
    return PRIMITIVES[op] + extra


def _bandwidth_rows(engine, sizes_mb: list[float], repeat: int) -> list[dict]:
    rows = []
    for op in PRIMITIVES:
        primitives = _primitives(engine, op)
        for mb in sizes_mb:
            numel = int(mb * 2**20 / 4) // WORLD_SIZE * WORLD_SIZE
            full, shard = torch.randn(numel), torch.randn(numel // WORLD_SIZE)
            chosen = engine.primitive_for(op, full) if op != "all_reduce" else "all_reduce"
            if dist.get_rank() == 0:
                progress(f"{op} {mb:g} MB", f"{engine.kind} engine")
            fns = {p: (lambda p=p: _issue(engine, op, full, shard, p).wait()) for p in primitives}
            for primitive, samples in _interleaved_samples(fns, repeat).items():
                seconds = statistics.median(samples)
                rows.append(
                    {
                        "case": f"{op} {mb:g} MB",
                        "provider": engine.kind,
                        "primitive": primitive,
                        "chosen": "yes" if primitive == chosen else "",
                        "median_ms": seconds * 1e3,
                        "rounds_ms": [round(t * 1e3, 4) for t in samples],
                        "GB/s": numel * 4 / seconds / 1e9,
                    }
                )
    return rows


def _backward_like(
    weights: list[torch.Tensor], grads: list[torch.Tensor], on_bucket: Callable[[int], None], steps_per_bucket: int
) -> None:
    """Matmul chain standing in for backward; every ``steps_per_bucket`` steps a bucket is full."""
    x = weights[0]
    for step, w in enumerate(weights):
        x = torch.tanh(x @ w)
        if (step + 1) % steps_per_bucket == 0:
            bucket = (step + 1) // steps_per_bucket - 1
            grads[bucket].add_(x.flatten()[: grads[bucket].numel()].sum())
            on_bucket(bucket)


def _overlap_modes(
    engine, grads: list[torch.Tensor], shards: list[torch.Tensor], weights: list[torch.Tensor], steps_per_bucket: int
) -> dict:
    def reduce_scatter(b: int):
        return engine.reduce_scatter(shards[b], grads[b], name=f"grad{b}")

    def comm_only() -> None:
        for b in range(len(grads)):
            reduce_scatter(b).wait()

    def overlapped() -> None:
        handles = []
        _backward_like(weights, grads, lambda b: handles.append(reduce_scatter(b)), steps_per_bucket)
        for h in handles:
            h.wait()

    def synchronous() -> None:
        _backward_like(weights, grads, lambda b: reduce_scatter(b).wait(), steps_per_bucket)

    return {"comm": comm_only, "overlapped": overlapped, "synchronous": synchronous}


def _overlap_rows(engines: list, bucket_mb: float, buckets: int, repeat: int) -> list[dict]:
    numel = int(bucket_mb * 2**20 / 4) // WORLD_SIZE * WORLD_SIZE
    grads = [torch.randn(numel) for _ in range(buckets)]
    shards = [torch.empty(numel // WORLD_SIZE) for _ in range(buckets)]
    # Compute must outlast communication, or not all of it can hide: ``hideable`` reports that bound.
    dim, steps_per_bucket = 288, 4
    weights = [torch.randn(dim, dim) / dim**0.5 for _ in range(buckets * steps_per_bucket)]
    fns = {("all", "compute"): lambda: _backward_like(weights, grads, lambda b: None, steps_per_bucket)}
    for engine in engines:
        for mode, fn in _overlap_modes(engine, grads, shards, weights, steps_per_bucket).items():
            fns[(engine.kind, mode)] = fn
    samples = _interleaved_samples(fns, repeat)
    t = {key: statistics.median(v) for key, v in samples.items()}
    t_compute = t[("all", "compute")]
    rows = []
    for engine in engines:
        t_comm = t[(engine.kind, "comm")]
        for mode in ("overlapped", "synchronous"):
            rounds = zip(samples[("all", "compute")], samples[(engine.kind, "comm")], samples[(engine.kind, mode)])
            hidden = sorted((c + m - x) / m for c, m, x in rounds)
            rows.append(
                {
                    "case": f"overlap {buckets} x {bucket_mb:g} MB",
                    "provider": engine.kind,
                    "primitive": engine.primitive_for("reduce_scatter", grads[0]),
                    "mode": mode,
                    "t_compute_ms": t_compute * 1e3,
                    "t_comm_ms": t_comm * 1e3,
                    "median_ms": t[(engine.kind, mode)] * 1e3,
                    "hidden": (t_compute + t_comm - t[(engine.kind, mode)]) / t_comm,
                    "hidden_low": hidden[0],
                    "hidden_high": hidden[-1],
                    "hideable": min(1.0, t_compute / t_comm),
                }
            )
    return rows


def _measure(engines: list[str], quick: bool) -> list[dict]:
    made = [comm.make_engine(backend=kind) for kind in engines]
    sizes = [0.25, 4.0] if quick else [0.0625, 1.0, 4.0, 16.0]
    if dist.get_rank() == 0:  # the ranks' progress: rank 0 reports it
        expect(len(made) * len(PRIMITIVES) * len(sizes) + 1)
    rows = []
    for engine in made:
        rows += _bandwidth_rows(engine, sizes, 7 if quick else 20)
    if dist.get_rank() == 0:
        progress("overlap 8 x 1 MB", " and ".join(f"{e.kind} engine" for e in made))
    return rows + _overlap_rows(made, 1.0, 8, 15 if quick else 40)


def _rank(rank: int, port: int, engines: list[str], quick: bool, out_path: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=120)
    )
    try:
        rows = _measure(engines, quick)  # the engines are gone before the process group
        if rank == 0:
            with open(out_path, "wb") as f:
                pickle.dump(rows, f)
    finally:
        dist.destroy_process_group()
    end_rank()


def summary(rows: list[dict]) -> list[dict]:
    """Per reduce-scatter and all-gather size: the primitive our engines choose (the faster engine)
    against the fastest of gloo's own collectives through plain ``torch.distributed``; per engine, the
    step with the exchange overlapped, compute and exchange alone, and the share of the exchange hidden behind compute
    (of an exchange that takes 1.6 ms a share says little: the step's time says more)."""
    marked = []
    for r in rows:
        if "mode" in r or not r["case"].startswith(("reduce_scatter", "all_gather")):
            continue
        if r["chosen"] == "yes":
            marked.append({**r, "provider": f"ours: {r['provider']} engine, {r['primitive']}"})
        elif r["provider"] == "torch" and not r["primitive"].endswith("_p2p"):
            marked.append({**r, "provider": f"torch.distributed {r['primitive']}"})
    lines = best_vs_peer(marked)
    for r in rows:
        if r.get("mode") == "overlapped":
            lines.append({"case": r["case"], "ours": f"{r['provider']} engine", "note": _overlap_note(r)})
    return lines


def _overlap_note(r: dict) -> str:
    """The overlap row in words: the step's time (with compute and the exchange alone), then the share hidden."""
    note = f"step {r['median_ms']:.1f} ms"
    if "t_comm_ms" in r:
        note += f", compute alone {r['t_compute_ms']:.1f}, exchange alone {r['t_comm_ms']:.1f}"
    spread = f" ({r['hidden_low']:.0%} to {r['hidden_high']:.0%} over the rounds)" if "hidden_low" in r else ""
    return f"{note}: hidden {r['hidden']:.0%}{spread}"


def run(quick: bool = True) -> list[dict]:
    engines = _engines()
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.pkl")
        mp.spawn(_rank, args=(free_port(), engines, quick, out_path), nprocs=WORLD_SIZE, join=True)
        with open(out_path, "rb") as f:
            return pickle.load(f)
