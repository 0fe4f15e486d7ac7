"""Flatten and unflatten a bucket of about 200 transformer-shaped tensors: ours against torch.

Cases: ``flatten fp32`` (fp32 tensors into an fp32 flat buffer), ``flatten bf16->fp32 x s`` (bf16
gradients into an fp32 buffer, scaled: the cast and the scale are fused in ours, separate passes
in the peers) and ``unflatten fp32`` (back into the existing tensors). ``flatten fp32 aligned``
places our tensors at offsets rounded up to 16 elements, as a bucket planner may, which lets the
Triton kernel use vector loads and stores for tensors whose sizes are multiples of 16.

GB/s counts the bytes that must move: every element read once and written once in its own dtype;
``of_copy_bw`` divides it by the copy bandwidth measured in the same run, and ``vs_best_peer`` is
the best torch time divided by this one.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from zero_kernels.kernels import flatten, unflatten

from .adam import TIME_BUDGET_S, _sizes, median_seconds, our_backends, transformer_shapes
from .common import copy_bandwidth, expect, progress

DESCRIPTION = "flatten/unflatten of ~200 tensors: ours (one launch) vs torch.cat / _flatten_dense_tensors / foreach"

SCALE = 0.125
CASES = {  # name -> (tensor dtype, flat dtype, scale, direction, our offsets' alignment in elements)
    "flatten fp32": (torch.float32, torch.float32, None, "flatten", 1),
    "flatten fp32 aligned": (torch.float32, torch.float32, None, "flatten", 16),
    "flatten bf16->fp32 x s": (torch.bfloat16, torch.float32, SCALE, "flatten", 1),
    "unflatten fp32": (torch.float32, torch.float32, None, "unflatten", 1),
}


def _peers(direction: str, tensors, flat, scale) -> dict[str, Callable[[], object]]:
    if direction == "unflatten":
        views = _unflatten_dense_tensors(flat, tensors)
        return {
            "torch._foreach_copy_": lambda: torch._foreach_copy_(tensors, views),
            "copy_ loop": lambda: [t.copy_(v) for t, v in zip(tensors, views)],
        }
    flat_views = [t.view(-1) for t in tensors]

    def cat() -> None:
        torch.cat(flat_views, out=flat)
        if scale is not None:
            flat.mul_(scale)

    def flatten_dense() -> torch.Tensor:
        result = _flatten_dense_tensors(tensors).to(flat.dtype)
        return result if scale is None else result.mul_(scale)

    return {"torch.cat(out=)": cat, "_flatten_dense_tensors": flatten_dense}


def _case_rows(case: str, n: int, device: torch.device, copy_gbs: float, repeat: int) -> list[dict]:
    dtype, flat_dtype, scale, direction, align = CASES[case]
    tensors = [torch.randn(s, device=device).to(dtype) for s in transformer_shapes(n)]
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.numel() // align) * align
    flat = torch.randn(end, device=device).to(flat_dtype)
    moved = n * (dtype.itemsize + flat_dtype.itemsize)
    fns: dict[str, Optional[Callable[[], object]]] = {}
    notes: dict[str, str] = {}
    for impl, why in our_backends(device).items():
        if why is not None:
            notes[f"ours:{impl}"] = f"unavailable: {why}"
        elif direction == "flatten":
            fns[f"ours:{impl}"] = lambda impl=impl: flatten(tensors, flat, offsets, scale=scale, impl=impl)
        else:
            fns[f"ours:{impl}"] = lambda impl=impl: unflatten(flat, tensors, offsets, scale=scale, impl=impl)
    peers = _peers(direction, tensors, flat[:n], scale)  # torch packs the tensors: no gaps
    fns.update(peers)
    rows = []
    for provider in [*notes, *fns]:
        row = {"case": case, "tensors": len(tensors), "n": n, "provider": provider}
        progress(f"{case} n={n}", provider)
        if provider in notes:
            rows.append({**row, "note": notes[provider]})
            continue
        seconds, used = median_seconds(fns[provider], repeat, device, budget_s=TIME_BUDGET_S)
        gbs = moved / seconds / 1e9
        rows.append({**row, "median_ms": seconds * 1e3, "runs": used, "GB/s": gbs, "of_copy_bw": gbs / copy_gbs})
    best_peer = min(r["median_ms"] for r in rows if r["provider"] in peers)
    for r in rows:
        if "median_ms" in r:
            r["vs_best_peer"] = best_peer / r["median_ms"]
    return rows


def run(quick: bool) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = _sizes(quick, device)  # those of the Adam benchmark
    repeat = 50 if device.type == "cuda" else (5 if quick else 15)
    copy_gbs = copy_bandwidth(2 * sizes[-1], str(device))  # the footprint of the largest case
    rows = []
    expect(len(sizes) * len(CASES) * (len(our_backends(device)) + 2))  # two torch peers per case
    for n in sizes:
        for case in CASES:
            rows += _case_rows(case, n, device, copy_gbs, repeat)
    for r in rows:
        r["copy_GB/s"] = copy_gbs
    return rows
