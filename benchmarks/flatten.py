"""Flatten and unflatten a bucket of about 200 transformer-shaped tensors: ours against torch.

Cases: ``flatten fp32`` (fp32 tensors into an fp32 flat buffer), ``flatten bf16->fp32 x s`` (bf16
gradients into an fp32 buffer, scaled: the cast and the scale are fused in ours, separate passes
in the peers) and ``unflatten fp32`` (back into the existing tensors). ``flatten fp32 aligned``
places our tensors at offsets rounded up to 16 elements, as a bucket planner may, which lets the
Triton kernel use vector loads and stores for tensors whose sizes are multiples of 16.

GB/s counts the bytes that must move: every element read once and written once in its own dtype.
As in the Adam subject, every provider of a case and the roof are timed in the same interleaved
rounds: ``vs_best_peer`` is the median over the rounds of the best torch time divided by ours, with
its spread (``low``/``high``) and a ``verdict`` only when every round agrees; the roof,
``copy_GB/s``, is the best round of an fp32 ``copy_`` moving as many bytes as the case, and
``of_copy_bw`` is GB/s over it (a kernel above it is marked in ``note``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from zero_kernels.kernels import flatten, unflatten

from .adam import _sizes, add_peer_ratios, our_backends, provider_row, timed_rows, transformer_shapes
from .common import copy_roof, expect

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


def _case_rows(case: str, n: int, device: torch.device, rounds: int) -> list[dict]:
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
    roof = {"copy": copy_roof(moved // 8, str(device))}  # a copy moving as many bytes (8 per fp32 element)
    seconds, calls, roof_gbs = timed_rows(f"{case} n={n}", fns, roof, device, rounds)
    rows = []
    for provider in [*notes, *fns]:
        row = {"case": case, "tensors": len(tensors), "n": n, "provider": provider, "copy_GB/s": roof_gbs["copy"]}
        if provider in notes:
            rows.append({**row, "note": notes[provider]})
        else:
            rows.append(provider_row(row, seconds[provider], calls[provider], moved))
    add_peer_ratios(rows, list(peers), "copy_GB/s", "of_copy_bw")
    return rows


def run(quick: bool) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = _sizes(quick, device)  # those of the Adam benchmark
    rounds = 5 if quick else 9
    rows = []
    expect(len(sizes) * len(CASES) * rounds)
    for n in sizes:
        for case in CASES:
            rows += _case_rows(case, n, device, rounds)
    return rows
