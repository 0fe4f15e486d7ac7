"""GPU timings of the kernels as the optimizer uses them, with CUDA events.

``python benchmarks/gpu_timing.py [--json DIR]`` on a CUDA device:

* ``adam, unaligned model``: a model whose parameter sizes are not multiples of 16 (odd vocab and
  widths), laid out by ``layout.BufferLayout`` as a pipeline lays it out (padded: every bucket's
  length a multiple of 16 and 64-byte aligned), one ``adam_step`` per bucket; against the same
  buckets without their padding (what the layout gave before: the kernel's scalar variant) and
  ``torch.optim.AdamW(fused=True)`` on the parameters themselves.
* ``flatten as stage 2 calls it``: each gradient copied, scaled by 1/world, into its bucket with one
  launch per parameter piece, against ``torch.mul(..., out=)`` per piece (one kernel each too).
* ``tuning sweep``: Adam and flatten GB/s at 2^26 elements under each (block, num_warps) choice.
* ``quant``: block quantize and dequantize (int8 and int4, bf16 and fp32) at 2^26 elements, GB/s of the
  bytes each reads and writes, as a fraction of the device's copy bandwidth (goal: at least 0.8).
* ``epilogue``: Adam with the quantizing epilogue (``adam_step(..., quantized=)``, ZeRO++'s int8 weights in
  ``Payload``'s layout) against the same step plain (goal: at most 1.1x its time) and against the plain step
  followed by a quantize pass, at 2^26 elements, bf16 parameters (``out=``) and fp32.

Times are medians of CUDA-event intervals (``benchmarks.common.timeit``). ``--json DIR`` writes
``gpu_timing.json`` after every section (each guarded). Exit status 2 without CUDA (every section
written as skipped).
``--cpu-smoke`` runs the same code on the CPU (Triton interpreter, tiny sizes): a check of the script.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

from benchmarks.adam import transformer_shapes  # noqa: E402
from benchmarks.common import copy_bandwidth, timeit  # noqa: E402
from benchmarks.gpu_report import Report  # noqa: E402
from zero_kernels.layout import BufferLayout  # noqa: E402

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
BIG = 1 << 26
REPEAT = 30
BUCKET = 1 << 24  # elements per bucket, as a large reduce_bucket_size
DEVICE = "cuda"
MODEL = dict(layers=12, width=1537, vocab=50257)  # about 420M parameters


def unaligned_shapes(layers: int, width: int, vocab: int) -> list[tuple[int, ...]]:
    """A GPT-like model with odd sizes: no parameter count is a multiple of 16."""
    shapes: list[tuple[int, ...]] = [(vocab, width), (1023, width)]
    for _ in range(layers):
        shapes += [(3 * width, width), (3 * width,), (width, width), (width,), (width,), (width,)]
        shapes += [(4 * width, width), (4 * width,), (width, 4 * width), (width,), (width,), (width,)]
    return shapes


def _ms(fn: Callable[[], object]) -> float:
    return 1e3 * timeit(fn, warmup=min(3, REPEAT), repeat=REPEAT, device=DEVICE)


def time_unaligned_adam() -> list[dict]:
    """Adam per bucket of the padded layout, the same without padding, and torch's fused AdamW."""
    from zero_kernels.kernels import adam_step

    shapes = unaligned_shapes(**MODEL)
    params = [torch.empty(s, device="meta") for s in shapes]
    layout = BufferLayout.build(params, bucket_numel=BUCKET, num_shards=1)
    n = layout.numel
    state = [torch.randn(n, device=DEVICE) * 0.01 for _ in range(4)]  # param, grad, m, v
    state[3].abs_()
    used = sum(p.numel() for p in params)
    cut = [(b.start, min(b.numel, used - b.start)) for b in layout.buckets]  # buckets without padding
    step = [0]

    def ours(spans: list[tuple[int, int]]) -> Callable[[], None]:
        def run() -> None:
            step[0] += 1
            for start, numel in spans:
                adam_step(*(t.narrow(0, start, numel) for t in state), step=step[0], impl="triton", **HYPER)

        return run

    torch_params = [torch.nn.Parameter(torch.randn(s, device=DEVICE) * 0.01) for s in shapes]
    for p in torch_params:
        p.grad = torch.randn_like(p)
    fused = torch.optim.AdamW(torch_params, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], fused=True)
    aligned = all(b.numel % 16 == 0 and (b.start * 4) % 64 == 0 for b in layout.buckets)
    rows = [
        {"case": "adam, unaligned model", "provider": "ours, padded layout", "aligned": aligned,
         "ms": _ms(ours([(b.start, b.numel) for b in layout.buckets]))},
        {"case": "adam, unaligned model", "provider": "ours, unpadded buckets", "aligned": False, "ms": _ms(ours(cut))},
        {"case": "adam, unaligned model", "provider": "torch.AdamW fused", "ms": _ms(fused.step)},
    ]  # fmt: skip
    for r in rows:
        r.update(params=used, buckets=len(layout.buckets), GBps=28 * used / (r["ms"] * 1e-3) / 1e9)
        r["fused_vs_this"] = rows[2]["ms"] / r["ms"] if "ms" in rows[2] else None
    return rows


def time_stage2_flatten() -> list[dict]:
    """One flatten launch per gradient piece into its bucket, scaled, as stage 2's backward does."""
    from zero_kernels.kernels import flatten, triton_flatten

    shapes = unaligned_shapes(**{**MODEL, "layers": max(1, MODEL["layers"] // 3)})
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        grads = [torch.randn(s, device=DEVICE).to(dtype) for s in shapes]
        layout = BufferLayout.build(grads, bucket_numel=BUCKET, num_shards=8)
        bucket = torch.empty(max(b.numel for b in layout.buckets), dtype=dtype, device=DEVICE)
        pieces = []
        for i, slot in enumerate(layout.slots):
            flat = grads[slot.param].view(-1)
            for k in layout.slot_buckets[i]:
                b = layout.buckets[k]
                lo, hi = max(slot.offset, b.start), min(slot.offset + slot.numel, b.start + b.numel)
                pieces.append((flat.narrow(0, lo - slot.offset, hi - lo), lo - b.start))
        scale = 1.0 / 8

        def ours() -> None:
            for piece, at in pieces:
                flatten([piece], bucket, [at], scale=scale, impl="triton")

        def peer() -> None:
            for piece, at in pieces:
                torch.mul(piece, scale, out=bucket.narrow(0, at, piece.numel()))

        triton_flatten.cache_clear()
        ours()
        built = triton_flatten.cache_info()["misses"]
        moved = 2 * sum(p.numel() for p, _ in pieces) * grads[0].element_size()
        for provider, fn in (("ours (flatten per piece)", ours), ("torch.mul(out=) per piece", peer)):
            ms = _ms(fn)
            rows.append({"case": f"stage-2 flatten {str(dtype)[6:]}", "provider": provider, "pieces": len(pieces),
                         "ms": ms, "GBps": moved / (ms * 1e-3) / 1e9})  # fmt: skip
        rows[-2]["tables_built"] = built
        rows[-2]["tables_built_in_timed_runs"] = triton_flatten.cache_info()["misses"] - built
        rows[-2]["peer_vs_this"] = rows[-1]["ms"] / rows[-2]["ms"]
    return rows


def time_epilogue() -> list[dict]:
    """Adam + the int8 epilogue against plain Adam and against Adam then a quantize pass, at 2^26 elements."""
    return [_epilogue_row(dtype) for dtype in (torch.bfloat16, torch.float32)]


def _epilogue_row(dtype: torch.dtype) -> dict:
    from zero_kernels.kernels import adam_step, quantize
    from zero_kernels.stages.quantized_gather import Payload

    layout = Payload(BIG)
    state = [torch.randn(BIG, device=DEVICE) * 0.01 for _ in range(4)]  # param, grad, m, v
    state[3].abs_()
    out = state[0].to(dtype) if dtype != torch.float32 else None
    written = state[0] if out is None else out
    blocks = layout.view(layout.empty(torch.device(DEVICE)))

    def plain() -> None:
        adam_step(*state, step=1, out=out, impl="triton", **HYPER)

    def fused() -> None:
        adam_step(*state, step=1, out=out, quantized=blocks, impl="triton", **HYPER)

    def separate() -> None:
        plain()
        quantize(written, 8, layout.block, out=blocks, impl="triton")

    ms = {name: _ms(fn) for name, fn in (("plain", plain), ("fused", fused), ("separate", separate))}
    return {"case": f"adam + int8 epilogue, {str(dtype)[6:]} params", "block": layout.block,
            "plain_ms": ms["plain"], "fused_ms": ms["fused"], "adam_then_quantize_ms": ms["separate"],
            "fused_vs_plain": ms["fused"] / ms["plain"], "goal": 1.1,
            "separate_vs_plain": ms["separate"] / ms["plain"]}  # fmt: skip


def tuning_sweep() -> list[dict]:
    """GB/s of the Adam and flatten kernels at 2^26 under each launch configuration."""
    from zero_kernels.kernels import adam_step, flatten, triton_flatten, tuning

    rows = []
    state = [torch.randn(BIG, device=DEVICE) for _ in range(4)]
    state[3].abs_()
    tensors = [torch.randn(s, device=DEVICE) for s in transformer_shapes(BIG)]
    offsets = torch.tensor([0] + [t.numel() for t in tensors[:-1]]).cumsum(0).tolist()
    flat = torch.empty(BIG, device=DEVICE)
    saved = (list(tuning.ADAM), tuning.FLATTEN, list(tuning.FLATTEN_CHUNK))
    try:
        for block, warps in [(b, w) for b in (1024, 2048, 4096) for w in (4, 8)]:
            tuning.ADAM[:] = [(1 << 62, tuning.LaunchConfig(block=block, num_warps=warps))]
            tuning.FLATTEN = tuning.LaunchConfig(block=block, num_warps=warps)
            tuning.FLATTEN_CHUNK[:] = [(1 << 62, 4 * block)]
            triton_flatten.cache_clear()
            t_adam = _ms(lambda: adam_step(*state, step=1, impl="triton", **HYPER))
            t_flat = _ms(lambda: flatten(tensors, flat, offsets, impl="triton"))
            rows.append({"block": block, "num_warps": warps, "adam_GB/s": 28 * BIG / t_adam / 1e6,
                         "flatten_GB/s": 8 * BIG / t_flat / 1e6})  # fmt: skip
    finally:
        tuning.ADAM[:], tuning.FLATTEN, tuning.FLATTEN_CHUNK[:] = saved[0], saved[1], saved[2]
        triton_flatten.cache_clear()
    return rows


def time_quant() -> list[dict]:
    """quantize and dequantize of 2^26 elements, bits 8 and 4, against the device's copy bandwidth."""
    from zero_kernels.kernels import QuantizedBlocks, dequantize, quantize, tuning

    bandwidth = copy_bandwidth(BIG, DEVICE)
    rows = []
    for bits, dtype in [(b, d) for b in (8, 4) for d in (torch.bfloat16, torch.float32)]:
        block = tuning.QUANT_BLOCK[bits]
        x = torch.randn(BIG, device=DEVICE).to(dtype)
        qb = QuantizedBlocks.empty(BIG, bits, block, DEVICE)
        out = torch.empty_like(x)
        moved = BIG * x.element_size() + qb.nbytes()  # the values on one side, integers + scales on the other
        for op, fn in (
            ("quantize", lambda: quantize(x, bits, block, out=qb, impl="triton")),
            ("dequantize", lambda: dequantize(qb, dtype, out=out, impl="triton")),
        ):
            ms = _ms(fn)
            gbps = moved / (ms * 1e-3) / 1e9
            rows.append({"case": f"{op} int{bits} {str(dtype)[6:]}", "block": block, "ms": ms, "GBps": gbps,
                         "of_copy_bandwidth": gbps / bandwidth, "goal": 0.8})  # fmt: skip
    return rows


SECTIONS = {
    "adam": ("timed: adam on an unaligned model, padded vs unpadded vs fused AdamW", time_unaligned_adam),
    "flatten": ("timed: flatten as stage 2 calls it vs torch.mul(out=)", time_stage2_flatten),
    "tuning": ("timed: (block, num_warps) sweep", tuning_sweep),
    "quant": ("timed: quantize/dequantize vs copy bandwidth (goal >= 80 %)", time_quant),
    # last: it compiles three variants of its own (the quantize kernels are compiled by "quant" already), so
    # that a run stopped by gpu_check.sh's limit loses this section, not the ones before
    "epilogue": ("timed: adam + int8 epilogue vs plain adam (goal <= 1.1x)", time_epilogue),
}


def _section(report: Report, key: str, fn: Callable[[], list[dict]]) -> list[str]:
    rows = fn()
    report.set(key, rows)
    for r in rows:
        print("  " + "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return []


def time_all(report: Report) -> int:
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (Triton interpreter)"
    bandwidth = copy_bandwidth(BIG, DEVICE)
    report.set("copy_GBps", bandwidth)
    print(f"gpu_timing: {where}, copy bandwidth {bandwidth:.0f} GB/s")
    for key, (name, function) in SECTIONS.items():
        report.run(name, lambda: _section(report, key, function))
    return report.exit_status()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="DIR", help="also write gpu_timing.json there (after every section)")
    parser.add_argument("--cpu-smoke", action="store_true", help="the same code on the CPU, tiny sizes")
    args = parser.parse_args(argv)
    report = Report(args.json, "gpu_timing")
    if args.cpu_smoke:
        global BIG, REPEAT, BUCKET, DEVICE, MODEL
        os.environ["TRITON_INTERPRET"] = "1"  # read when the Triton kernels are first imported
        BIG, REPEAT, BUCKET, DEVICE, MODEL = 1 << 16, 1, 1 << 10, "cpu", dict(layers=1, width=37, vocab=101)
        return time_all(report)
    if not torch.cuda.is_available():
        print("gpu_timing: no CUDA device here: every timing is skipped")
        report.skip_all([name for name, _ in SECTIONS.values()])
        return report.exit_status()
    return time_all(report)


if __name__ == "__main__":
    sys.exit(main())
