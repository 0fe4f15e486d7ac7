"""Where the optimizer state lives when it is offloaded: host memory (``host``) or files (``disk``).

The tiers hold storage and move bytes; the pipelines (``stages.offloaded``) decide what goes where.
"""

from __future__ import annotations

from .disk import DiskTier, remove_stale_runs
from .host import THREADS_VARIABLE, HostShard, HostTier, cpu_threads

__all__ = ["THREADS_VARIABLE", "DiskTier", "HostShard", "HostTier", "cpu_threads", "remove_stale_runs"]
