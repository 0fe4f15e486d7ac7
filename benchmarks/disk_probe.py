"""The disk's bandwidth, measured in the folder the offload's files go to, as the offload moves bytes.

The offload's step is compared with what its own I/O engine (``zero_kernels.offload.FileIO``, the same ``aio``
knobs) does when it does nothing but stream: so the ratio says how busy the step keeps the disk, not how good
the engine is (``python -m benchmarks aio`` measures the engine against ``dd``, which one request at a time can
leave idle: the engine moved 1.0-1.6x ``dd``'s bytes per second there). Three passes over files of ``size``
bytes whose blocks are allocated first (as the state's files are reserved), in ``O_DIRECT`` where the file
system takes it (the engine's ``backend`` says which):

- ``disk_write_GBps``: a file overwritten;
- ``disk_read_GBps``: that file read;
- ``disk_mixed_GBps``: that file read while the other is overwritten (as many bytes each way, as the state
  swap does: what it reads back it writes), the bytes read and written over the pass's time. A step's I/O is
  compared with this one.

``measure`` removes its files on every path.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch

from zero_kernels.config.offload import AioConfig
from zero_kernels.offload import IOHandle
from zero_kernels.offload.aio import file_io
from zero_kernels.offload.run_directory import allocate

PROBE_BYTES = 1 << 30


def measure(folder: str, aio: dict[str, Any], size: int = PROBE_BYTES) -> dict:
    """``disk_write_GBps``, ``disk_read_GBps``, ``disk_mixed_GBps`` and ``disk_probe`` (the engine that moved the
    bytes) of the disk under ``folder`` through the disk tier's engine with the ``aio`` block ``aio`` (DeepSpeed's
    keys, ``aio.file_io``)."""
    paths = [os.path.join(folder, f"disk_probe.{i}") for i in (0, 1)]
    io = file_io(AioConfig(**aio))
    try:
        tensors = [io.empty(size, torch.uint8) for _ in paths]
        for path, t in zip(paths, tensors):
            allocate(path, size)
            t.fill_(0x5A)  # its pages resident before the clock starts
        write_s = _timed(lambda: [io.write(paths[0], tensors[0])])
        read_s = _timed(lambda: [io.read(paths[0], tensors[1])])
        mixed_s = _timed(lambda: [io.read(paths[0], tensors[0]), io.write(paths[1], tensors[1])])
        backend = io.backend
    finally:
        io.close()
        for path in paths:
            if os.path.exists(path):
                os.remove(path)
    return {
        "disk_write_GBps": size / write_s / 1e9,
        "disk_read_GBps": size / read_s / 1e9,
        "disk_mixed_GBps": 2 * size / mixed_s / 1e9,
        "disk_probe": f"FileIO {backend}, block {aio['block_size']} B, queue depth {aio['queue_depth']}",
    }


def _timed(submit: Callable[[], list[IOHandle]]) -> float:
    """Seconds from calling ``submit`` until every request it submitted is done."""
    start = time.perf_counter()
    for handle in submit():
        handle.wait()
    return time.perf_counter() - start
