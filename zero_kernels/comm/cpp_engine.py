"""The C++ engine (``csrc/comm``): it calls the c10d ``ProcessGroup`` from C++ and owns ordering and
lifetime of every operation it issues.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from .._build import ext as _ext
from .engine_base import EngineBase, issue_errors_named
from .handles import CppHandle, Handle
from .primitives import NODES_ALL_REDUCE_BYTES, NODES_PRIMITIVES, CommError, forked_message
from .shared_memory import REDUCED_DTYPES, SHM_PRIMITIVES, SUMMED_DTYPES, open_channel


class CppCommEngine(EngineBase):
    """The C++ engine (``csrc/comm``): c10d collectives issued and tracked from C++."""

    kind = "cpp"
    nodes: Optional[list[list[int]]] = None  # the ranks of each node where the exchanges run in two levels
    extra_primitives = tuple(SHM_PRIMITIVES.values())
    _shared_memory: Optional[bool] = None  # decided at the first exchange that could share (shared_memory.open_channel)

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None):
        self._ext = _ext.load("comm")
        super().__init__(process_group)
        self._engine = self._ext.Engine(self.group) if self.world_size > 1 else None
        self._side_streams: dict[int, "torch.cuda.Stream"] = {}
        self.nodes = self._nodes()
        if self.nodes is not None:  # the channel, if any, is the node's: only the two-level primitives use it
            self._engine.set_nodes(self.nodes)
            self.extra_primitives = tuple(NODES_PRIMITIVES.values())

    def _nodes(self) -> Optional[list[list[int]]]:
        """The ranks of each node when the job spans several nodes of equal size, several ranks each, and this
        engine's group is the whole world; None otherwise (unequal nodes keep the direct exchange). Collective
        on the first engine of the default group: every rank takes part in one exchange of the layout, whatever
        its own environment says (a rank without ``LOCAL_WORLD_SIZE`` too), so all of them decide alike."""
        if self._engine is None or self.group is not dist.group.WORLD:
            return None
        from .groups import node_layout

        rows = node_layout()
        return rows if rows is not None and len(rows) > 1 and len(rows[0]) > 1 else None

    def primitive_for(self, operation: str, tensor: torch.Tensor) -> str:
        """As ``EngineBase.primitive_for``; across nodes the point-to-point forms run in two levels (the level within
        each node through the node's shared memory where its ranks can), on one host through shared memory where the
        ranks can (collective at the first exchange that could)."""
        primitive = super().primitive_for(operation, tensor)
        if self.nodes is not None:
            return NODES_PRIMITIVES.get(primitive, primitive)
        if self._shareable(operation, tensor) and self.shares_memory():
            return SHM_PRIMITIVES[primitive]
        return primitive

    def shares_memory(self, what: str = "") -> bool:
        """Whether this engine's ranks exchange through shared memory (across nodes: the ranks of each node, within
        it): decided by all of them at the first call (collective), the same answer after. ``what`` names the
        operation that asked, in errors."""
        if self._shared_memory is None:
            if self._engine is None:
                return False
            self._shared_memory = False  # the decision's own exchanges go through the sockets
            try:
                self._shared_memory = open_channel(self)
            except CommError as exc:
                raise CommError(f"{what} failed: {exc}" if what else str(exc)) from exc
        return self._shared_memory

    def _shareable(self, operation: str, tensor: torch.Tensor) -> bool:
        """Whether ``operation`` on a bucket like ``tensor`` runs through shared memory where the channel is open."""
        primitive = super().primitive_for(operation, tensor)
        summed = operation == "all_gather" or tensor.dtype in SUMMED_DTYPES
        return primitive in SHM_PRIMITIVES and summed

    def _prepare(
        self, operation: str, name: str, shard: torch.Tensor, full: torch.Tensor, primitive: Optional[str]
    ) -> tuple[str, str]:
        """As ``EngineBase._prepare``; the first exchange that could run through shared memory decides first."""
        if self._shared_memory is None:
            what = self.describe(operation, name)
            self._ensure_group(what)
            asked = primitive in SHM_PRIMITIVES.values()
            if asked or (primitive is None and self._shareable(operation, full)):
                self.shares_memory(what)
        return super()._prepare(operation, name, shard, full, primitive)

    def _streams(self, tensor: torch.Tensor) -> tuple[int, int, Optional["torch.cuda.Stream"]]:
        if not tensor.is_cuda:
            return 0, 0, None
        device = tensor.device.index
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device=device)
        side = self._side_streams[device]
        return torch.cuda.current_stream(device).cuda_stream, side.cuda_stream, side

    def _issue(self, method: str, tensor: torch.Tensor, *args) -> CppHandle:
        """Call the C++ engine; on CUDA with the side stream current, ``tensor``'s current stream as compute."""
        compute, side_handle, side = self._streams(tensor)
        call = getattr(self._engine, method)
        if side is None:
            return CppHandle(call(*args, compute_stream=0, side_stream=0))
        with torch.cuda.stream(side):
            return CppHandle(call(*args, compute_stream=compute, side_stream=side_handle, side=side), side)

    @issue_errors_named("reduce_scatter")
    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, name: str = "", primitive: Optional[str] = None
    ) -> Handle:
        """As ``TorchCommEngine.reduce_scatter``; the C++ engine holds the buffers until it is done."""
        _, primitive = self._prepare("reduce_scatter", name, output, input, primitive)
        if self.world_size == 1:
            output.copy_(input)
            return Handle(None, ())
        return self._issue("reduce_scatter", input, output, input, name, getattr(self._ext.Primitive, primitive))

    @issue_errors_named("all_gather")
    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, name: str = "", primitive: Optional[str] = None
    ) -> Handle:
        """As ``TorchCommEngine.all_gather``; the C++ engine holds the buffers until it is done."""
        _, primitive = self._prepare("all_gather", name, input, output, primitive)
        if self.world_size == 1:
            output.copy_(input)
            return Handle(None, ())
        return self._issue("all_gather", output, output, input, name, getattr(self._ext.Primitive, primitive))

    @issue_errors_named("all_reduce")
    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum", name: str = "") -> Handle:
        """Reduce ``tensor`` in place over ranks with ``op`` (sum, max or min); through shared memory where the ranks
        share it (``shares_memory``; its floating-point sums are taken in another order than gloo's); across nodes a
        large floating-point sum in two levels (``_two_levels``; another order again)."""
        what = self._check_all_reduce(name, tensor, op)
        if self.world_size == 1:
            return Handle(None, ())
        if self._two_levels(tensor, op):
            return CppHandle(self._engine.all_reduce_nodes(tensor, name))
        shareable = self.nodes is None and self._shareable("all_gather", tensor)
        if tensor.dtype in REDUCED_DTYPES and shareable and self.shares_memory(what):
            return CppHandle(self._engine.all_reduce(tensor, op, name, shared_memory=True))
        return self._issue("all_reduce", tensor, tensor, op, name)

    def _two_levels(self, tensor: torch.Tensor, op: str) -> bool:
        """Whether ``all_reduce`` sums ``tensor`` in two levels along the nodes (``NODES_ALL_REDUCE_BYTES``)."""
        big = tensor.numel() * tensor.element_size() >= NODES_ALL_REDUCE_BYTES
        return self.nodes is not None and op == "sum" and tensor.dtype in SUMMED_DTYPES and not tensor.is_cuda and big

    def synchronize(self) -> None:
        """Wait for every operation issued so far; raises the first failure among them."""
        if self._engine is None:
            return
        if os.getpid() != self.pid and self._engine.in_flight():  # a fork's copy of the parent's operations
            raise CommError(forked_message("zero_kernels comm: synchronize", self.pid))
        try:
            self._engine.synchronize()
        except RuntimeError as exc:
            raise CommError(str(exc)) from exc

    def in_flight(self) -> int:
        """Operations the C++ engine still holds (finished ones are dropped first)."""
        return 0 if self._engine is None else self._engine.in_flight()
