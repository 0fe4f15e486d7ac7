"""Launch parameters of the Triton kernels, as data: one small table per kernel, keyed by size.

Each table is a list of ``(max_elements, LaunchConfig)`` rows in increasing order; the first row
whose bound is at least the problem size wins. The kernels are memory-bound element-wise loops,
so the only choices are how many elements one program handles (``block``) and how many warps
share them (``num_warps``): small problems keep blocks small so that enough programs exist to
fill the device, large ones use bigger blocks to cut per-program overhead. The rows are a
starting point: ``benchmarks/gpu_check.py`` times the alternatives on a GPU.

``launch_device`` makes a launch run on the device of its tensors, not the current one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager

import torch


@dataclass(frozen=True)
class LaunchConfig:
    block: int
    num_warps: int


_UNBOUNDED = 1 << 62

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

# Flatten/unflatten: one program copies one chunk of one tensor, so ``block`` is also the chunk
# size of the per-bucket table. Keyed by the largest tensor of the bucket.
FLATTEN = [
    (1 << 12, LaunchConfig(block=512, num_warps=4)),
    (1 << 18, LaunchConfig(block=1024, num_warps=4)),
    (_UNBOUNDED, LaunchConfig(block=4096, num_warps=8)),
]


def pick(table: list[tuple[int, LaunchConfig]], numel: int) -> LaunchConfig:
    """The launch parameters for a problem of ``numel`` elements."""
    for bound, config in table:
        if numel <= bound:
            return config
    raise ValueError(f"no launch configuration for {numel} elements")


def launch_device(tensor: torch.Tensor) -> ContextManager:
    """Make ``tensor``'s CUDA device current for a launch (a no-op for CPU tensors)."""
    if tensor.is_cuda:
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()
