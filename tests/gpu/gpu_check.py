"""GPU check of the Triton kernels: correctness on random data, and what each compiled variant costs.

``python tests/gpu/gpu_check.py [--json DIR]`` runs on a CUDA device: Adam (every flag, grad and
copy dtype, sizes up to 2^26), flatten/unflatten (a 2^26-element bucket of ~200 tensors, views,
mixed dtypes), block quantize/dequantize and Adam's int8 epilogue (bit for bit) against the reference twins and
torch.optim.AdamW, no recompilation across an lr schedule; then it prints, for every kernel variant
those checks compiled, its registers, spills and the widest global load and store of its PTX
(``kernels.aot`` holds the same limits without a GPU). ``--json DIR`` writes ``gpu_check.json`` after
every check. It exits 1 when a check fails or a variant is over the limits, 2 without CUDA (every
check written as skipped).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from a checkout

from benchmarks.adam import transformer_shapes  # noqa: E402
from benchmarks.gpu_report import Report  # noqa: E402
from benchmarks.gpu_script import skipped_without_cuda  # noqa: E402

RTOL = 1.3e-6
HYPER = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BIG = 1 << 26  # the largest size checked; --cpu-smoke lowers it
DEVICE = "cuda"


def _mismatches(ours: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float | torch.Tensor) -> str:
    """'' when |ours - ref| <= atol + rtol |ref| everywhere (nan matching nan), else a description."""
    a, e = ours.double().flatten(), ref.double().flatten()
    bad = ((a - e).abs() > atol + rtol * e.abs()) & ~(a.isnan() & e.isnan())
    if not bool(bad.any()):
        return ""
    idx = bad.nonzero().flatten()[:3].tolist()
    return f"{int(bad.sum())} of {a.numel()} differ, e.g. " + ", ".join(f"[{i}] {a[i]:.9g} vs {e[i]:.9g}" for i in idx)


def _state(n: int, seed: int) -> dict:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return {
        "param": torch.randn(n, device=DEVICE, generator=g),
        "exp_avg": torch.randn(n, device=DEVICE, generator=g) * 1e-2,
        "exp_avg_sq": (torch.randn(n, device=DEVICE, generator=g) * 1e-2) ** 2,
    }


def _compare_state(ours: dict, ref: dict, before: torch.Tensor) -> list[str]:
    """One step's error, as in tests/kernels/test_kernels.py: param within RTOL of itself plus RTOL of the
    oracle's update (``before`` is where the step started); moments within RTOL of their largest element.
    ``_sync`` then starts the next step from ``ref``."""
    problems = []
    for name in ("param", "exp_avg", "exp_avg_sq"):
        atol = RTOL * ((ref[name] - before).abs() if name == "param" else ref[name].abs().max().item())
        bad = _mismatches(ours[name], ref[name], RTOL, atol)
        if bad:
            problems.append(f"{name}: {bad}")
    return problems


def _sync(ours: dict, ref: dict) -> None:
    for name in ("param", "exp_avg", "exp_avg_sq"):
        ours[name].copy_(ref[name])


def check_adam_variants() -> list[str]:
    """Every flag and dtype against adam_step_ref, two steps with different lr, sizes 1 .. 2^26."""
    from zero_kernels.kernels import adam_step, adam_step_ref

    problems = []
    variants = [(gd, adamw, sc) for gd in DTYPES for adamw in (True, False) for sc in ("none", "float", "tensor")]
    for i, (grad_dtype, adamw, scale_kind) in enumerate(variants):
        out_dtype = (None, torch.bfloat16, torch.float16)[i % 3]
        with_flag = i % 2 == 0
        extra = {1} if i < 3 else ({min((1 << 20) + 3, BIG)} if i < 6 else set())  # bound the compile count
        for n in sorted({7, 4097, BIG} | extra):
            ours = _state(n, i)
            ours["out"] = None if out_dtype is None else torch.empty(n, dtype=out_dtype, device=DEVICE)
            ours["found_inf"] = torch.zeros(1, device=DEVICE) if with_flag else None
            ref = {k: None if v is None else v.clone() for k, v in ours.items()}
            scale = {"none": None, "float": 0.37, "tensor": torch.tensor([0.61], device=DEVICE)}[scale_kind]
            for step, lr in ((1, 1e-3), (2, 7e-4)):
                grad = torch.randn(n, device=DEVICE).to(grad_dtype)
                kwargs = dict(HYPER, lr=lr, step=step, adamw=adamw, grad_scale=scale)
                before = ref["param"].clone()
                for fn, bufs, impl in ((adam_step, ours, {"impl": "triton"}), (adam_step_ref, ref, {})):
                    fn(
                        bufs["param"],
                        grad,
                        bufs["exp_avg"],
                        bufs["exp_avg_sq"],
                        out=bufs["out"],
                        found_inf=bufs["found_inf"],
                        **kwargs,
                        **impl,
                    )
                where = f"n={n} grad={grad_dtype} adamw={adamw} scale={scale_kind} out={out_dtype} flag={with_flag}"
                problems += [f"{where} step {step}: {p}" for p in _compare_state(ours, ref, before)]
                if out_dtype is not None and not torch.equal(ours["out"], ours["param"].to(out_dtype)):
                    problems.append(f"{where} step {step}: out is not the rounded param")
                if with_flag and ours["found_inf"].item() != 0:
                    problems.append(f"{where} step {step}: found_inf set on finite gradients")
                _sync(ours, ref)
        torch.cuda.empty_cache()
    return problems


def check_adam_nonfinite() -> list[str]:
    """One nan or inf anywhere in 2^26 elements: flag set, nothing written; flag already set: same."""
    from zero_kernels.kernels import adam_step

    problems = []
    for grad_dtype in DTYPES:
        for bad, where in ((math.nan, BIG // 2), (math.inf, BIG - 1), (-math.inf, 0), (None, 0)):
            bufs = _state(BIG, 3)
            out = torch.zeros(BIG, dtype=torch.bfloat16, device=DEVICE)
            flag = torch.zeros(1, device=DEVICE) if bad is not None else torch.ones(1, device=DEVICE)
            grad = torch.randn(BIG, device=DEVICE).to(grad_dtype)
            if bad is not None:
                grad[where] = bad
            before = {k: v.clone() for k, v in bufs.items()}
            adam_step(
                bufs["param"],
                grad,
                bufs["exp_avg"],
                bufs["exp_avg_sq"],
                lr=1e-3,
                step=1,
                out=out,
                found_inf=flag,
                grad_scale=torch.tensor([0.5], device=DEVICE),
                impl="triton",
                **HYPER,
            )
            case = f"grad={grad_dtype} bad={bad} at {where}"
            if flag.item() != 1.0:
                problems.append(f"{case}: found_inf is {flag.item()}")
            for name in bufs:
                if not torch.equal(bufs[name], before[name]):
                    problems.append(f"{case}: {name} was written")
            if bool(out.any()):
                problems.append(f"{case}: out was written")
    return problems


def _kernel_count(kernel) -> int:
    """Compiled variants of a Triton kernel (0 under the interpreter, which compiles nothing)."""
    caches = getattr(kernel, "device_caches", {})
    return sum(len(entry[0]) for entry in caches.values())


def check_adam_vs_torch_and_no_recompile() -> list[str]:
    """fp32 against torch.optim.AdamW over an lr schedule; the schedule compiles nothing new."""
    from zero_kernels.kernels import adam_step, triton_adam

    problems, n = [], min(1 << 22, BIG) + 5
    bufs = _state(n, 5)
    bufs["exp_avg"].zero_()
    bufs["exp_avg_sq"].zero_()
    ref_param = torch.nn.Parameter(bufs["param"].clone())
    opt = torch.optim.AdamW(
        [ref_param],
        lr=1.0,
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        foreach=False,
    )
    compiled = None
    for step in range(1, 11):
        lr = 1e-3 * (1 + math.cos(step)) / 2 + 1e-5
        grad = torch.randn(n, device=DEVICE)
        ref_param.grad = grad.clone()
        opt.param_groups[0]["lr"] = lr
        before = bufs["param"].clone()
        opt.step()
        adam_step(bufs["param"], grad, bufs["exp_avg"], bufs["exp_avg_sq"], lr=lr, step=step, impl="triton", **HYPER)
        state = opt.state[ref_param]
        ref = {"param": ref_param.detach(), "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        problems += [f"step {step} vs torch.optim.AdamW: {p}" for p in _compare_state(bufs, ref, before)]
        _sync(bufs, ref)
        if step == 1:
            compiled = _kernel_count(triton_adam._adam_kernel)
    if _kernel_count(triton_adam._adam_kernel) != compiled:
        problems.append(
            f"the lr schedule recompiled the Adam kernel ({compiled} -> {_kernel_count(triton_adam._adam_kernel)})"
        )
    return problems


def check_adam_window_no_recompile() -> list[str]:
    """Pieces that start and end off 16-element boundaries (runs split where step counts differ), launched
    on the aligned span around them with ``window``: the same results as the piece alone, only the piece
    changed, and no new compiled variant (the scalar one an unaligned launch would need)."""
    from zero_kernels.kernels import adam_step, adam_step_ref, triton_adam

    n, problems = min(1 << 20, BIG), []
    grad = torch.randn(n, device=DEVICE).to(torch.bfloat16)
    span = _state(n, 7)
    span["out"] = torch.zeros(n, dtype=torch.bfloat16, device=DEVICE)
    adam_step(span["param"], grad, span["exp_avg"], span["exp_avg_sq"], out=span["out"], lr=1e-3, step=1,
              impl="triton", **HYPER)  # fmt: skip
    compiled = _kernel_count(triton_adam._adam_kernel)
    for lo, hi in ((3, n - 5), (16, 41), (0, 7), (n - 9, n)):
        ours = {k: v.clone() for k, v in span.items()}
        ref = {k: v.clone() for k, v in span.items()}
        adam_step(ours["param"], grad, ours["exp_avg"], ours["exp_avg_sq"], out=ours["out"], lr=1e-3, step=2,
                  window=(lo, hi), impl="triton", **HYPER)  # fmt: skip
        adam_step_ref(ref["param"][lo:hi], grad[lo:hi], ref["exp_avg"][lo:hi],
                      ref["exp_avg_sq"][lo:hi], out=ref["out"][lo:hi], lr=1e-3, step=2, **HYPER)  # fmt: skip
        for k in ours:
            if not torch.equal(torch.cat([ours[k][:lo], ours[k][hi:]]), torch.cat([span[k][:lo], span[k][hi:]])):
                problems.append(f"window ({lo}, {hi}): {k} changed outside the window")
            bad = _mismatches(ours[k][lo:hi], ref[k][lo:hi], RTOL, RTOL * ref[k][lo:hi].float().abs().max().item())
            if bad:
                problems.append(f"window ({lo}, {hi}): {k}: {bad}")
    if _kernel_count(triton_adam._adam_kernel) != compiled:
        problems.append(
            f"windowed launches compiled {_kernel_count(triton_adam._adam_kernel) - compiled} new variant(s)"
        )
    return problems


def check_adam_amsgrad_maximize_vs_torch() -> list[str]:
    """The AMSGRAD and MAXIMIZE flags together, fp32, against torch.optim.AdamW(amsgrad=True, maximize=True)."""
    from zero_kernels.kernels import adam_step

    problems, n = [], min(1 << 22, BIG) + 5
    bufs = _state(n, 6)
    for name in ("exp_avg", "exp_avg_sq"):
        bufs[name].zero_()
    v_max = torch.zeros(n, device=DEVICE)
    ref_param = torch.nn.Parameter(bufs["param"].clone())
    opt = torch.optim.AdamW([ref_param], lr=1e-3, betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], amsgrad=True, maximize=True, foreach=False)  # fmt: skip
    for step in range(1, 6):
        grad = torch.randn(n, device=DEVICE) * (3.0 if step % 2 == 0 else 0.3)  # v falls and rises: the max acts
        ref_param.grad = grad.clone()
        before = bufs["param"].clone()
        opt.step()
        adam_step(bufs["param"], grad, bufs["exp_avg"], bufs["exp_avg_sq"], lr=1e-3, step=step, max_exp_avg_sq=v_max,
                  maximize=True, impl="triton", **HYPER)  # fmt: skip
        state = opt.state[ref_param]
        ref = {"param": ref_param.detach(), "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        problems += [f"step {step}: {p}" for p in _compare_state(bufs, ref, before)]
        bad = _mismatches(v_max, state["max_exp_avg_sq"], RTOL, RTOL * state["max_exp_avg_sq"].abs().max().item())
        if bad:
            problems.append(f"step {step}: max_exp_avg_sq: {bad}")
        _sync(bufs, ref)
        v_max.copy_(state["max_exp_avg_sq"])
    return problems


def _views(shapes: list[tuple[int, ...]], seed: int, fill: float | None) -> list[torch.Tensor]:
    """Tensors of ``shapes`` in mixed dtypes: contiguous, transposed or strided views, in turn."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    views = []
    for i, shape in enumerate(shapes):
        dtype, kind = DTYPES[i % 3], i % 4
        if kind == 0:
            store, view = shape, lambda t: t
        elif kind == 1 and len(shape) == 2:
            store, view = shape[::-1], lambda t: t.t()
        else:
            store, view = (*shape[:-1], 2 * shape[-1]), lambda t: t[..., 1::2]
        base = (
            torch.randn(store, device=DEVICE, generator=g) if fill is None else torch.full(store, fill, device=DEVICE)
        )
        views.append(view(base.to(dtype)))
    return views


def check_flatten() -> list[str]:
    """A 2^26-element bucket of ~200 views of mixed dtypes: flatten and unflatten == the reference."""
    from zero_kernels.kernels import flatten, flatten_ref, unflatten, unflatten_ref

    problems = []
    shapes = transformer_shapes(BIG)
    offsets = torch.tensor([0] + [math.prod(s) for s in shapes[:-1]]).cumsum(0).tolist()
    for flat_dtype in DTYPES:
        for scale in (None, 0.3, torch.tensor([1.7], device=DEVICE)):
            src = _views(shapes, 1, None)
            ours = torch.zeros(BIG, dtype=flat_dtype, device=DEVICE)
            ref = torch.zeros_like(ours)
            flatten(src, ours, offsets, scale=scale, impl="triton")
            flatten_ref(src, ref, offsets, scale=scale)
            case = f"flat={flat_dtype} scale={scale if not isinstance(scale, torch.Tensor) else 'tensor'}"
            if not torch.equal(ours, ref):
                problems.append(f"flatten {case}: {int((ours != ref).sum())} elements differ")
            back_ours, back_ref = _views(shapes, 2, -7.0), _views(shapes, 2, -7.0)
            unflatten(ours, back_ours, offsets, scale=scale, impl="triton")
            unflatten_ref(ours, back_ref, offsets, scale=scale)
            bad = [i for i, (a, b) in enumerate(zip(back_ours, back_ref)) if not torch.equal(a, b)]
            if bad:
                problems.append(f"unflatten {case}: tensors {bad[:5]} differ")
            del src, back_ours, back_ref
            torch.cuda.empty_cache()
    return problems


def check_quant() -> list[str]:
    """quantize/dequantize (bits 8 and 4, every dtype, 2^26 and odd sizes, non-finite blocks) == the reference."""
    from zero_kernels.kernels import dequantize, dequantize_ref, quantize, quantize_ref, tuning

    problems = []
    for bits, dtype, n in [(b, d, n) for b in (8, 4) for d in DTYPES for n in (BIG, BIG // 7 + 3)]:
        block = tuning.QUANT_BLOCK[bits]
        x = torch.randn(n, device=DEVICE).to(dtype)
        x[n // 3] = float("nan")
        x[n - 2] = float("inf")
        ours, ref = quantize(x, bits, block, impl="triton"), quantize_ref(x, bits, block)
        case = f"bits={bits} {dtype} n={n}"
        if not torch.equal(ours.data, ref.data) or not torch.equal(
            ours.scales.nan_to_num(7.0), ref.scales.nan_to_num(7.0)
        ):
            problems.append(f"quantize {case}: {int((ours.data != ref.data).sum())} bytes differ")
        back, back_ref = dequantize(ref, dtype, impl="triton"), dequantize_ref(ref, dtype)
        if not torch.equal(back.nan_to_num(7.0), back_ref.nan_to_num(7.0)):
            problems.append(f"dequantize {case}: {int((back != back_ref).sum())} elements differ")
        del x, ours, ref, back, back_ref
    return problems


def check_adam_epilogue() -> list[str]:
    """Adam with the int8 epilogue == plain Adam then quantize_ref, bit for bit: bf16 and fp32 parameters, an odd
    size over many blocks with non-finite values, and a step skipped by found_inf (the blocks as they were)."""
    from zero_kernels.kernels import QuantizedBlocks, adam_step, quantize_ref

    problems = []
    n, block = BIG // 4 + 3, 2044  # a block as Payload cuts them: even, a multiple of 4, no power of two
    for dtype, skip in ((torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)):
        plain = {**_state(n, 5), "grad": torch.randn(n, device=DEVICE).to(dtype)}
        plain["param"][n // 2] = float("inf")
        plain["grad"][n // 3] = float("inf") if skip else float("nan")
        plain["out"] = plain["param"].to(dtype) if dtype != torch.float32 else None
        fused = {k: None if v is None else v.clone() for k, v in plain.items()}
        blocks = QuantizedBlocks.empty(n, 8, block, DEVICE)
        for state, quantized in ((plain, None), (fused, blocks)):
            flag = torch.zeros(1, device=DEVICE) if skip else None
            adam_step(state["param"], state["grad"], state["exp_avg"], state["exp_avg_sq"], lr=1e-3, step=3,
                      out=state["out"], found_inf=flag, quantized=quantized, impl="triton", **HYPER)  # fmt: skip
        case = f"{dtype} n={n}{' skipped' if skip else ''}"
        for name, value in plain.items():
            if value is not None and not torch.equal(fused[name].nan_to_num(7.0), value.nan_to_num(7.0)):
                problems.append(f"{case}: {name} differs from the plain step's")
        written = plain["out"] if plain["out"] is not None else plain["param"]
        ref = quantize_ref(written, 8, block)
        if not torch.equal(blocks.data, ref.data) or not torch.equal(
            blocks.scales.nan_to_num(7.0), ref.scales.nan_to_num(7.0)
        ):
            problems.append(f"{case}: {int((blocks.data != ref.data).sum())} int8 values differ from quantize_ref's")
        del plain, fused, blocks, ref
        torch.cuda.empty_cache()
    return problems


CHECKS = {
    "adam: flags x dtypes x sizes vs reference": check_adam_variants,
    "adam: non-finite gradients, flag already set": check_adam_nonfinite,
    "adam: fp32 vs torch.optim.AdamW, lr schedule, no recompile": check_adam_vs_torch_and_no_recompile,
    "adam: amsgrad + maximize vs torch.optim.AdamW": check_adam_amsgrad_maximize_vs_torch,
    "adam: unaligned pieces on aligned spans (window), no recompile": check_adam_window_no_recompile,
    "flatten/unflatten: 2^26 bucket, views, mixed dtypes": check_flatten,
    "quantize/dequantize: bits 8 and 4, every dtype, non-finite blocks vs reference": check_quant,
    "adam + int8 epilogue: bf16, fp32, skipped step vs plain adam then quantize_ref": check_adam_epilogue,
}


VARIANTS = "compiled variants within 128 registers, no spills"


def compiled_variants() -> list[dict]:
    """Registers, spills and access widths of every Triton kernel variant compiled in this process."""
    from zero_kernels.kernels import aot, triton_adam, triton_flatten, triton_quant

    rows = []
    kernels = (triton_adam._adam_kernel, triton_adam._nonfinite_kernel, triton_adam._adam_quantize_kernel)
    kernels += (triton_flatten._flatten_kernel,)
    for kernel in kernels + (triton_quant._quantize_kernel, triton_quant._dequantize_kernel):
        for cache, *_ in getattr(kernel, "device_caches", {}).values():
            for compiled in cache.values():
                registers, stack = aot.cubin_resources(compiled.asm["cubin"], compiled.metadata.name)
                spills = getattr(compiled, "n_spills", None)  # the driver's count, once the kernel was loaded
                row = {"kernel": kernel.fn.__name__, "num_warps": compiled.metadata.num_warps}
                row.update(
                    registers=registers, stack_bytes=stack, spills=spills, **aot.access_bits(compiled.asm["ptx"])
                )
                row["over_limits"] = registers > aot.MAX_REGISTERS or stack > 0 or bool(spills)
                rows.append(row)
    return rows


def check_compiled_variants(report: Report) -> list[str]:
    """Every variant the checks above compiled, within the limits (``kernels.aot``'s, read from the cubins)."""
    variants = compiled_variants()
    report.set("variants", variants)
    print(f"{len(variants)} compiled kernel variants (registers, stack frame, spills, widest global load/store):")
    for v in variants:
        flag = "  OVER THE LIMITS" if v["over_limits"] else ""
        print(
            f"  {v['kernel']:18s} warps {v['num_warps']}  regs {v['registers']:3d}  stack {v['stack_bytes']:3d} B  "
            f"spills {v['spills']}  ld {v['load_bits']:3d} st {v['store_bits']:3d} bits "
            f"({v['vector_loads']}/{v['vector_stores']} x 128){flag}"
        )
    over = sum(v["over_limits"] for v in variants)
    problems = [f"{over} of {len(variants)} over the limits"] if over else []
    return problems + ([] if variants else ["no compiled variant found in the kernels' caches"])


def run_checks(report: Report) -> int:
    import triton

    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (Triton interpreter)"
    print(f"gpu_check: {where}, torch {torch.__version__}, triton {triton.__version__}")
    report.run_all(CHECKS)
    if DEVICE == "cuda":  # the interpreter compiles nothing
        report.run(VARIANTS, lambda: check_compiled_variants(report))
    return report.exit_status()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="DIR", help="also write gpu_check.json there (after every check)")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="run the same checks on the CPU in the Triton interpreter, small sizes"
    )
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        global BIG, DEVICE
        os.environ["TRITON_INTERPRET"] = "1"  # read when the Triton kernels are first imported, below
        BIG, DEVICE = 1 << 15, "cpu"
        return run_checks(Report(args.json, "gpu_check"))
    report = Report(args.json, "gpu_check")
    if skipped_without_cuda(report, [*CHECKS, VARIANTS], " (tests/ cover the CPU)"):
        return report.exit_status()
    return run_checks(report)


if __name__ == "__main__":
    sys.exit(main())
