"""Stage 3's parameter shards in files (``offload_param`` with ``device: nvme``), read through a bounded host pool.

Files. ``<nvme_path>/zero_kernels/<run>/rank<R>/u<n>.params``: this rank's shard of one unit, in the parameters'
dtype, ``n`` in the order the units were added. The directory is a ``run_directory.RunDirectory`` (start checks,
reservation and cleanup as for the disk tier's files, with errors naming ``offload_param.nvme_path``); bytes move
through a ``FileIO`` (``aio.file_io``: the disk tier's engine, with the ``aio`` block's knobs). Files, pool and I/O
are ``shard_files.ShardFiles``'.

Pool. DeepSpeed's parameter swapper keeps ``buffer_count`` host buffers of ``buffer_size`` elements and asserts
that each partition fits in one. Here the pool is ``buffer_count`` page-aligned host buffers, each as large as
the largest shard added (never more than ``buffer_size`` elements: ``add`` refuses a larger shard naming the
key): at 403M parameters in 24 units, 5 buffers of 33.5 MB, resident only while held.
"""

from __future__ import annotations

import torch

from ..config.offload import AioConfig, OffloadParamConfig
from .aio import file_io
from .run_directory import RunDirectory
from .shard_files import ShardFiles

KEY = "offload_param"


class ParamFiles(ShardFiles):
    """The parameter shards' files and their host pool (see the module docstring).

    Args:
        config: the ``offload_param`` block (``nvme_path``, ``buffer_count``, ``buffer_size``).
        aio: the ``aio`` block.
        rank: this process's rank (its directory).
    """

    def __init__(self, config: OffloadParamConfig, aio: AioConfig, *, rank: int):
        directory = RunDirectory(config.nvme_path, f"{KEY}.nvme_path", rank)
        super().__init__(directory, file_io(aio), config.buffer_count, "params")
        self.buffer_size = int(config.buffer_size)

    def add(self, key: int, numel: int, dtype: torch.dtype, name: str) -> None:
        """Reserve the file of a shard of ``numel`` elements (``name``: the unit, for errors); a shard larger than
        ``buffer_size`` raises ``ValueError`` naming the key, a disk without room ``OSError``."""
        if numel > self.buffer_size:
            raise ValueError(
                f"zero_optimization.{KEY}.buffer_size={self.buffer_size} is smaller than this rank's parameter "
                f"shard of {name} ({numel} elements): each shard is read into one buffer; raise buffer_size to at "
                f"least {numel}"
            )
        super().add(key, numel, dtype, f"the parameter shard of {name}")
        self.fit(numel * dtype.itemsize)
