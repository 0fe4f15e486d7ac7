"""End-to-end training step on 2 gloo ranks: our stages next to DDP, ZeroRedundancyOptimizer, FSDP2
and, when it is installed, DeepSpeed at each stage (``e2e_deepspeed``).

The model is a ~20M-parameter MLP stack; a step is forward + backward + step + zero_grad.

- Memory: each provider runs a few steps in fresh processes (so peak RSS is its own): the peak
  resident set size of each rank, and the model-state bytes per rank (``memory_report()`` for
  ours; for the others the same measurement over their parameters, gradients and optimizer state,
  FSDP2's DTensors by their local shards).
- Time: one pair of processes runs every provider in interleaved rounds (each round every provider
  in turn, the order alternating, each built afresh: warm-up steps, then the median of the timed
  ones), so that all of them see the same machine load in a round. ``step_ms`` is each rank's
  median over the rounds and ``rounds_ms`` its time in each.

``vs_peer`` is the step time of the named peer divided by ours, both the mean over ranks, taken
round by round: the median of the per-round ratios, ``low``/``high`` their spread and
``verdict`` faster or slower only when every round agrees. Our
``reduce_bucket_size`` is 2M elements (8 MB), the size of the DDP buckets (``bucket_cap_mb=8``); stage 2
also runs with the sizes of published DeepSpeed configs (``zk-stage2@5e7`` and DeepSpeed's default
``zk-stage2@5e8``), and the ``bucket`` column says which size each row ran with; stages 1 and 2 also with
``overlap_param_gather`` (``zk-stage1+overlap``, ``zk-stage2+overlap``), against the same peers.
``vs_deepspeed`` is DeepSpeed's step time at the same stage divided by ours. A provider that fails
(or whose processes die) is reported in its row (``error``), not fatal.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from . import e2e_deepspeed
from .common import (
    error_text,
    expect,
    finish_rank,
    free_port,
    join,
    progress,
    provider_rounds,
    ratio_stats,
    rounds_by_provider,
    spawn_ranks,
)

DESCRIPTION = "training step on 2 gloo ranks: zero_kernels stages 0-3 vs DDP, ZeRO-1 (torch), FSDP2, DeepSpeed"
WORLD = 2
PEERS = {
    "zk-stage0": "ddp+adamw-fused",
    "zk-stage1": "ddp+zero1-torch",
    "zk-stage2": "ddp+adamw-fused",
    "zk-stage3": "fsdp2",
}
OVERLAP = "+overlap"  # our provider with "overlap_param_gather": true (stages 1-2)
OVERLAPPED = ("zk-stage1" + OVERLAP, "zk-stage2" + OVERLAP)
# Stage 3 with ZeRO++ (the ``links`` benchmark's rows): provider suffix -> zero_optimization keys; "hpz" stands
# for the ranks per node (LOCAL_WORLD_SIZE, else this run's world: one node).
ZEROPP = {
    "+qwz": {"zero_quantized_weights": True},
    "+hpz": {"zero_hpz_partition_size": "hpz"},
    "+qwz+hpz": {"zero_quantized_weights": True, "zero_hpz_partition_size": "hpz"},
    "+zpp": {"zero_quantized_weights": True, "zero_hpz_partition_size": "hpz", "zero_quantized_gradients": True},
}
ZEROPP_PROVIDERS = tuple("zk-stage3" + suffix for suffix in ZEROPP)
_LONGEST_FIRST = sorted(ZEROPP, key=len, reverse=True)
BUCKET_ELEMENTS = 2_000_000  # ours: reduce_bucket_size (8 MB of fp32), the size of the DDP buckets below
PUBLISHED_BUCKETS = ("5e7", "5e8")  # reduce_bucket_size of a typical published DeepSpeed config; DeepSpeed's default
LR = 1e-4


def _base(provider: str) -> str:
    """The provider without its bucket size or overlap: ``zk-stage2@5e7`` -> ``zk-stage2``."""
    base = provider.split("@")[0].removesuffix(OVERLAP)
    return next((base.removesuffix(s) for s in _LONGEST_FIRST if base.endswith(s)), base)


def _zeropp(provider: str) -> dict:
    """The ZeRO++ keys of a ``zk-stage3+...`` provider (none for the others)."""
    keys = next((ZEROPP[s] for s in _LONGEST_FIRST if provider.split("@")[0].endswith(s)), {})
    hpz = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    return {k: hpz if v == "hpz" else v for k, v in keys.items()}


def _bucket(provider: str) -> str:
    """The bucket size a provider runs with, for the table (elements; DDP's ``bucket_cap_mb`` as fp32 elements)."""
    if "@" in provider:
        return provider.split("@")[1]
    return "per module" if provider == "fsdp2" else f"{BUCKET_ELEMENTS:.0e}".replace("+0", "")


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
    return nn.Sequential(*layers)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds memory here: a DTensor's (FSDP2's sharded parameters, gradients and
    optimizer state) local shard, any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _state_bytes(params: list, opt: torch.optim.Optimizer) -> dict:
    """Bytes of the distinct storages behind the parameters, gradients and optimizer state of this rank;
    storages resized to nothing (FSDP2's unsharded parameters between uses) count zero."""
    from zero_kernels.stages import storage_bytes

    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard in a local optimizer
    states = [t for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    grads = [p.grad for p in params if p.grad is not None]
    kinds = {"params": params, "grads": grads, "optimizer": states}
    return {
        k: storage_bytes([_local(t) for t in ts if _local(t).untyped_storage().nbytes()]) for k, ts in kinds.items()
    }


def _build(provider: str, model: nn.Module):
    """(module to call, optimizer, memory report function)."""
    if provider.startswith("zk-stage"):
        from zero_kernels.optim import ShardedFusedAdam

        size = int(float(_bucket(provider)))
        stage, overlap = int(_base(provider)[-1]), provider.endswith(OVERLAP)
        opt = ShardedFusedAdam(
            model, lr=1e-4, stage=stage, reduce_bucket_size=size, overlap_param_gather=overlap, **_zeropp(provider)
        )
        return model, opt, opt.memory_report
    if provider == "ddp+adamw-fused":
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=8, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, fused=True)
        return ddp, opt, lambda: _state_bytes(list(model.parameters()), opt)
    if provider == "ddp+zero1-torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=8, gradient_as_bucket_view=True)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
        return ddp, opt, lambda: _state_bytes(list(model.parameters()), opt)
    if provider != "fsdp2":
        known = "zk-stage0..3 (with their suffixes), ddp+adamw-fused, ddp+zero1-torch, fsdp2"
        raise ValueError(f"e2e: unknown provider {provider!r}; known: {known}")
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, lambda: _state_bytes(list(model.parameters()), opt)


def _train_step(provider: str, model: nn.Module, x: torch.Tensor):
    """(one training step: forward, backward, step and gradients cleared; memory report function)."""
    if provider.startswith(e2e_deepspeed.PREFIX):
        return e2e_deepspeed.build(provider, model, x, lr=LR, bucket_elements=BUCKET_ELEMENTS)
    module, opt, report = _build(provider, model)

    def step() -> None:
        module(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    return step, report


def _step_ms(provider: str, width: int, depth: int, steps: int) -> tuple[float, Callable[[], dict]]:
    """A fresh model under ``provider``: the median time of ``steps`` steps after 2 warm-up steps (ms), its report."""
    model = _model(width, depth)
    step, report = _train_step(provider, model, torch.randn(8, width))
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[2:]), report


def _memory_rank(rank: int, provider: str, port: int, width: int, depth: int, out: str) -> None:
    """One provider in fresh processes: its memory after a few steps."""
    join(rank, WORLD, port, timeout_s=300)
    try:
        row = {"mem": _step_ms(provider, width, depth, 1)[1]()}
    except Exception as err:  # a provider that does not run here is reported, not fatal
        row = {"error": error_text(err)}
    row["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    finish_rank(out, rank, row)


def _timing_rank(rank: int, providers: list[str], rounds: int, port: int, width: int, depth: int, steps: int,
                 out: str) -> None:  # fmt: skip
    """Every provider in interleaved rounds in these processes: provider -> its step time per round (or error)."""
    join(rank, WORLD, port, timeout_s=300)
    times = provider_rounds(rank, providers, rounds, lambda provider: _step_ms(provider, width, depth, steps)[0])
    finish_rank(out, rank, times)


def _ratio(rows_rounds: dict[str, list[float]], peer: str, ours: str) -> dict:
    return ratio_stats(rows_rounds[peer], rows_rounds[ours]) if peer in rows_rounds and ours in rows_rounds else {}


def _with_peer_ratios(rows: list[dict]) -> list[dict]:
    """Add ``peer``, ``vs_peer`` (the peer's step time over ours), ``low``/``high`` and ``verdict`` to our rows."""
    rounds = rounds_by_provider(rows)
    for r in rows:
        peer = PEERS.get(_base(r["provider"]))
        stats = _ratio(rounds, peer, r["provider"])
        if stats:
            r.update(
                peer=peer, vs_peer=stats["speedup"], low=stats["low"], high=stats["high"], verdict=stats["verdict"]
            )
    return rows


def _deepspeed_ratios(rows: list[dict]) -> list[dict]:
    """Add ``vs_deepspeed`` (DeepSpeed's step time at the same stage over ours, median over rounds) to our rows."""
    rounds = rounds_by_provider(rows)
    for r in rows:
        ds = e2e_deepspeed.PREFIX + _base(r["provider"])[-1]
        same_bucket = "@" not in r["provider"]  # DeepSpeed runs with BUCKET_ELEMENTS
        stats = _ratio(rounds, ds, r["provider"])
        if r["provider"].startswith("zk-stage") and same_bucket and stats:
            r["vs_deepspeed"] = stats["speedup"]
            r["vs_deepspeed_verdict"] = stats["verdict"]
    return rows


def _mean_step_ms(rows: list[dict]) -> dict[str, float]:
    """provider -> its step time, the median over the rounds of the mean over the ranks."""
    return {p: statistics.median(ts) for p, ts in rounds_by_provider(rows).items()}


def summary(rows: list[dict]) -> list[dict]:
    """Per stage: ours against the fastest of its peers (the named peer and DeepSpeed at that stage), with the
    spread of the ratio over the rounds and a verdict."""
    rounds = rounds_by_provider(rows)
    mean = _mean_step_ms(rows)
    out = []
    for ours in (*PEERS, *OVERLAPPED):
        stage, peer = _base(ours)[-1], PEERS[_base(ours)]
        line = {"case": f"stage {stage}, {rows[0]['case']}" if rows else f"stage {stage}", "ours": ours}
        peers = {p: mean[p] for p in (peer, e2e_deepspeed.PREFIX + stage) if p in mean}
        if ours in mean:
            line["ours_ms"] = mean[ours]
        if peers:
            best = min(peers, key=peers.get)
            line.update(best_peer=best, peer_ms=peers[best])
        if ours in mean and peers:
            line["speedup"] = line["peer_ms"] / mean[ours]
            line.update(_ratio(rounds, line["best_peer"], ours))
        out.append(line)
    return out


def _memory(provider: str, width: int, depth: int, out: str) -> list[dict]:
    """The memory rows of one provider, one per rank."""
    rows = []
    for row in spawn_ranks(_memory_rank, (provider, free_port(), width, depth), out, WORLD):
        mem = row.pop("mem", {})
        rows.append({**row, **{f"{k}_MiB": v / 2**20 for k, v in mem.items()}})
    return rows


def _timing(providers: list[str], rounds: int, width: int, depth: int, steps: int, out: str) -> list[dict]:
    """Per rank: provider -> its step time per round (ms) or an error message."""
    found = spawn_ranks(_timing_rank, (providers, rounds, free_port(), width, depth, steps), out, WORLD)
    return [got if "error" not in got else {p: [got["error"]] for p in providers} for got in found]


def _row(memory: dict, times: list) -> dict:
    """One rank's row of a provider: its memory, and its median step and every round's (or the first error)."""
    errors = [t for t in times if isinstance(t, str)]
    if "error" in memory or errors:
        return {**memory, "error": memory.get("error") or errors[0]}
    return {**memory, "step_ms": statistics.median(times), "rounds_ms": [round(t, 3) for t in times]}


def run(quick: bool) -> list[dict]:
    width, depth, steps = (512, 10, 4) if quick else (768, 6, 10)
    rounds = 3 if quick else 5
    providers = ["zk-stage0", "zk-stage1", "zk-stage2", "zk-stage3", "ddp+adamw-fused", "ddp+zero1-torch", "fsdp2"]
    providers += [f"zk-stage2@{size}" for size in PUBLISHED_BUCKETS] + list(OVERLAPPED)
    missing = e2e_deepspeed.unavailable()
    if missing:
        print(f"e2e: {missing}", file=sys.stderr)
    else:
        providers += [f"{e2e_deepspeed.PREFIX}{stage}" for stage in range(4)]
    case = f"{sum(p.numel() for p in _model(width, depth).parameters()) / 1e6:.1f}M params"
    expect(len(providers) * (rounds + 1))
    with tempfile.TemporaryDirectory() as tmp:
        memory = {}
        for provider in providers:
            progress(case, f"{provider}: memory, in fresh processes")
            memory[provider] = _memory(provider, width, depth, os.path.join(tmp, provider))
        timing = _timing(providers, rounds, width, depth, steps, os.path.join(tmp, "timing"))
    rows = []
    for provider in providers:
        note = {"note": e2e_deepspeed.NOTE} if provider.startswith(e2e_deepspeed.PREFIX) else {}
        for rank in range(WORLD):
            row = _row(memory[provider][rank], timing[rank].get(provider, ["not timed"]))
            rows.append({"case": case, "provider": provider, "bucket": _bucket(provider), "rank": rank, **note, **row})
    return _deepspeed_ratios(_with_peer_ratios(rows))
