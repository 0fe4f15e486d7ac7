"""Rates of this machine the offload plan needs when no figure is given: the CPU Adam's and the memory's.

Each is measured once per process (a few hundred milliseconds) and cached.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

import torch

_ELEMENTS = 1 << 22  # 48 MB of fp32 state: well beyond the caches
_REPEAT = 5


def _median_s(fn: Callable[[], object]) -> float:
    fn()
    times = []
    for _ in range(_REPEAT):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@functools.lru_cache(maxsize=None)
def cpu_adam_gbps() -> tuple[float, str]:
    """(GB of optimizer state the CPU Adam updates per second here with all of this process's threads, the
    backend measured): fp32 master, m and v stepped with a bf16 gradient and a bf16 copy out, as the host
    tier runs it (the C++ kernel; the PyTorch reference where the extension does not build)."""
    from ..kernels import adam_step, resolve_impl

    master, m, v = (torch.randn(_ELEMENTS) for _ in range(3))
    grad = torch.randn(_ELEMENTS, dtype=torch.bfloat16)
    out = torch.empty(_ELEMENTS, dtype=torch.bfloat16)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1)
    seconds = _median_s(lambda: adam_step(master, grad, m, v, out=out, **hyper))
    return 12 * _ELEMENTS / seconds / 1e9, resolve_impl(None, master.device)


@functools.lru_cache(maxsize=None)
def memory_copy_gbps() -> float:
    """GB copied per second by one large copy in host memory (each byte read once and written once)."""
    src = torch.randn(_ELEMENTS)
    dst = torch.empty_like(src)
    return 4 * _ELEMENTS / _median_s(lambda: dst.copy_(src)) / 1e9
