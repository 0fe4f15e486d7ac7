"""Adam step with fp32 state: our flat-shard kernels against torch.optim.AdamW (foreach and fused).

Two cases per size, on the same total number of parameters: ``flat`` (one tensor) and ``list``
(about 200 tensors shaped like a transformer's). Ours always runs the whole shard as one flat
buffer: that is what the optimizer hands it. GB/s counts the 28 bytes per parameter that must
move (read param, grad, m, v; write param, m, v). Three of the four streams are updated in place, so
the roof is the in-place read+write bandwidth measured in the same run (``inplace_bandwidth``):
``of_inplace_bw`` is GB/s divided by it (the copy bandwidth, ``copy_GB/s``, is shown too, for
reference: on CPUs a copy also reads the destination's lines before writing them, so it is lower).
``vs_best_peer`` is the best torch.optim time divided by this one (above 1: faster than every peer).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from zero_kernels.kernels import adam_step, resolve_impl

from .common import copy_bandwidth, expect, inplace_bandwidth, progress, synchronize, timeit

DESCRIPTION = "Adam step, fp32 state: ours (one flat shard) vs torch.optim.AdamW foreach/fused"

BYTES_PER_PARAM = 28
TIME_BUDGET_S = 1.5  # per provider and case: slow providers get fewer runs (at least 3)
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def transformer_shapes(total: int, layers: int = 16) -> list[tuple[int, ...]]:
    """About 12 tensors per layer (attention, MLP, norms) plus an embedding that takes the rest,
    summing to exactly ``total`` elements."""
    hidden = max(8, int((total / (12 * layers)) ** 0.5))
    while hidden > 8 and layers * (12 * hidden * hidden + 13 * hidden) >= total:
        hidden -= 8
    layer = [
        (3 * hidden, hidden),
        (3 * hidden,),
        (hidden, hidden),
        (hidden,),
        (hidden,),
        (hidden,),
        (4 * hidden, hidden),
        (4 * hidden,),
        (hidden, 4 * hidden),
        (hidden,),
        (hidden,),
        (hidden,),
    ]
    shapes = layer * layers
    rest = total - sum(torch.Size(s).numel() for s in shapes)
    embedding = [(rest // hidden, hidden)] + ([(rest % hidden,)] if rest % hidden else [])
    return embedding + shapes


def our_backends(device: torch.device) -> dict[str, Optional[str]]:
    """Our backends worth timing on ``device``: impl -> None when usable, else why not."""
    impls = ["triton", "torch"] if device.type == "cuda" else ["cpu", "torch"]
    found: dict[str, Optional[str]] = {}
    for impl in impls:
        try:
            resolve_impl(impl, device)
            found[impl] = None
        except (RuntimeError, ValueError) as exc:  # ExtensionUnavailable is a RuntimeError
            found[impl] = str(exc).splitlines()[0]
    return found


def median_seconds(fn: Callable[[], object], repeat: int, device: torch.device, budget_s: float) -> tuple[float, int]:
    """(median seconds, repeats used): a first call (compilation, allocation), a second to size the
    run, then ``repeat`` timed calls, fewer (at least 3) when that would take longer than ``budget_s``."""
    fn()
    synchronize(str(device))
    start = time.perf_counter()
    fn()
    synchronize(str(device))
    one = time.perf_counter() - start
    repeat = max(3, min(repeat, int(budget_s / max(one, 1e-9))))
    return timeit(fn, warmup=max(1, repeat // 5), repeat=repeat, device=str(device)), repeat


def _ours(n: int, device: torch.device, impl: str) -> Callable[[], None]:
    param, grad = torch.randn(n, device=device), torch.randn(n, device=device)
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    step = [0]

    def run() -> None:
        step[0] += 1
        adam_step(param, grad, exp_avg, exp_avg_sq, step=step[0], impl=impl, **HYPER)

    return run


def _torch(shapes: list[tuple[int, ...]], device: torch.device, **flags) -> Callable[[], None]:
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(
        params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"], **flags,
    )  # fmt: skip
    return opt.step


def _sizes(quick: bool, device: torch.device) -> list[int]:
    if device.type == "cuda":
        return [1 << 24] if quick else [1 << 20, 1 << 22, 1 << 24, 1 << 26]
    return [1 << 23] if quick else [1 << 20, 1 << 22, 1 << 24]


def _rows_for(case: str, n: int, device: torch.device, roof_gbs: float, repeat: int) -> list[dict]:
    shapes = [(n,)] if case == "flat" else transformer_shapes(n)
    rows = []
    peers = {"torch.AdamW foreach": dict(foreach=True), "torch.AdamW fused": dict(fused=True)}
    candidates = {f"ours:{impl}": why for impl, why in our_backends(device).items()}
    candidates.update({name: None for name in peers})
    for provider, why in candidates.items():
        row = {"case": case, "tensors": len(shapes), "n": n, "provider": provider}
        progress(f"{case} n={n}", provider)
        if why is not None:
            rows.append({**row, "note": f"unavailable: {why}"})
            continue
        try:
            fn = _torch(shapes, device, **peers[provider]) if provider in peers else _ours(n, device, provider[5:])
            seconds, used = median_seconds(fn, repeat, device, budget_s=TIME_BUDGET_S)
        except RuntimeError as exc:  # e.g. a fused path this torch build lacks
            rows.append({**row, "note": f"unavailable: {str(exc).splitlines()[0]}"})
            continue
        gbs = BYTES_PER_PARAM * n / seconds / 1e9
        rows.append({**row, "median_ms": seconds * 1e3, "runs": used, "GB/s": gbs, "of_inplace_bw": gbs / roof_gbs})
        del fn
    timed_peers = [r["median_ms"] for r in rows if r["provider"] in peers and "median_ms" in r]
    for r in rows:
        if timed_peers and "median_ms" in r:
            r["vs_best_peer"] = min(timed_peers) / r["median_ms"]
    return rows


def run(quick: bool) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = _sizes(quick, device)
    repeat = 50 if device.type == "cuda" else (5 if quick else 15)
    inplace_gbs = inplace_bandwidth(4 * sizes[-1], str(device))  # the footprint of the largest case
    copy_gbs = copy_bandwidth(2 * sizes[-1], str(device))
    rows = []
    expect(len(sizes) * 2 * (len(our_backends(device)) + 2))
    for n in sizes:
        for case in ("flat", "list"):
            rows += _rows_for(case, n, device, inplace_gbs, repeat)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for r in rows:
        r["inplace_GB/s"] = inplace_gbs
        r["copy_GB/s"] = copy_gbs
    return rows
