"""Stage 3's parameter shards in files (``offload_param`` with ``device: nvme``), read through a bounded host pool.

Files. ``<nvme_path>/zero_kernels/<run>/rank<R>/u<n>.params``: this rank's shard of one unit, in the parameters'
dtype, ``n`` in the order the units were added. The directory is a ``disk.RunDirectory`` (the disk tier's start
checks, reservation and cleanup, with errors naming ``offload_param.nvme_path``); bytes move through a ``FileIO``
(the disk tier's engine, with the ``aio`` block's knobs).

Pool. DeepSpeed's parameter swapper keeps ``buffer_count`` host buffers of ``buffer_size`` elements and asserts
that each partition fits in one. Here the pool is ``buffer_count`` page-aligned host buffers, each as large as
the largest shard added (never more than ``buffer_size`` elements: ``add`` refuses a larger shard naming the
key), allocated when first taken. ``take`` hands out a free buffer; when every buffer is held it first calls the
oldest holder's release callback, which must finish what still reads or writes the buffer and ``put`` it back.
A buffer put back gives its pages to the system (``aio.release_pages``; page-locked buffers keep theirs): what
the pool keeps resident is the buffers held, not ``buffer_count`` of them (at 403M parameters in 24 units, 5
buffers of 33.5 MB).

I/O. ``read`` and ``write`` move a range of a shard asynchronously (an ``IOHandle``); a read first waits for the
writes still in flight on the same file, so it sees the last values written. ``finish`` waits for every write.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from ..config.offload import AioConfig, OffloadParamConfig
from .aio import IOHandle, release_pages
from .disk import RunDirectory, file_io

KEY = "offload_param"


@dataclass(eq=False)
class Lease:
    """A pool buffer held by a caller: ``tensor`` (the elements asked for) viewing ``raw`` (the whole buffer)."""

    raw: torch.Tensor
    tensor: torch.Tensor


class ParamFiles:
    """The parameter shards' files and their host pool (see the module docstring).

    Args:
        config: the ``offload_param`` block (``nvme_path``, ``buffer_count``, ``buffer_size``).
        aio: the ``aio`` block.
        rank: this process's rank (its directory).
    """

    def __init__(self, config: OffloadParamConfig, aio: AioConfig, *, rank: int):
        self.directory = RunDirectory(config.nvme_path, f"{KEY}.nvme_path", rank)
        self.io = file_io(aio)
        self.buffer_count = int(config.buffer_count)
        self.buffer_size = int(config.buffer_size)
        self.paths: dict[int, tuple[Path, torch.dtype]] = {}  # key -> its file and dtype
        self._writes: dict[int, list[IOHandle]] = {}
        self._nbytes = 0  # the size of each pool buffer
        self._pool: list[torch.Tensor] = []  # every buffer allocated (uint8)
        self._free: list[torch.Tensor] = []
        self._holders: OrderedDict[int, tuple[Lease, Callable[[], None]]] = OrderedDict()  # oldest first
        self.bytes_read = 0
        self.bytes_written = 0

    # ---------------------------------------------------------------- files
    def add(self, key: int, numel: int, dtype: torch.dtype, name: str) -> None:
        """Reserve the file of a shard of ``numel`` elements (``name``: the unit, for errors); a shard larger than
        ``buffer_size`` raises ``ValueError`` naming the key, a disk without room ``OSError``."""
        if numel > self.buffer_size:
            raise ValueError(
                f"zero_optimization.{KEY}.buffer_size={self.buffer_size} is smaller than this rank's parameter "
                f"shard of {name} ({numel} elements): each shard is read into one buffer; raise buffer_size to at "
                f"least {numel}"
            )
        path = self.directory.root / f"u{len(self.paths)}.params"
        try:
            self.directory.reserve(path, numel * dtype.itemsize, f"the parameter shard of {name}")
        except OSError:
            path.unlink(missing_ok=True)
            raise
        self.paths[key] = (path, dtype)
        self._nbytes = max(self._nbytes, numel * dtype.itemsize)

    def remove(self, key: int) -> None:
        """Forget a shard and delete its file (a unit that could not be set up)."""
        path, _ = self.paths.pop(key)
        path.unlink(missing_ok=True)

    def write(self, key: int, tensor: torch.Tensor, offset: int = 0) -> IOHandle:
        """Start writing ``tensor`` into the shard's file from element ``offset``."""
        path, _ = self.paths[key]
        handle = self.io.write(path, tensor, offset * tensor.element_size())
        self._writes.setdefault(key, []).append(handle)
        self.bytes_written += tensor.numel() * tensor.element_size()
        return handle

    def read(self, key: int, tensor: torch.Tensor, offset: int = 0) -> IOHandle:
        """Start filling ``tensor`` from the shard's file from element ``offset`` (after its writes in flight)."""
        for handle in self._writes.pop(key, []):
            handle.wait()
        path, _ = self.paths[key]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return self.io.read(path, tensor, offset * tensor.element_size())

    def finish(self) -> None:
        """Wait for every write in flight."""
        writes, self._writes = self._writes, {}
        for handles in writes.values():
            for handle in handles:
                handle.wait()

    def disk_bytes(self) -> int:
        """Bytes of the shards' files."""
        return self.directory.disk_bytes()

    # ---------------------------------------------------------------- the pool
    def take(
        self, numel: int, dtype: torch.dtype, release: Callable[[], None], *, wait: bool = True
    ) -> Optional[Lease]:
        """A pool buffer for ``numel`` elements of ``dtype``; ``release`` is called when another caller needs it
        and none is free (it must ``put`` the lease back). With ``wait`` False: None when none is free."""
        if not self._free and len(self._pool) < self.buffer_count:
            self._pool.append(self.io.empty(self._nbytes, torch.uint8))
            self._free.append(self._pool[-1])
        if not self._free:
            if not wait:
                return None
            _, (_, oldest) = next(iter(self._holders.items()))
            oldest()
        raw = self._free.pop()
        nbytes = numel * dtype.itemsize
        if raw.numel() < nbytes:  # a shard added after this buffer was made
            self._pool.remove(raw)
            raw = self.io.empty(self._nbytes, torch.uint8)
            self._pool.append(raw)
        lease = Lease(raw, raw.narrow(0, 0, nbytes).view(dtype))
        self._holders[id(lease)] = (lease, release)
        return lease

    def hold(self, lease: Lease, release: Callable[[], None]) -> None:
        """Change what a held lease's ``release`` is (a new holder of it), keeping its place in the queue."""
        self._holders[id(lease)] = (lease, release)

    def put(self, lease: Lease) -> None:
        """Give a buffer back (nothing may read or write it any more); its pages go back to the system."""
        if self._holders.pop(id(lease), None) is not None:
            release_pages(lease.raw)
            self._free.append(lease.raw)

    def pool(self) -> list[torch.Tensor]:
        """The pool's buffers (host memory)."""
        return list(self._pool)

    def traffic(self) -> dict[str, int]:
        """Bytes of the shards ``read`` from and ``written`` to the files."""
        return {"read": self.bytes_read, "written": self.bytes_written}

    def close(self) -> None:
        """Wait for the writes in flight, stop the engine and remove the files."""
        try:
            self.finish()
        finally:
            self.io.close()
            self.directory.remove()
