"""Shards in files under a run directory, read and written through a bounded pool of page-aligned host buffers.

Files. ``add`` reserves one file per shard (``<root>/u<n>.<suffix>``, ``n`` in the order the shards were added) in a
``run_directory.RunDirectory``, whose errors name its key; bytes move through a ``FileIO``. Stage 3's parameter
shards (``param_files``, their own directory and engine) and its gradient shards (``stages.stage3.disk_grads``, in
the state tier's directory, through its engine) are such files.

Pool. ``buffer_count`` page-aligned host buffers, each as large as ``fit`` asked for, allocated when first taken.
``take`` hands out a free buffer; when every buffer is held it first calls the oldest holder's release callback,
which must finish what still reads or writes the buffer and ``put`` it back (copies to a device that may still read
it: with an event, which ``take`` waits for before handing it out again). A buffer put back gives its pages to
the system (``aio.release_pages``; page-locked buffers keep theirs): what the pool keeps resident is the buffers
held, not ``buffer_count`` of them.

I/O. ``read`` and ``write`` move a range of a shard asynchronously (an ``IOHandle``); a read first waits for the
writes still in flight on the same file, so it sees the last values written, and a write for those of the same bytes,
so the last one written lands last; a write that failed raises there once every one waited for is done (none is
left to land later). ``finish`` waits for every write.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .aio import FileIO, IOHandle, release_pages, wait_all
from .run_directory import RunDirectory


@dataclass(eq=False)
class Lease:
    """A pool buffer held by a caller: ``tensor`` (the elements asked for) viewing ``raw`` (the whole buffer)."""

    raw: torch.Tensor
    tensor: torch.Tensor


class ShardFiles:
    """Shards in files and their host pool (see the module docstring).

    Args:
        directory: where the files go (its ``key`` names the config key in errors).
        io: the engine that moves the bytes.
        buffer_count: buffers in the pool.
        suffix: the files' suffix.
        owned: ``close`` also stops ``io`` and removes ``directory`` (False: their owner does).
    """

    def __init__(self, directory: RunDirectory, io: FileIO, buffer_count: int, suffix: str, *, owned: bool = True):
        self.directory = directory
        self.io = io
        self.buffer_count = int(buffer_count)
        self.suffix = suffix
        self.owned = owned
        self.paths: dict[int, tuple[Path, torch.dtype]] = {}  # key -> its file and dtype
        self._writes: dict[int, list[tuple[int, int, IOHandle]]] = {}  # key -> (first byte, end byte, write) in flight
        self._nbytes = 0  # the size of each pool buffer
        self._pool: list[torch.Tensor] = []  # every buffer allocated (uint8)
        self._free: list[torch.Tensor] = []
        self._holders: OrderedDict[int, tuple[Lease, Callable[[], None]]] = OrderedDict()  # oldest first
        self._copies: dict[int, Any] = {}  # id(free buffer) -> the event after the device copies that read it (put)
        self.bytes_read = 0
        self.bytes_written = 0

    # ---------------------------------------------------------------- files
    def add(self, key: int, numel: int, dtype: torch.dtype, needed: str) -> None:
        """Reserve the file of a shard of ``numel`` elements (``needed``: what it holds, for errors); a disk without
        room raises ``OSError`` naming the directory's key."""
        path = self.directory.root / f"u{len(self.paths)}.{self.suffix}"
        try:
            self.directory.reserve(path, numel * dtype.itemsize, needed)
        except OSError:
            path.unlink(missing_ok=True)
            raise
        self.paths[key] = (path, dtype)

    def remove(self, key: int) -> None:
        """Forget a shard and delete its file (a unit that could not be set up)."""
        path, _ = self.paths.pop(key)
        path.unlink(missing_ok=True)

    def write(self, key: int, tensor: torch.Tensor, offset: int = 0) -> IOHandle:
        """Start writing ``tensor`` into the shard's file from element ``offset``, after the writes in flight to any
        of the same bytes (the engine's workers finish requests in any order: an older one could land last)."""
        path, _ = self.paths[key]
        start = offset * tensor.element_size()
        end = start + tensor.numel() * tensor.element_size()
        spans = self._writes.get(key, [])
        kept = [span for span in spans if not (span[0] < end and start < span[1])]
        self._writes[key] = kept
        wait_all(span[2] for span in spans if span[0] < end and start < span[1])
        handle = self.io.write(path, tensor, start)
        self._writes[key] = kept + [(start, end, handle)]
        self.bytes_written += end - start
        return handle

    def wait_write(self, key: int, handle: IOHandle) -> None:
        """Wait for one write of the shard's file (``write``'s handle), unless a read, a later write of the same bytes
        or ``finish`` waited for it already: a write that failed raises its error once, wherever it is waited for
        first."""
        spans = self._writes.get(key, [])
        kept = [span for span in spans if span[2] is not handle]
        if len(kept) == len(spans):
            return
        self._writes[key] = kept
        handle.wait()

    def read(self, key: int, tensor: torch.Tensor, offset: int = 0) -> IOHandle:
        """Start filling ``tensor`` from the shard's file from element ``offset`` (after its writes in flight)."""
        wait_all(handle for _, _, handle in self._writes.pop(key, []))
        path, _ = self.paths[key]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return self.io.read(path, tensor, offset * tensor.element_size())

    def finish(self) -> None:
        """Wait for every write in flight."""
        writes, self._writes = self._writes, {}
        wait_all(handle for spans in writes.values() for _, _, handle in spans)

    def disk_bytes(self) -> int:
        """Bytes of the shards' files."""
        return sum(path.stat().st_size for path, _ in self.paths.values() if path.exists())

    # ---------------------------------------------------------------- the pool
    def fit(self, nbytes: int) -> None:
        """Make every pool buffer taken from now on at least ``nbytes`` long."""
        self._nbytes = max(self._nbytes, nbytes)

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
        copied = self._copies.pop(id(raw), None)
        if copied is not None:
            copied.synchronize()  # a copy to the device queued before the buffer came back may still read it
        nbytes = numel * dtype.itemsize
        if raw.numel() < nbytes:  # a shard added after this buffer was made: a larger one in its place
            at = next(i for i, t in enumerate(self._pool) if t is raw)  # by identity (``==`` compares elements)
            raw = self.io.empty(self._nbytes, torch.uint8)
            self._pool[at] = raw
        lease = Lease(raw, raw.narrow(0, 0, nbytes).view(dtype))
        self._holders[id(lease)] = (lease, release)
        return lease

    def hold(self, lease: Lease, release: Callable[[], None]) -> None:
        """Change what a held lease's ``release`` is (a new holder of it), keeping its place in the queue."""
        self._holders[id(lease)] = (lease, release)

    def put(self, lease: Lease, copied: Optional[Any] = None) -> None:
        """Give a buffer back (nothing on the host may read or write it any more); its pages go back to the system.
        ``copied``: an event (``torch.cuda.Event``) recorded after the copies to a device that read it; ``take``
        waits for it before handing the buffer out again (page-locked: its pages stay, the copies read them)."""
        if self._holders.pop(id(lease), None) is not None:
            if copied is not None:
                self._copies[id(lease.raw)] = copied
            release_pages(lease.raw)
            self._free.append(lease.raw)

    def pool(self) -> list[torch.Tensor]:
        """The pool's buffers (host memory)."""
        return list(self._pool)

    def traffic(self) -> dict[str, int]:
        """Bytes of the shards ``read`` from and ``written`` to the files."""
        return {"read": self.bytes_read, "written": self.bytes_written}

    def close(self) -> None:
        """Wait for the writes in flight; where owned, stop the engine and remove the files."""
        try:
            self.finish()
        finally:
            if self.owned:
                self.io.close()
                self.directory.remove()
