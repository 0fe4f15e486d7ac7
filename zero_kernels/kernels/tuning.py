"""Launch parameters of the Triton kernels, as data: one small table per kernel, keyed by size.

Each table is a list of ``(max_elements, value)`` rows in increasing order; the first row whose
bound is at least the problem size wins. The kernels are memory-bound element-wise loops, so the
only choices are how many elements one program handles (``block``) and how many warps share them
(``num_warps``): small problems keep blocks small so that enough programs exist to fill the
device, large ones use bigger blocks to cut per-program overhead. The flatten kernel loops over
its chunk a tile at a time, so its chunk size is a runtime argument and its tile is fixed. The
rows are a starting point: ``benchmarks/gpu_check.py`` times the alternatives on a GPU.

``launch_device`` makes a launch run on the device of its tensors, not the current one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager, TypeVar

import torch


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
