"""Compile every Triton kernel variant the package launches for sm_80 and sm_90, without a GPU.

``python -m zero_kernels.kernels.aot [--arch 80 90] [--full] [--json FILE]`` makes each call of
``tuning.launch_variants()`` on small CPU tensors with the kernels replaced by recorders, so the
launchers run exactly as they would on a GPU (argument checks, tables, tuning rows, dtypes) and
the recorders keep what they would have launched. Each distinct launch is specialised by Triton's
own binder for the target (the same compiled variant, and the same cache entry, that the launch
on a GPU of that architecture gets), compiled through PTX to a cubin, and measured:

* registers and stack frame, read from the cubin's ``.nv.info`` attributes (the numbers
  ``ptxas -v`` prints; a spill needs a stack frame, so a 0-byte frame means no spills);
* the widest global load and store in the PTX, in bits (128: 16-byte vector accesses).

Limits (``Compiled.problems``): it compiles, no stack frame (so no spills), at most
``MAX_REGISTERS`` registers, and 128-bit loads and stores where the launch had aligned tensors
(``vectors_needed``: for the flatten kernel, in each runtime dtype path). Triton picks the
``ptxas`` it runs and the PTX version it writes together; if that ``ptxas`` refuses the PTX, the
CUDA toolkit's ``ptxas`` (``CUDA_HOME``, ``PATH`` or ``/usr/local/cuda``) is used instead. Needs
the triton package (no GPU, no CUDA toolkit) and must run without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import struct
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional

import torch

from . import tuning

ARCHS = (80, 90)
MAX_REGISTERS = 128
VECTOR_BITS = 128
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Compiled:
    """One compiled kernel variant and what it costs."""

    kernel: str
    arch: int
    variant: str  # the specialisation: constexprs, pointer dtypes and alignment, num_warps
    calls: list[str] = field(default_factory=list)  # the launch_variants() calls that launch it
    aligned: bool = False  # some call launched it on aligned tensors: vector accesses expected
    registers: int = -1
    stack_bytes: int = -1
    load_bits: int = 0  # widest global load
    store_bits: int = 0  # widest global store
    vector_loads: int = 0  # global loads of VECTOR_BITS
    vector_stores: int = 0
    error: str = ""

    def problems(self) -> list[str]:
        """What breaks the limits; empty when it compiled within them."""
        if self.error:
            return [f"does not compile: {self.error}"]
        found = []
        if self.stack_bytes != 0:
            found.append(f"{self.stack_bytes}-byte stack frame (spills)")
        if self.registers > MAX_REGISTERS:
            found.append(f"{self.registers} registers > {MAX_REGISTERS}")
        if self.aligned:
            loads, stores = vectors_needed(self.kernel)
            if self.vector_loads < loads or self.vector_stores < stores:
                found.append(
                    f"aligned launch with {self.vector_loads} {VECTOR_BITS}-bit loads and {self.vector_stores} stores, "
                    f"at least {loads} and {stores} expected"
                )
        return found


def vectors_needed(kernel: str) -> tuple[int, int]:
    """(loads, stores) of ``VECTOR_BITS`` an aligned variant of ``kernel`` must contain at least.

    The non-finite check stores one flag: only its loads. The quantization kernels must move their
    float side (quantize's loads, dequantize's stores) in vectors; their integer side is 16 bytes per
    thread for int8 and 8 for int4 (the even/odd split of a tile leaves a thread 64-bit runs of bytes,
    which a warp still reads and writes as whole lines). The flatten kernel picks its dtypes at run
    time: each of its nine (tensor, flat) dtype pairs has its own copy loop, and each loop must move
    a thread's share of a tile in 16-byte vectors.
    """
    from .triton_flatten import DTYPE_CODES

    if kernel in ("_nonfinite_kernel", "_quantize_kernel"):
        return 1, 0
    if kernel == "_dequantize_kernel":
        return 0, 1
    if kernel != "_flatten_kernel":
        return 1, 1
    per_thread = tuning.FLATTEN.block // (32 * tuning.FLATTEN.num_warps)
    sizes = [dtype.itemsize for dtype in DTYPE_CODES]
    vectors = sum(per_thread * size * 8 // VECTOR_BITS for size in sizes) * len(sizes)
    return vectors, vectors


# ------------------------------------------------------------------------------------------------
# Recording the launches of a call


@dataclass
class _Launch:
    kernel: Any  # the JITFunction
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands in for a JITFunction: ``kernel[grid](*args, **kwargs)`` records instead of launching."""

    def __init__(self, kernel: Any, into: list[_Launch]):
        self.kernel, self.into = kernel, into

    def __getitem__(self, grid: Any):
        def record(*args: Any, **kwargs: Any) -> None:
            self.into.append(_Launch(self.kernel, args, kwargs))

        return record


@contextlib.contextmanager
def _recording() -> Iterator[list[_Launch]]:
    """Replace every Triton kernel of the kernel modules by a recorder while inside."""
    import triton

    from . import triton_adam, triton_flatten, triton_quant

    launches: list[_Launch] = []
    saved = []
    for module in (triton_adam, triton_flatten, triton_quant):
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                saved.append((module, name, value))
                setattr(module, name, _Recorder(value, launches))
    try:
        yield launches
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _tensor(numel: int, dtype: torch.dtype, aligned: bool) -> torch.Tensor:
    """A CPU tensor of ``numel`` elements; not aligned: it starts one element into its storage."""
    storage = torch.zeros(numel + 1, dtype=dtype)
    return storage[:numel] if aligned else storage[1:]


def _adam_call(axes: dict[str, Any]) -> None:
    axes = dict(axes)
    n, aligned = axes.pop("numel"), axes.pop("aligned")
    n = n if aligned else n - 1
    window = (3, n - 5) if axes.pop("window") else None  # a piece off the 16-element grid, as stages.update makes
    _launch_adam(n, aligned, axes, window=window)


def _adam_quantized_call(axes: dict[str, Any]) -> None:
    from .quant_reference import QuantizedBlocks

    axes = dict(axes)
    block = axes.pop("block")
    n = 4 * block - 16  # a shard (a multiple of 16 elements) of several blocks, the last one partial
    _launch_adam(n, True, axes, quantized=QuantizedBlocks.empty(n, 8, block))


def _launch_adam(n: int, aligned: bool, axes: dict[str, Any], **extra: Any) -> None:
    """``adam_step_triton`` on tensors of ``n`` elements as the Adam axes ask (taken out of ``axes``; the rest are
    passed as they are), with ``extra``."""
    from .triton_adam import adam_step_triton

    out_dtype = axes.pop("out_dtype")
    scale = {"tensor": torch.ones(1), "float": 0.5, None: None}[axes.pop("grad_scale")]
    adam_step_triton(
        _tensor(n, torch.float32, aligned),
        _tensor(n, _DTYPES[axes.pop("grad_dtype")], aligned),
        _tensor(n, torch.float32, aligned),
        _tensor(n, torch.float32, aligned),
        lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1,
        grad_scale=scale,
        found_inf=torch.zeros(1) if axes.pop("found_inf") else None,
        out=None if out_dtype is None else _tensor(n, _DTYPES[out_dtype], aligned),
        max_exp_avg_sq=_tensor(n, torch.float32, aligned) if axes.pop("amsgrad") else None,
        **extra,
        **axes,
    )  # fmt: skip


def _flatten_call(function: str, axes: dict[str, Any]) -> None:
    from .triton_flatten import flatten_triton, unflatten_triton

    n, layout = axes["numel"], axes["layout"]
    dtype = _DTYPES[axes["tensor_dtype"]]
    if layout == "strided":
        tensor = torch.zeros(2 * n, dtype=dtype).view(-1, 2)[:, 0]
    else:
        tensor = _tensor(n if layout == "aligned" else n - 1, dtype, layout == "aligned")
    flat = torch.zeros(n + 16, dtype=_DTYPES[axes["flat_dtype"]])
    scale = {"tensor": torch.ones(1), "float": 0.5, None: None}[axes["scale"]]
    if function == "flatten":
        flatten_triton([tensor], flat, [16], scale=scale)
    else:
        unflatten_triton(flat, [tensor], [16], scale=scale)


def _quant_call(function: str, axes: dict[str, Any]) -> None:
    from .quant_reference import QuantizedBlocks
    from .triton_quant import dequantize_triton, quantize_triton

    bits, dtype, aligned = axes["bits"], _DTYPES[axes["dtype"]], axes["aligned"]
    block = tuning.QUANT_BLOCK[bits]
    n = 4 * block if aligned else 4 * block - 1
    if function == "quantize":
        quantize_triton(_tensor(n, dtype, aligned), bits, block)
    else:
        dequantize_triton(QuantizedBlocks.empty(n, bits, block), dtype, out=_tensor(n, dtype, aligned))


def _launches(function: str, axes: dict[str, Any]) -> list[_Launch]:
    with _recording() as launches:
        if function == "adam_step":
            _adam_call(axes)
        elif function == "adam_step_quantized":
            _adam_quantized_call(axes)
        elif function in ("quantize", "dequantize"):
            _quant_call(function, axes)
        else:
            _flatten_call(function, axes)
    return launches


def _describes_alignment(function: str, axes: dict[str, Any]) -> bool:
    if function == "adam_step_quantized":  # aligned tensors, blocks starting 4 elements apart at least (16 bytes
        return axes["block"] >= 128  # of fp32), and a tile of 4 elements or more per thread of a warp
    if function in ("adam_step", "quantize", "dequantize"):
        return bool(axes.get("aligned"))
    return axes.get("layout") == "aligned"


# ------------------------------------------------------------------------------------------------
# Compiling one launch for a target


def _specialise(launch: _Launch, target: Any) -> tuple[Any, dict, dict, dict, str]:
    """(options, signature, constexprs, attrs, key) that Triton's binder gives this launch on ``target``."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound, specialization, options)
    key = f"{kernel.fn.__name__} {specialization} num_warps={options.num_warps}"
    return options, signature, constexprs, attrs, key


def _elf_sections(data: bytes) -> dict[str, bytes]:
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    sections = {}
    for h in headers:
        name = data[names_at + h[0] : data.index(b"\0", names_at + h[0])].decode()
        sections[name] = data[h[4] : h[4] + h[5]]
    return sections


_EIATTR_FRAME_SIZE, _EIATTR_REGCOUNT = 0x11, 0x2F


def cubin_resources(cubin: bytes, name: str) -> tuple[int, int]:
    """(registers, stack frame bytes) of kernel ``name``, from the cubin's ``.nv.info`` attributes."""
    sections = _elf_sections(cubin)
    strtab, symtab = sections[".strtab"], sections[".symtab"]
    symbols = {}
    for i in range(len(symtab) // 24):
        (at,) = struct.unpack_from("<I", symtab, 24 * i)
        symbols[i] = strtab[at : strtab.index(b"\0", at)].decode()
    info, pos, found = sections[".nv.info"], 0, {}
    while pos + 4 <= len(info):
        form, attr, size = info[pos], info[pos + 1], struct.unpack_from("<H", info, pos + 2)[0]
        if form == 0x04 and attr in (_EIATTR_FRAME_SIZE, _EIATTR_REGCOUNT):  # (symbol, value) pairs
            symbol, value = struct.unpack_from("<II", info, pos + 4)
            if symbols.get(symbol) == name:
                found[attr] = value
        pos += 4 + size if form == 0x04 else 4
    return found.get(_EIATTR_REGCOUNT, -1), found.get(_EIATTR_FRAME_SIZE, 0)


_ACCESS = re.compile(r"\b(ld|st)\.global(?:\.[a-z]+)*?(?:\.v(\d))?\.[busf](\d+)\b")


def access_bits(ptx: str) -> dict[str, int]:
    """Global accesses of the PTX: ``load_bits``/``store_bits`` the widest (vector width x element
    width), ``vector_loads``/``vector_stores`` how many are ``VECTOR_BITS`` wide."""
    found = {"load_bits": 0, "store_bits": 0, "vector_loads": 0, "vector_stores": 0}
    for op, vector, bits in _ACCESS.findall(ptx):
        kind = "load" if op == "ld" else "store"
        width = int(vector or 1) * int(bits)
        found[f"{kind}_bits"] = max(found[f"{kind}_bits"], width)
        found[f"vector_{kind}s"] += width >= VECTOR_BITS
    return found


def _toolkit_ptxas() -> Optional[str]:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for candidate in (home and os.path.join(home, "bin", "ptxas"), shutil.which("ptxas"), "/usr/local/cuda/bin/ptxas"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _use_toolkit_ptxas(arch: int) -> bool:
    """Point Triton at the toolkit's ptxas for ``arch``; False when there is none or it is in use."""
    from triton.backends.nvidia import compiler as nvidia

    path = _toolkit_ptxas()
    keys = ["TRITON_PTXAS_PATH"] if arch < 90 else ["TRITON_PTXAS_BLACKWELL_PATH", "TRITON_PTXAS_PATH"]
    if path is None or all(os.environ.get(k) == path for k in keys):
        return False
    for k in keys:
        os.environ[k] = path
    nvidia.get_ptxas_version.cache_clear()
    return True


def _compile(launch: _Launch, arch: int, entry: Compiled) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    for attempt in range(2):
        options, signature, constexprs, attrs, _ = _specialise(launch, target)
        source = ASTSource(launch.kernel, signature, constexprs, attrs)
        try:
            compiled = triton.compile(source, target=target, options=options.__dict__)
            break
        except Exception as exc:  # PTXASError, CompilationError, ...: reported, with the toolkit's ptxas tried once
            if attempt == 0 and "ptxas" in str(exc) and _use_toolkit_ptxas(arch):
                continue
            entry.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            return
    entry.registers, entry.stack_bytes = cubin_resources(compiled.asm["cubin"], compiled.metadata.name)
    for name, value in access_bits(compiled.asm["ptx"]).items():
        setattr(entry, name, value)


def compile_variants(archs: tuple[int, ...] = ARCHS, full: bool = False) -> list[Compiled]:
    """Every distinct kernel variant of ``tuning.launch_variants(full)``, compiled for each of ``archs``."""
    from triton.backends.compiler import GPUTarget

    results: list[Compiled] = []
    for arch in archs:
        entries: dict[str, tuple[Compiled, _Launch]] = {}
        for function, axes in tuning.launch_variants(full=full):
            call = f"{function}(" + ", ".join(f"{k}={v}" for k, v in axes.items()) + ")"
            for launch in _launches(function, axes):
                *_, key = _specialise(launch, GPUTarget("cuda", arch, 32))
                if key not in entries:
                    entries[key] = (Compiled(launch.kernel.fn.__name__, arch, key), launch)
                entry = entries[key][0]
                entry.calls.append(call)
                entry.aligned |= _describes_alignment(function, axes)
        for entry, launch in entries.values():
            _compile(launch, arch, entry)
            results.append(entry)
    return results


def _row(c: Compiled) -> str:
    status = "FAIL" if c.problems() else "ok"
    vector = f"ld {c.load_bits:3d} st {c.store_bits:3d} bits ({c.vector_loads}/{c.vector_stores} x {VECTOR_BITS})"
    return (
        f"sm_{c.arch}  {c.kernel:18s} regs {c.registers:3d}  stack {c.stack_bytes:3d} B  {vector}  "
        f"{'aligned' if c.aligned else 'scalar ':7s}  {status:4s}  {len(c.calls)} call(s), e.g. {c.calls[0]}"
    )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), help="compute capabilities (80 90)")
    parser.add_argument("--full", action="store_true", help="every combination of the axes (minutes)")
    parser.add_argument("--json", metavar="FILE", help="also write the results there")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("zero_kernels.kernels.aot: unset TRITON_INTERPRET (the interpreter compiles nothing)", file=sys.stderr)
        return 2
    results = compile_variants(tuple(args.arch), full=args.full)
    for c in results:
        print(_row(c))
        for problem in c.problems():
            print(f"      {problem}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**asdict(c), "problems": c.problems()} for c in results], f, indent=1)
    failed = sum(1 for c in results if c.problems())
    print(
        f"{len(results)} kernel variants compiled for sm_{', sm_'.join(map(str, args.arch))}: {failed} over the limits"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
