"""The torch engine: the same collectives through ``torch.distributed`` with ``async_op=True``; the
reference engine, and the fallback when the C++ engine cannot be built.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .engine_base import EngineBase, issue_errors_named
from .handles import Handle, Works
from .primitives import (
    MAX_HELD,
    P2P_KINDS,
    P2P_TAG_BASE,
    P2P_TAG_SPAN,
    REDUCE_OPS,
    CommError,
    all_gather_flat,
    reduce_scatter_flat,
)


class TorchCommEngine(EngineBase):
    """Collectives through ``torch.distributed`` (``async_op=True``); the reference engine."""

    kind = "torch"

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None):
        super().__init__(process_group)
        self._pending: list[Handle] = []
        self._tags = 0

    def _exchange(self, kind: str, what: str, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> Works:
        """Post a send of ``sends[peer]`` and a receive into ``recvs[peer]`` for every peer (group ranks), tagged with
        the operation's number and ``kind`` (``P2P_KINDS``)."""
        if any(t.is_cuda for t in sends.values()):
            raise ValueError(f"{what}: the point-to-point primitives are for CPU tensors (gloo)")
        kinds = len(P2P_KINDS)
        tag = P2P_TAG_BASE + self._tags % (P2P_TAG_SPAN // kinds) * kinds + P2P_KINDS.index(kind)
        self._tags += 1
        group = self.group
        peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        # Every receive is posted before any send: gloo tells a sender that its receiver is ready in-band,
        # on the pair's socket, so a receive posted after a send to the same peer waits behind that send's
        # bytes, and a pair's two directions take turns instead of overlapping (half the rate on a slow link).
        works = [dist.irecv(recvs[r], peer(r), group=group, tag=tag) for r in recvs]
        works += [dist.isend(sends[r], peer(r), group=group, tag=tag) for r in sends]
        return Works(works)

    def _track(self, handle: Handle) -> Handle:
        """Hold ``handle`` until it is done, so that a dropped handle still gets its epilogue.

        At most ``MAX_HELD`` are held: issuing more first waits for the oldest (a point-to-point
        operation cannot be polled: gloo's send/recv works report completion only once waited).
        """
        self._reap()
        self._pending.append(handle)
        while len(self._pending) > MAX_HELD:
            oldest = self._pending.pop(0)
            try:
                oldest.wait()
            except CommError:
                self._pending.insert(0, oldest)  # synchronize() raises it
                break
        return handle

    def _reap(self) -> None:
        keep = []
        for handle in self._pending:
            if handle.is_completed():
                try:
                    handle.wait()
                    continue
                except CommError:
                    pass
            keep.append(handle)
        self._pending = keep

    @issue_errors_named("reduce_scatter")
    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, name: str = "", primitive: Optional[str] = None
    ) -> Handle:
        """Sum ``input`` (world_size * output.numel() elements) over ranks; keep this rank's slice.

        ``input`` is scratch: its contents are undefined after the operation. ``output`` may have
        another dtype than ``input``: the sum is communicated in input's dtype and cast on the way out.
        """
        what, primitive = self._prepare("reduce_scatter", name, output, input, primitive)
        if self.world_size == 1:
            output.copy_(input)
            return Handle(None, ())
        n = output.numel()
        if primitive == "reduce_scatter_p2p":
            chunks = input.chunk(self.world_size)
            peers = [r for r in range(self.world_size) if r != self.rank]
            received = torch.empty(len(peers), n, dtype=input.dtype, device=input.device)
            works = self._exchange("reduce_scatter", what, {r: chunks[r] for r in peers}, dict(zip(peers, received)))
            mine = chunks[self.rank]

            def sum_into_output() -> None:
                mine.add_(received[0] if len(peers) == 1 else received.sum(0))
                if output.data_ptr() != mine.data_ptr() or output.dtype != mine.dtype:
                    output.copy_(mine)

            return self._track(Handle(works, (input, received, output), sum_into_output, what))
        if primitive == "all_reduce_slice":
            work = dist.all_reduce(input, group=self.group, async_op=True)
            mine = input.narrow(0, self.rank * n, n)
            return self._track(Handle(work, (input, output), lambda: output.copy_(mine), what))
        target = output if output.dtype == input.dtype else torch.empty(n, dtype=input.dtype, device=input.device)
        if primitive == "reduce_scatter_list":
            work = dist.reduce_scatter(target, list(input.chunk(self.world_size)), group=self.group, async_op=True)
        else:
            work = reduce_scatter_flat(target, input, group=self.group, async_op=True)
        epilogue = None if target is output else (lambda: copy_out(output, target))
        return self._track(Handle(work, (input, target, output), epilogue, what))

    @issue_errors_named("all_gather")
    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, name: str = "", primitive: Optional[str] = None
    ) -> Handle:
        """Concatenate every rank's ``input`` shard into ``output`` (world_size * input.numel()).

        ``input`` may have another dtype than ``output``; it is cast before it is sent.
        """
        what, primitive = self._prepare("all_gather", name, input, output, primitive)
        if self.world_size == 1:
            output.copy_(input)
            return Handle(None, ())
        source = input if input.dtype == output.dtype else input.to(output.dtype)
        if primitive == "all_gather_p2p":
            chunks = output.chunk(self.world_size)
            chunks[self.rank].copy_(source)
            peers = [r for r in range(self.world_size) if r != self.rank]
            works = self._exchange("all_gather", what, {r: source for r in peers}, {r: chunks[r] for r in peers})
            return self._track(Handle(works, (input, source, output), None, what))
        if primitive == "all_gather_list":
            work = dist.all_gather(list(output.chunk(self.world_size)), source, group=self.group, async_op=True)
        else:
            work = all_gather_flat(output, source, group=self.group, async_op=True)
        return self._track(Handle(work, (input, source, output), None, what))

    @issue_errors_named("all_reduce")
    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum", name: str = "") -> Handle:
        """Reduce ``tensor`` in place over ranks with ``op`` (sum, max or min)."""
        what = self._check_all_reduce(name, tensor, op)
        if self.world_size == 1:
            return Handle(None, ())
        work = dist.all_reduce(tensor, op=REDUCE_OPS[op], group=self.group, async_op=True)
        return self._track(Handle(work, (tensor,), None, what))

    def synchronize(self) -> None:
        """Wait for every operation issued and not yet waited on; raises the first failure."""
        pending, self._pending = self._pending, []
        errors = []
        for handle in pending:
            try:
                handle.wait()
            except CommError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def in_flight(self) -> int:
        """Operations the engine still holds (finished ones are dropped first)."""
        self._reap()
        return len(self._pending)


def copy_out(output: torch.Tensor, temporary: torch.Tensor) -> None:
    """``output.copy_(temporary)`` at ``wait()``, on the stream current then. A CUDA ``temporary`` was allocated on
    the stream current at issue, which may be another one (a wait from an autograd callback or a user's stream):
    the allocator is told of this use (``record_stream``) before the handle drops it, so that its block is not
    handed to the next allocation on the issuing stream while the copy may still read it."""
    output.copy_(temporary)
    if temporary.is_cuda:
        temporary.record_stream(torch.cuda.current_stream(temporary.device))
