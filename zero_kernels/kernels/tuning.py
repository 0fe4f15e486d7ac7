"""Launch parameters of the Triton kernels, as data: one small table per kernel, keyed by size.

Each table is a list of ``(max_elements, value)`` rows in increasing order; the first row whose
bound is at least the problem size wins. The kernels are memory-bound element-wise loops, so the
only choices are how many elements one program handles (``block``) and how many warps share them
(``num_warps``): small problems keep blocks small so that enough programs exist to fill the
device, large ones use bigger blocks to cut per-program overhead. The flatten kernel loops over
its chunk a tile at a time, so its chunk size is a runtime argument and its tile is fixed. The
rows are a starting point: ``tests/gpu/gpu_check.py`` (run by ``benchmarks/gpu_check.sh``) times the
alternatives on a GPU.

``launch_device`` makes a launch run on the device of its tensors, not the current one.

``launch_variants()`` lists the calls that make the kernels compile every variant the package can
launch; ``python -m zero_kernels.kernels.aot`` compiles them for sm_80 and sm_90 without a GPU and
reports registers, spills and vector widths (``tests/kernels/test_aot.py`` holds them to their bounds).
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator, TypeVar

import torch

# Whether a kernel may contract a*b+c into one FMA, said at every launch: Triton 3.9 defaults to yes and
# warns that 3.10 defaults to no; pinned, the kernels compute the same on every Triton, without the warning.
FP_FUSION = True


@dataclass(frozen=True)
class LaunchConfig:
    block: int
    num_warps: int


_UNBOUNDED = 1 << 62
T = TypeVar("T")

# Adam on a flat shard: five streams per element (param, grad, m, v in; param, m, v, out back).
ADAM = [
    (1 << 16, LaunchConfig(block=1024, num_warps=4)),
    (_UNBOUNDED, LaunchConfig(block=2048, num_warps=8)),
]

# Non-finite check of the gradient before an Adam step: one stream, reduced per program.
NONFINITE = [
    (1 << 16, LaunchConfig(block=1024, num_warps=4)),
    (_UNBOUNDED, LaunchConfig(block=4096, num_warps=8)),
]

# Flatten/unflatten: one program copies one chunk of one tensor, ``block`` elements (the tile) per
# loop iteration: 8 per thread, two 16-byte vectors of fp32 or one of bf16/fp16 on aligned tensors.
# Strided tensors have their own launch, with int64 index arithmetic on half the elements per thread.
FLATTEN = LaunchConfig(block=1024, num_warps=4)
FLATTEN_STRIDED = LaunchConfig(block=512, num_warps=4)

# Elements per program (a runtime argument: no recompilation), keyed by the largest tensor of the
# bucket; always a multiple of 16, so that every chunk of an aligned tensor starts aligned.
FLATTEN_CHUNK = [
    (1 << 18, 1024),
    (_UNBOUNDED, 4096),
]

# Block quantization (``quant``): elements per block, one fp32 scale each, by bits. Measured with the
# C++ kernel on this project's 2-core CPU (quantize + dequantize of 2^21 bf16/fp32 elements, one thread,
# block sizes interleaved, best of 15): 64: 0.80-1.23 ms, 256: 0.53-0.69, 1024: 0.41-0.55, 2048: 0.39-0.61,
# 4096: 0.41-0.78, 8192: 0.62-0.85, 16384: 0.65-0.88 ms. 1024-2048 are the fastest (a block's fp32 stage
# stays in L1); 2048 keeps the scales at 0.4 % of the int4 bytes (0.2 % of int8). A Triton program
# handles one block (its tile the next power of two).
QUANT_BLOCK = {4: 2048, 8: 2048}


def pick(table: list[tuple[int, T]], numel: int) -> T:
    """The row of ``table`` for a problem of ``numel`` elements."""
    for bound, config in table:
        if numel <= bound:
            return config
    raise ValueError(f"no launch configuration for {numel} elements")


def launch_device(tensor: torch.Tensor) -> ContextManager:
    """Make ``tensor``'s CUDA device current for a launch (a no-op for CPU tensors)."""
    if tensor.is_cuda:
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def _row_sizes(table: list[tuple[int, Any]]) -> tuple[int, ...]:
    """One problem size per row of ``table``, multiples of 16: each row's bound, the last one's start."""
    sizes, low = [], 0
    for bound, _ in table:
        sizes.append(bound if bound < _UNBOUNDED else low + 16)
        low = bound
    return tuple(sizes[::-1])  # the largest first: the largest blocks are the heaviest


# What a caller can vary in a launch, per public function, with every value it may take; the first
# value of each axis is the heaviest (the most code and the widest dtypes). Axes not named in
# ``kernels.aot`` are passed to the function as keyword arguments: a new Adam flag is one more row.
_ADAM_FLAGS: dict[str, tuple] = {  # what every Adam launch may vary, plain or with the epilogue
    "grad_dtype": ("float32", "bfloat16", "float16"),
    "out_dtype": ("bfloat16", "float16", "float32", None),
    "adamw": (False, True),
    "grad_scale": ("tensor", "float", None),
    "found_inf": (True, False),
    "amsgrad": (True, False),
    "maximize": (True, False),
    "adopt_out": (True, False),
}
LAUNCH_AXES: dict[str, dict[str, tuple]] = {
    "adam_step": {
        **_ADAM_FLAGS,
        "numel": _row_sizes(ADAM),
        "aligned": (True, False),
        # The pipeline launches every bucket piece with a window, on an aligned span (stages.update): the
        # window variant is compiled aligned; without one first, so that the unaligned variant is too.
        "window": (False, True),
    },
    # The epilogue (``adam_step(..., quantized=)``): its own kernel, one program per quantization block, with
    # the blocks ``stages.quantized_gather.Payload`` picks (a full 2048, an even split that is a multiple of 4
    # only, the smallest shard's 16); the stages launch it on a whole aligned shard, never with a window.
    "adam_step_quantized": {
        **_ADAM_FLAGS,
        "block": (2048, 1668, 16),
    },
    "flatten": {
        "layout": ("aligned", "contiguous", "strided"),
        "tensor_dtype": ("bfloat16", "float32", "float16"),
        "flat_dtype": ("float32", "bfloat16", "float16"),
        "scale": ("tensor", "float", None),
        "numel": tuple(bound if bound < _UNBOUNDED else 1 << 19 for bound, _ in FLATTEN_CHUNK[::-1]),
    },
    "unflatten": {
        "layout": ("aligned", "contiguous", "strided"),
        "tensor_dtype": ("bfloat16", "float32", "float16"),
        "flat_dtype": ("float32", "bfloat16", "float16"),
        "scale": ("tensor", "float", None),
        "numel": tuple(bound if bound < _UNBOUNDED else 1 << 19 for bound, _ in FLATTEN_CHUNK[::-1]),
    },
    "quantize": {
        "bits": (4, 8),
        "dtype": ("float32", "bfloat16", "float16"),
        "aligned": (True, False),
    },
    "dequantize": {
        "bits": (4, 8),
        "dtype": ("float32", "bfloat16", "float16"),
        "aligned": (True, False),
    },
}


def launch_variants(full: bool = False) -> Iterator[tuple[str, dict[str, Any]]]:
    """(public function, one value per axis of ``LAUNCH_AXES``) for every call to compile.

    Args:
        full: every combination of the axes (hundreds of compilations: minutes). By default the
            heaviest combination, then each value of each axis changed from it alone: every dtype,
            flag, tuning row and alignment is compiled, next to the heaviest of everything else.
    """
    for function, axes in LAUNCH_AXES.items():
        names = list(axes)
        if full:
            for values in itertools.product(*axes.values()):
                yield function, dict(zip(names, values))
            continue
        heaviest = {name: values[0] for name, values in axes.items()}
        yield function, heaviest
        for name, values in axes.items():
            for value in values[1:]:
                yield function, {**heaviest, name: value}
