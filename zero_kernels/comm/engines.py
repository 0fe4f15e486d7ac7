"""Asynchronous, ordered collectives for the stage pipelines: the Python face of the comm engine.

``make_engine(process_group)`` returns an engine that issues reduce-scatter, all-gather and
all-reduce asynchronously and returns a ``Handle`` per operation; ``handle.wait()`` completes it
and raises ``CommError`` naming the operation, bucket and rank when the collective failed or timed
out (the process group's timeout applies). Buffers passed in stay alive until the collective has
finished, even when the caller drops them. With no process group, or a group of one rank, every
operation is a local copy that is complete on return.

Engines (``ZERO_KERNELS_COMM``): ``cpp`` is the C++ engine in ``csrc/comm`` (it calls the c10d
``ProcessGroup`` from C++ and owns ordering and lifetime); ``torch`` issues the same collectives
through ``torch.distributed`` with ``async_op=True`` and is the reference; ``auto`` prefers
``cpp`` and falls back to ``torch`` with one log line when the extension cannot be built.

On CPU (gloo) collectives run on gloo's own threads, so they overlap with compute on the calling
thread; ``wait()`` blocks (without the GIL). Where every rank of the group is on one host, the C++
engine's reduce-scatter and all-gather go through a shared-memory segment instead, on a thread of its
own (``shared_memory``); across nodes, their level within each node goes through that node's segment.
On CUDA (NCCL) collectives run on the process group's
internal stream and overlap is event-based: the C++ engine issues each operation with a side stream
current (the process group's stream follows the current stream) after making that side stream wait
for the caller's current (compute) stream, so a collective never reads a buffer before the kernels
queued to write it; casts into and out of communication buffers run on the side stream, an
operation is finished (``wait()``, ``synchronize()``, the engine's destructor) with that side
stream current whatever stream the caller has current, and ``wait()`` makes the caller's current
stream wait for it (as well as the stream current at issue), never the host.

Each operation is carried out by the fastest correct c10d primitive for its backend and size, as
measured by ``python -m benchmarks comm`` (``PRIMITIVES``); ``primitive=`` overrides the choice.
"""

from __future__ import annotations

from typing import Optional, Union

import torch.distributed as dist

from .._build import ext as _ext
from .cpp_engine import CppCommEngine
from .torch_engine import TorchCommEngine

CommEngine = Union[TorchCommEngine, CppCommEngine]
ENGINES = {"torch": TorchCommEngine, "cpp": CppCommEngine}


def make_engine(process_group: Optional[dist.ProcessGroup] = None, backend: Optional[str] = None) -> CommEngine:
    """The engine chosen by ``backend`` or ``ZERO_KERNELS_COMM``: auto, cpp or torch.

    ``cpp`` raises ``ExtensionUnavailable`` when the C++ engine cannot be built; ``auto`` then
    falls back to the torch engine and logs why, once.
    """
    from ..env import COMM_BACKENDS, settings

    choice = backend or settings().comm
    if choice not in COMM_BACKENDS:
        raise ValueError(f"comm backend {choice!r}; allowed: {', '.join(COMM_BACKENDS)}")
    if choice == "auto":
        try:
            _ext.load("comm")
        except _ext.ExtensionUnavailable as exc:
            _ext.warn_once(f"{exc}; zero_kernels comm uses the torch engine")
            choice = "torch"
        else:
            choice = "cpp"
    return ENGINES[choice](process_group)
