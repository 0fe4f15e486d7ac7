"""Where the optimizer state lives when it is offloaded: host memory (``host``) or files (``disk``); the run
directory under ``nvme_path`` that holds a rank's files, from its start to its removal (``run_directory``); shards
in files read through a bounded host pool (``shard_files``: stage 3's parameter shards, ``param_files``, and its
gradient shards); the asynchronous disk I/O engine that moves tensors between host memory and files (``aio``); and
host temporaries kept out of the C heap (``mapped``).

The tiers hold storage and move bytes; the pipelines (``stages.offloaded``) decide what goes where.
"""

from __future__ import annotations

from .aio import FileIO, IOHandle
from .disk import DiskTier
from .host import THREADS_VARIABLE, HostShard, HostTier, cpu_threads
from .mapped import mapped_empty
from .param_files import ParamFiles
from .run_directory import remove_stale_runs
from .shard_files import ShardFiles

__all__ = [
    "THREADS_VARIABLE",
    "DiskTier",
    "FileIO",
    "HostShard",
    "HostTier",
    "IOHandle",
    "ParamFiles",
    "ShardFiles",
    "cpu_threads",
    "mapped_empty",
    "remove_stale_runs",
]
