"""Host tensors on an anonymous mapping of their own: given back to the system when freed, never left in the heap.

glibc serves an allocation under its mmap threshold from the heap; the threshold rises at run time (up to 32 MiB)
as mapped blocks are freed. A block freed in the heap stays resident, and once a smaller allocation that outlives it
is placed in its space, a block of its size no longer fits there and the heap grows instead. Bucket-sized
temporaries made and freed once per bucket during backward, between the small tensors the step keeps, left up to
1.28 GB of free blocks in the heap of a 403M-parameter run, a different amount in each run (``mapped_empty`` keeps
such a temporary out of it).
"""

from __future__ import annotations

import mmap

import torch


def mapped_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor of ``numel`` elements of ``dtype`` on its own anonymous mapping, unmapped when
    the tensor is freed. Drop it on a Python thread: its memory is released through the Python object it is
    mapped by."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"mapped_empty: numel must be an integer >= 0, got {numel!r}")
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype)
