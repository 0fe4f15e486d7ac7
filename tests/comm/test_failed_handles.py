"""A failed operation raises its error at every wait, made anew: the same error object raised again gathers
every waiter's frames in its traceback, and keeps them, and what they hold, alive (a failed gather left pending by
``overlap_param_gather`` raises at every use of a parameter). Both kinds of handle: a collective's
(``comm.handles.Handle``) and a file request's (``offload.aio.IOHandle``)."""

from __future__ import annotations

import errno
import gc
import traceback
import weakref
from typing import Callable

import pytest
import torch

from zero_kernels.comm.handles import Handle
from zero_kernels.comm.primitives import CommError
from zero_kernels.offload.aio import IOHandle


class _FailingWork:
    def wait(self) -> None:
        raise RuntimeError("connection reset by peer")


def _waits_keep_nothing(wait: Callable[[], None], error: type) -> None:
    seen = []  # (message, frames in the traceback) per wait
    for _ in range(3):

        def waiter() -> weakref.ref:
            held = torch.zeros(1024)  # what a caller's frame holds
            try:
                wait()
            except error as exc:
                seen.append((str(exc), len(traceback.extract_tb(exc.__traceback__))))
            return weakref.ref(held)

        gone = waiter()
        gc.collect()
        assert gone() is None, "a waiter's frame outlived it through the error's traceback"
    assert len(set(seen)) == 1, f"one error raised again: its traceback grew {seen}"


def test_a_failed_collective_raises_anew_at_every_wait() -> None:
    handle = Handle(_FailingWork(), (), what="all_gather of bucket 0")
    _waits_keep_nothing(handle.wait, CommError)
    with pytest.raises(CommError, match="all_gather of bucket 0 failed: connection reset by peer") as caught:
        handle.wait()
    assert "connection reset" in str(caught.value.__cause__)


def test_a_failed_file_request_raises_anew_at_every_wait() -> None:
    handle = IOHandle("/nvme/b0.g0.exp_avg", torch.zeros(4), lambda: (errno.ENOSPC, "writing"), lambda: True)
    _waits_keep_nothing(handle.wait, OSError)
    with pytest.raises(OSError, match="b0.g0.exp_avg"):
        handle.wait()
