"""Where the optimizer state lives when it is offloaded: host memory (``host``) or files (``disk``), and the
asynchronous disk I/O engine that moves tensors between host memory and files (``aio``).

The tiers hold storage and move bytes; the pipelines (``stages.offloaded``) decide what goes where.
"""

from __future__ import annotations

from .aio import FileIO, IOHandle
from .disk import DiskTier, remove_stale_runs
from .host import THREADS_VARIABLE, HostShard, HostTier, cpu_threads

__all__ = [
    "THREADS_VARIABLE",
    "DiskTier",
    "FileIO",
    "HostShard",
    "HostTier",
    "IOHandle",
    "cpu_threads",
    "remove_stale_runs",
]
