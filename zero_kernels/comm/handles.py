"""One in-flight operation of an engine: ``Handle`` (torch engine, and the world-size-1 path) and
``CppHandle`` (C++ engine); ``wait()`` completes it and raises ``CommError`` naming it.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from .primitives import CommError, forked_message


class Handle:
    """One in-flight collective; ``wait()`` completes it (idempotent) and runs its epilogue.

    On CUDA (a CUDA tensor among ``keep_alive``) the stream current at issue is remembered: a ``wait()`` with
    another stream current (the backend's ``wait()`` orders that one only, and the epilogue runs on it) makes the
    issuing stream follow it, as the C++ engine's epilogue does, and a later ``wait()`` on a third stream follows
    the issuing stream: whatever the issuing stream queues next sees the result, whichever stream waited first
    (``overlap_param_gather``: the first read of a parameter under a user's stream; qwZ's dequantize).
    """

    def __init__(
        self,
        work: Union[dist.Work, "Works", None],
        keep_alive: tuple,
        epilogue: Optional[Callable[[], None]] = None,
        what: str = "",
    ):
        self._work = work
        self._keep_alive = keep_alive
        self._epilogue = epilogue
        self._what = what
        self._error: Optional[CommError] = None
        self._done = False
        self._stream = issuing_stream(keep_alive)
        self._pid = os.getpid()

    def _check_process(self) -> None:
        """Refuse to wait in a process forked while the operation was in flight (the fork of a forward at stage 3,
        its gathers issued): the parent's ranks, threads and backend are not in it, and the wait would never end."""
        if os.getpid() != self._pid and not self.is_completed():
            raise CommError(forked_message(f"waiting for {self._what or 'a collective'}", self._pid))

    def wait(self) -> None:
        self._check_process()
        first = not self._done
        if not self._done:
            try:
                if self._work is not None:
                    self._work.wait()
                if self._epilogue is not None:
                    self._epilogue()
            except Exception as exc:  # the backend's own error type varies (RuntimeError, DistBackendError)
                self._error = CommError(f"{self._what} failed: {exc}")  # kept unraised, its cause without traceback:
                self._error.__cause__ = exc.with_traceback(None)  # a traceback keeps its callers' frames alive
            self._done = True
            self._work = self._epilogue = None
            self._keep_alive = ()
        if self._error is not None:
            raise CommError(*self._error.args) from self._error.__cause__  # anew at every wait
        if self._stream is not None:
            current = torch.cuda.current_stream(self._stream.device)
            if current != self._stream:
                if first:
                    self._stream.wait_stream(current)  # after the backend's wait and the epilogue on ``current``
                else:
                    current.wait_stream(self._stream)

    def is_completed(self) -> bool:
        return self._done or self._work is None or self._work.is_completed()


def issuing_stream(tensors: tuple) -> Optional["torch.cuda.Stream"]:
    """The current stream of the device of the first CUDA tensor among ``tensors`` (None: none is on CUDA)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            return torch.cuda.current_stream(t.device)
    return None


def used_here(*tensors: torch.Tensor) -> None:
    """An epilogue read ``tensors`` on the stream current at ``wait()``, which may not be the stream they were
    allocated on (the one current at issue; an autograd callback's or a user's stream waits too): tell the caching
    allocator of that use (``record_stream``) before the handle drops them, so that their blocks do not go to the
    issuing stream's next allocation while the epilogue's kernels may still read them (as ``copy_out`` does)."""
    for t in tensors:
        if t is not None and t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


class Works:
    """Several c10d works (the sends and receives of one point-to-point operation) as one."""

    def __init__(self, works: list):
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


class CppHandle(Handle):
    """A handle on an operation of the C++ engine, which holds the buffers until it has finished.

    On CUDA the C++ engine finishes the operation on its side stream and makes the stream that was
    current when it was issued wait for it; ``wait()`` also makes the caller's current stream wait
    for it, so a consumer on another stream (an autograd callback's, a user's) reads the result.
    """

    def __init__(self, op: Any, side_stream: Optional["torch.cuda.Stream"] = None):
        super().__init__(None, (), what=op.what)
        self._op = op
        self._side = side_stream

    def wait(self) -> None:
        self._check_process()
        try:
            self._op.wait()
        except RuntimeError as exc:
            raise CommError(str(exc)) from exc
        if self._side is not None:
            torch.cuda.current_stream(self._side.device).wait_stream(self._side)

    def is_completed(self) -> bool:
        return self._op.is_completed()
