"""Asynchronous, ordered collectives for the stage pipelines: the Python face of the comm engine.

``CommEngine(process_group)`` issues reduce-scatter, all-gather and all-reduce asynchronously and
returns a ``Handle`` per operation; ``handle.wait()`` completes it. Buffers passed in are kept alive
by the handle until it is waited on. With no process group initialised the world size is 1 and
every operation is a local copy that is complete on return.

Backends (``ZERO_KERNELS_COMM``): ``cpp`` is the C++ engine in ``csrc/comm``; ``torch`` issues the
same collectives through ``torch.distributed`` with ``async_op=True``; ``auto`` prefers ``cpp``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Handle:
    """One in-flight collective; ``wait()`` completes it (idempotent) and runs its epilogue."""

    def __init__(self, work: Optional[dist.Work], keep_alive: tuple, epilogue: Optional[Callable[[], None]] = None):
        self._work = work
        self._keep_alive = keep_alive
        self._epilogue = epilogue
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            self._work.wait()
        if self._epilogue is not None:
            self._epilogue()
        self._done = True
        self._work = self._epilogue = None
        self._keep_alive = ()

    def is_completed(self) -> bool:
        return self._done or self._work is None or self._work.is_completed()


def _check_flat(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"comm: {name} must be contiguous")


class TorchCommEngine:
    """Collectives through ``torch.distributed`` (``async_op=True``); the reference engine."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None):
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = process_group if process_group is not None else (dist.group.WORLD if self.distributed else None)
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1
        self.backend = dist.get_backend(self.group) if self.distributed else "local"

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, name: str = "") -> Handle:
        """Sum ``input`` (world_size * output.numel() elements) over ranks; keep this rank's slice.

        ``input`` is scratch: its contents are undefined after the operation.
        """
        _check_flat("reduce_scatter output", output)
        _check_flat("reduce_scatter input", input)
        if input.numel() != output.numel() * self.world_size:
            raise ValueError(
                f"comm: reduce_scatter '{name}': input has {input.numel()} elements, expected "
                f"{self.world_size} x {output.numel()}"
            )
        if self.world_size == 1:
            output.copy_(input)
            return Handle(None, ())
        if self.backend == "gloo":
            work = dist.all_reduce(input, group=self.group, async_op=True)
            mine = input.narrow(0, self.rank * output.numel(), output.numel())
            return Handle(work, (input, output), lambda: output.copy_(mine))
        work = dist.reduce_scatter_tensor(output, input, group=self.group, async_op=True)
        return Handle(work, (input, output))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, name: str = "") -> Handle:
        """Concatenate every rank's ``input`` shard into ``output`` (world_size * input.numel())."""
        _check_flat("all_gather output", output)
        _check_flat("all_gather input", input)
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(
                f"comm: all_gather '{name}': output has {output.numel()} elements, expected "
                f"{self.world_size} x {input.numel()}"
            )
        if self.world_size == 1:
            output.copy_(input)
            return Handle(None, ())
        work = dist.all_gather_into_tensor(output, input, group=self.group, async_op=True)
        return Handle(work, (input, output))

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum", name: str = "") -> Handle:
        """Reduce ``tensor`` in place over ranks with ``op`` (sum, max or min)."""
        if op not in REDUCE_OPS:
            raise ValueError(f"comm: all_reduce op {op!r}; allowed: {', '.join(REDUCE_OPS)}")
        if self.world_size == 1:
            return Handle(None, ())
        work = dist.all_reduce(tensor, op=REDUCE_OPS[op], group=self.group, async_op=True)
        return Handle(work, (tensor,))

    def synchronize(self) -> None:
        """Nothing to do here: every handle is waited on by its owner."""


def make_engine(process_group: Optional[dist.ProcessGroup] = None, backend: Optional[str] = None) -> TorchCommEngine:
    """The engine chosen by ``backend`` or ``ZERO_KERNELS_COMM`` (auto, cpp, torch)."""
    from .env import settings

    choice = backend or settings().comm
    if choice not in ("auto", "torch"):
        raise ValueError(f"comm backend {choice!r} is not available yet; allowed: auto, torch")
    return TorchCommEngine(process_group)
