"""Adam step with fp32 state: our flat-shard kernels against torch.optim.AdamW (foreach and fused).

Two cases per size, on the same total number of parameters: ``flat`` (one tensor) and ``list``
(about 200 tensors shaped like a transformer's). Ours always runs the whole shard as one flat
buffer: that is what the optimizer hands it. GB/s counts the 28 bytes per parameter that must
move (read param, grad, m, v; write param, m, v).

Every provider of a case is timed in the same interleaved rounds (``common.interleaved_rounds``):
``median_ms`` is the median over the rounds, ``rounds_ms`` each round's; ``vs_best_peer`` is the
median over the rounds of the best torch.optim time divided by ours (above 1: faster than every
peer), ``low``/``high`` its spread over the rounds, and ``verdict`` says faster or slower only when
every round agrees. The roofs are timed in the same rounds, on the case's footprint: an in-place
``add_`` (``inplace_GB/s``, the roof here: three of Adam's four streams are updated in place) and a
``copy_`` (``copy_GB/s``, for reference: on CPUs a copy also reads the destination's lines before
writing them, so it is lower); each is the best of its rounds, so that a kernel is compared with
what the machine gave under the same load. ``of_inplace_bw`` is GB/s over that roof; a kernel above
its roof is marked in ``note`` (the roof is torch's own streaming op, not the hardware's peak).

``epilogue (IMPL)`` (ZeRO++'s int8 weights), for our fused backend (C++ on CPU, Triton on CUDA): our
Adam on bf16 parameters (``out=``, as the stages run it) with the quantizing epilogue (``quantized=``: the
int8 blocks of what it wrote, in ``Payload``'s layout) against the same step plain and followed by a
separate quantize pass (what the epilogue replaces), in the same interleaved rounds; ``vs_plain`` is the
median over the rounds of the row's time over the plain step's (goal for the epilogue: at most 1.1), with
its spread.
"""

from __future__ import annotations

import statistics
from typing import Callable, Optional

import torch

from zero_kernels.kernels import adam_step, quantize, resolve_impl
from zero_kernels.stages.quantized_gather import Payload

from .common import copy_roof, expect, inplace_roof, interleaved_rounds, progress, ratio_stats

DESCRIPTION = "Adam step, fp32 state: ours (one flat shard) vs torch.optim.AdamW foreach/fused"

BYTES_PER_PARAM = 28
TIME_BUDGET_S = 1.5  # per provider and case over all rounds: slow providers get fewer calls (one per round)
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


def timed_rows(
    label: str,
    fns: dict[str, Callable[[], object]],
    roofs: dict[str, tuple[Callable[[], object], int]],
    device: torch.device,
    rounds: int,
) -> tuple[dict[str, list[float]], dict[str, int], dict[str, float]]:
    """Time ``fns`` and the ``roofs`` (name -> (function, bytes moved)) in the same interleaved rounds.

    Returns (seconds per round by provider, calls per round by provider, roof GB/s by name: the best round).
    """
    timed = {**fns, **{("roof", k): fn for k, (fn, _) in roofs.items()}}
    seconds, calls = interleaved_rounds(
        timed, rounds, budget_s=TIME_BUDGET_S, device=str(device), on_round=lambda r: progress(label, f"round {r + 1}")
    )
    roof_gbs = {k: max(moved / t / 1e9 for t in seconds[("roof", k)]) for k, (_, moved) in roofs.items()}
    return {k: v for k, v in seconds.items() if k in fns}, calls, roof_gbs


def provider_row(row: dict, seconds: list[float], calls: int, moved: int) -> dict:
    """A timed row: median and per-round times, calls, GB/s (``moved`` bytes per call)."""
    median = statistics.median(seconds)
    return {**row, "median_ms": median * 1e3, "rounds_ms": [round(t * 1e3, 4) for t in seconds],
            "runs": calls * len(seconds), "GB/s": moved / median / 1e9}  # fmt: skip


def add_peer_ratios(rows: list[dict], peers: list[str], roof_column: str, share_column: str) -> None:
    """``vs_best_peer`` with its spread and verdict on our rows; the share of the roof on every timed row."""
    timed = [r for r in rows if "median_ms" in r]
    peer_rows = [r for r in timed if r["provider"] in peers]
    best = min(peer_rows, key=lambda r: r["median_ms"]) if peer_rows else None
    for r in timed:
        r[share_column] = r["GB/s"] / r[roof_column]
        if r[share_column] > 1:
            r["note"] = f"above the measured roof ({roof_column}: torch's streaming op under the same load)"
        if best is not None and r["provider"] not in peers:
            stats = ratio_stats(best["rounds_ms"], r["rounds_ms"])
            r.update(vs_best_peer=stats["speedup"], low=stats["low"], high=stats["high"], verdict=stats["verdict"])


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


def _rows_for(case: str, n: int, device: torch.device, rounds: int) -> list[dict]:
    shapes = [(n,)] if case == "flat" else transformer_shapes(n)
    peers = {"torch.AdamW foreach": dict(foreach=True), "torch.AdamW fused": dict(fused=True)}
    rows, fns = [], {}
    candidates = {f"ours:{impl}": why for impl, why in our_backends(device).items()}
    candidates.update({name: None for name in peers})
    for provider, why in candidates.items():
        row = {"case": case, "tensors": len(shapes), "n": n, "provider": provider}
        try:
            if why is None:
                fns[provider] = (
                    _torch(shapes, device, **peers[provider]) if provider in peers else _ours(n, device, provider[5:])
                )
                fns[provider]()  # a fused path this torch build lacks fails here
        except RuntimeError as exc:
            why = str(exc).splitlines()[0]
            fns.pop(provider, None)
        rows.append(row if why is None else {**row, "note": f"unavailable: {why}"})
    roofs = {"inplace": inplace_roof(4 * n, str(device)), "copy": copy_roof(2 * n, str(device))}
    seconds, calls, roof_gbs = timed_rows(f"{case} n={n}", fns, roofs, device, rounds)
    out = []
    for row in rows:
        if row["provider"] in seconds:
            row = provider_row(row, seconds[row["provider"]], calls[row["provider"]], BYTES_PER_PARAM * n)
        out.append({**row, "inplace_GB/s": roof_gbs["inplace"], "copy_GB/s": roof_gbs["copy"]})
    add_peer_ratios(out, list(peers), "inplace_GB/s", "of_inplace_bw")
    return out


EPILOGUE, PLAIN, THEN_QUANTIZE = "ours: adam + epilogue", "adam, plain", "adam, then quantize"
# Adam's 24 bytes with a bf16 gradient and 2 for out; the epilogue writes 1 more (the int8 blocks), a separate
# pass reads out again and writes them (3 more)
EPILOGUE_BYTES = {EPILOGUE: 27, PLAIN: 26, THEN_QUANTIZE: 29}


def _epilogue_fns(n: int, device: torch.device, impl: str) -> dict[str, Callable[[], None]]:
    """Adam on bf16 parameters: plain, with the epilogue, and followed by a quantize pass."""
    param, grad = torch.randn(n, device=device), torch.randn(n, device=device).to(torch.bfloat16)
    exp_avg, exp_avg_sq, out = torch.zeros_like(param), torch.zeros_like(param), param.to(torch.bfloat16)
    layout = Payload(n)
    blocks = layout.view(layout.empty(device))

    def step(**kw) -> None:
        adam_step(param, grad, exp_avg, exp_avg_sq, step=1, out=out, impl=impl, **HYPER, **kw)

    def then_quantize() -> None:
        step()
        quantize(out, 8, layout.block, out=blocks, impl=impl)

    return {EPILOGUE: lambda: step(quantized=blocks), PLAIN: step, THEN_QUANTIZE: then_quantize}


def _epilogue_rows(n: int, device: torch.device, impl: str, rounds: int) -> list[dict]:
    """The epilogue of backend ``impl``: one case of three providers, the epilogue ours, the two others peers."""
    base = {"case": f"epilogue ({impl})", "tensors": 1, "n": n, "param_dtype": "bfloat16"}
    seconds, calls, _ = timed_rows(f"epilogue {impl} n={n}", _epilogue_fns(n, device, impl), {}, device, rounds)
    rows = []
    for provider, times in seconds.items():
        row = provider_row({**base, "provider": provider}, times, calls[provider], EPILOGUE_BYTES[provider] * n)
        if provider != PLAIN:
            stats = ratio_stats(times, seconds[PLAIN])  # this row's time over the plain step's, round by round
            row.update(vs_plain=stats["speedup"], low=stats["low"], high=stats["high"], goal=1.1)
        rows.append(row)
    return rows


def run(quick: bool) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = _sizes(quick, device)
    rounds = 5 if quick else 9
    # the epilogue of our fused backends that run here (the reference is its definition, and slow)
    fused = [impl for impl, why in our_backends(device).items() if impl != "torch" and why is None]
    rows = []
    expect(len(sizes) * 2 * rounds + len(fused) * rounds)
    for n in sizes:
        for case in ("flat", "list"):
            rows += _rows_for(case, n, device, rounds)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for impl in fused:
        rows += _epilogue_rows(sizes[-1], device, impl, rounds)
    return rows
