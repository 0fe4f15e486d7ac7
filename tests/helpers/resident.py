"""How much of a host tensor's memory is resident (``mincore``), for tests of what gives pages back."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import pytest
import torch


def resident_pages(tensor: torch.Tensor) -> int:
    """How many of the whole pages under ``tensor``'s bytes are resident; skips the test off Linux."""
    if not sys.platform.startswith("linux"):
        pytest.skip("mincore on anonymous memory is Linux's")
    page = mmap.PAGESIZE
    start = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
    if end <= start:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    pages = (ctypes.c_ubyte * ((end - start) // page))()
    ok = libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), pages) == 0
    assert ok, os.strerror(ctypes.get_errno())
    return sum(p & 1 for p in pages)
