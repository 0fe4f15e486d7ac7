"""A stand-in for the asynchronous file I/O engine (``offload.aio``), with its interface.

``FileIO`` runs each read or write on a thread pool of ``os.pread``/``os.pwrite`` calls; ``IOHandle``
is the future. ``direct`` is accepted and not honoured here (buffered I/O: this stand-in must work on
any file system, tmpfs included, which refuses ``O_DIRECT``); ``block_size`` splits a request into
calls of at most that many bytes; ``queue_depth``, ``single_submit`` and ``overlap_events`` are
accepted for the interface.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

ALIGNMENT = 4096  # bytes: the start of every tensor ``empty`` returns


class IOHandle:
    """One read or write in flight."""

    def __init__(self, future: Future, path: str, what: str):
        self._future = future
        self._path = path
        self._what = what

    def wait(self) -> None:
        """Block until done; an I/O error raises ``OSError`` naming the path and the cause."""
        try:
            self._future.result()
        except OSError as err:
            raise OSError(err.errno, f"{self._what} {self._path!r} failed: {err.strerror or err}") from err

    def done(self) -> bool:
        return self._future.done()


def _bytes(tensor: torch.Tensor) -> memoryview:
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("file I/O needs a contiguous CPU tensor")
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B") if tensor.numel() else memoryview(b"")


class FileIO:
    """Asynchronous reads and writes of tensors from and to files (see the module docstring)."""

    backend = "threads"

    def __init__(
        self,
        *,
        block_size: int = 1 << 20,
        queue_depth: int = 8,
        threads: int = 1,
        single_submit: bool = False,
        overlap_events: bool = True,
        direct: bool = True,
    ):
        self.block_size = int(block_size)
        self.queue_depth = int(queue_depth)
        self.direct = bool(direct)
        self._pool = ThreadPoolExecutor(max_workers=max(1, int(threads)), thread_name_prefix="zero_kernels_io")

    def write(self, path: str, tensor: torch.Tensor, offset: int = 0) -> IOHandle:
        """Write ``tensor``'s bytes into ``path`` (created if missing) from byte ``offset``."""
        data = _bytes(tensor)
        return IOHandle(self._pool.submit(self._write, os.fspath(path), data, offset, tensor), os.fspath(path), "write")

    def read(self, path: str, tensor: torch.Tensor, offset: int = 0) -> IOHandle:
        """Fill ``tensor`` with the bytes of ``path`` from byte ``offset``."""
        data = _bytes(tensor)
        return IOHandle(self._pool.submit(self._read, os.fspath(path), data, offset, tensor), os.fspath(path), "read")

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor whose data starts on an ``ALIGNMENT``-byte boundary."""
        size = torch.empty(0, dtype=dtype).element_size()
        raw = torch.empty(numel * size + ALIGNMENT, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % ALIGNMENT
        return raw.narrow(0, skip, numel * size).view(dtype)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _write(self, path: str, data: memoryview, offset: int, keep: torch.Tensor) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done : done + self.block_size], offset + done)
        finally:
            os.close(fd)

    def _read(self, path: str, data: memoryview, offset: int, keep: torch.Tensor) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < len(data):
                got = os.preadv(fd, [data[done : done + self.block_size]], offset + done)
                if got == 0:
                    raise OSError(5, f"unexpected end of file at byte {offset + done}")
                done += got
        finally:
            os.close(fd)
