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
thread; ``wait()`` blocks (without the GIL). On CUDA (NCCL) collectives run on the process group's
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

import functools
import logging
import weakref
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from .._build import ext as _ext

log = logging.getLogger("zero_kernels")

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

REDUCE_SCATTER_PRIMITIVES = ("all_reduce_slice", "reduce_scatter_list", "reduce_scatter_tensor", "reduce_scatter_p2p")
ALL_GATHER_PRIMITIVES = ("all_gather_list", "all_gather_tensor", "all_gather_p2p")
# The *_p2p primitives are sends and receives between every pair of ranks (CPU tensors only): each
# chunk crosses one link once, which on gloo beats its collectives (see PRIMITIVES). Their tags come
# from a range of their own, one per operation in issue order.
P2P_TAG_BASE, P2P_TAG_SPAN = 1 << 30, 1 << 29
MAX_HELD = 16  # operations an engine holds at most (the C++ engine's Engine::kMaxHeld)

# (backend, operation) -> rows (largest bucket in bytes or None for any size, primitive); the first
# row whose bound holds wins. The gloo rows come from `python -m benchmarks comm --full` and a probe
# on 2 and 3 ranks (256 KiB to 16 MiB) on a 2-core machine: the point-to-point forms were the
# fastest at every size (reduce-scatter 1.3x to 12x faster than all_reduce + slice, which beat
# gloo's own reduce_scatter; all-gather 1.06x to 2x faster than the better collective form). CUDA
# tensors on gloo use DEFAULT_PRIMITIVES, as do backends not listed.
PRIMITIVES: dict[tuple[str, str], list[tuple[Optional[int], str]]] = {
    ("gloo", "reduce_scatter"): [(None, "reduce_scatter_p2p")],
    ("gloo", "all_gather"): [(None, "all_gather_p2p")],
}
DEFAULT_PRIMITIVES = {"reduce_scatter": "reduce_scatter_tensor", "all_gather": "all_gather_tensor"}

# torch >= 2.13 names the flat collectives *_single and deprecates the older names.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CommError(RuntimeError):
    """A collective failed or timed out; the message names the operation, bucket and rank."""


def choose_primitive(backend: str, operation: str, nbytes: int) -> str:
    """The c10d primitive that carries out ``operation`` ("reduce_scatter" or "all_gather")."""
    for bound, primitive in PRIMITIVES.get((backend, operation), []):
        if bound is None or nbytes <= bound:
            return primitive
    return DEFAULT_PRIMITIVES[operation]


def _describe_choices(backend: str) -> str:
    parts = []
    for operation in DEFAULT_PRIMITIVES:
        rows = PRIMITIVES.get((backend, operation), [(None, DEFAULT_PRIMITIVES[operation])])
        parts.append(f"{operation}=" + ",".join(p if b is None else f"{p}(<={b}B)" for b, p in rows))
    return " ".join(parts)


class Handle:
    """One in-flight collective; ``wait()`` completes it (idempotent) and runs its epilogue."""

    def __init__(
        self,
        work: Union[dist.Work, "_Works", None],
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

    def wait(self) -> None:
        if not self._done:
            try:
                if self._work is not None:
                    self._work.wait()
                if self._epilogue is not None:
                    self._epilogue()
            except Exception as exc:  # the backend's own error type varies (RuntimeError, DistBackendError)
                self._error = CommError(f"{self._what} failed: {exc}")
                self._error.__cause__ = exc
            self._done = True
            self._work = self._epilogue = None
            self._keep_alive = ()
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        return self._done or self._work is None or self._work.is_completed()


class _Works:
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

    def __init__(self, op, side_stream: Optional["torch.cuda.Stream"] = None):
        super().__init__(None, (), what=op.what)
        self._op = op
        self._side = side_stream

    def wait(self) -> None:
        try:
            self._op.wait()
        except RuntimeError as exc:
            raise CommError(str(exc)) from exc
        if self._side is not None:
            torch.cuda.current_stream(self._side.device).wait_stream(self._side)

    def is_completed(self) -> bool:
        return self._op.is_completed()


def _issue_errors_named(operation: str) -> Callable:
    """Turn a backend error raised while ``operation`` is issued into a ``CommError`` naming it.

    A peer that died makes gloo fail already when an operation is posted (sends and receives), not
    only in ``wait()``; the caller then sees the same error type either way.
    """

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def issue(self: "_EngineBase", *args: Any, name: str = "", **kwargs: Any) -> Handle:
            try:
                return method(self, *args, name=name, **kwargs)
            except CommError:
                raise
            except RuntimeError as exc:  # RuntimeError, DistBackendError: a ValueError is a bad argument
                raise CommError(f"{self.describe(operation, name)} failed: {exc}") from exc

        return issue

    return wrap


def _check_pair(what: str, shard: torch.Tensor, full: torch.Tensor, world_size: int) -> None:
    for role, t in (("shard", shard), ("full buffer", full)):
        if not t.is_contiguous():
            raise ValueError(f"{what}: the {role} must be contiguous")
    if full.numel() != shard.numel() * world_size:
        raise ValueError(
            f"{what}: full buffer has {full.numel()} elements, expected {world_size} x {shard.numel()} (shard elements)"
        )


def _check_primitive(what: str, primitive: str, allowed: tuple[str, ...]) -> None:
    if primitive not in allowed:
        raise ValueError(f"{what}: primitive {primitive!r}; allowed: {', '.join(allowed)}")


class _EngineBase:
    """Rank facts, argument checks and the world-size-1 path shared by both engines."""

    kind = ""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None):
        self.distributed = dist.is_available() and dist.is_initialized()
        group = process_group if process_group is not None else (dist.group.WORLD if self.distributed else None)
        self._group = None if group is None else weakref.ref(group)
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.backend = dist.get_backend(group) if self.distributed else "local"
        log.info(
            "zero_kernels comm: %s engine on %s, rank %d of %d; primitives: %s",
            self.kind,
            self.backend,
            self.rank,
            self.world_size,
            _describe_choices(self.backend),
        )

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The process group (None without one). Held weakly, so that ``destroy_process_group()`` really
        destroys it, and with it the backend's threads, while an optimizer is still alive."""
        return self._ensure_group("zero_kernels comm")

    def _ensure_group(self, what: str) -> Optional[dist.ProcessGroup]:
        if self._group is None:
            return None
        group = self._group()
        if group is None:
            raise CommError(
                f"{what}: the process group of this {self.kind} engine was destroyed; "
                "create the optimizer again after init_process_group"
            )
        return group

    def describe(self, operation: str, name: str) -> str:
        return (
            f"zero_kernels comm: {operation} of bucket '{name}' on rank {self.rank} of {self.world_size} "
            f"({self.backend})"
        )

    def primitive_for(self, operation: str, tensor: torch.Tensor) -> str:
        """The primitive this engine uses for ``operation`` on a bucket like ``tensor`` (the full buffer)."""
        primitive = choose_primitive(self.backend, operation, tensor.numel() * tensor.element_size())
        return DEFAULT_PRIMITIVES[operation] if tensor.is_cuda and primitive.endswith("_p2p") else primitive

    def _prepare(
        self, operation: str, name: str, shard: torch.Tensor, full: torch.Tensor, primitive: Optional[str]
    ) -> tuple[str, str]:
        what = self.describe(operation, name)
        self._ensure_group(what)
        _check_pair(what, shard, full, self.world_size)
        if primitive is None:
            primitive = self.primitive_for(operation, full)
        allowed = REDUCE_SCATTER_PRIMITIVES if operation == "reduce_scatter" else ALL_GATHER_PRIMITIVES
        _check_primitive(what, primitive, allowed)
        return what, primitive

    def _check_all_reduce(self, name: str, tensor: torch.Tensor, op: str) -> str:
        what = self.describe("all_reduce", name)
        self._ensure_group(what)
        if op not in REDUCE_OPS:
            raise ValueError(f"{what}: op {op!r}; allowed: {', '.join(REDUCE_OPS)}")
        if not tensor.is_contiguous():
            raise ValueError(f"{what}: the tensor must be contiguous")
        return what


class TorchCommEngine(_EngineBase):
    """Collectives through ``torch.distributed`` (``async_op=True``); the reference engine."""

    kind = "torch"

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None):
        super().__init__(process_group)
        self._pending: list[Handle] = []
        self._tags = 0

    def _exchange(self, what: str, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> _Works:
        """Post a send of ``sends[peer]`` and a receive into ``recvs[peer]`` for every peer (group ranks)."""
        if any(t.is_cuda for t in sends.values()):
            raise ValueError(f"{what}: the point-to-point primitives are for CPU tensors (gloo)")
        tag = P2P_TAG_BASE + self._tags % P2P_TAG_SPAN
        self._tags += 1
        group = self.group
        peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        # Every receive is posted before any send: gloo tells a sender that its receiver is ready in-band,
        # on the pair's socket, so a receive posted after a send to the same peer waits behind that send's
        # bytes, and a pair's two directions take turns instead of overlapping (half the rate on a slow link).
        works = [dist.irecv(recvs[r], peer(r), group=group, tag=tag) for r in recvs]
        works += [dist.isend(sends[r], peer(r), group=group, tag=tag) for r in sends]
        return _Works(works)

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

    @_issue_errors_named("reduce_scatter")
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
            works = self._exchange(what, {r: chunks[r] for r in peers}, dict(zip(peers, received)))
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
            work = _reduce_scatter_flat(target, input, group=self.group, async_op=True)
        epilogue = None if target is output else (lambda: output.copy_(target))
        return self._track(Handle(work, (input, target, output), epilogue, what))

    @_issue_errors_named("all_gather")
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
            works = self._exchange(what, {r: source for r in peers}, {r: chunks[r] for r in peers})
            return self._track(Handle(works, (input, source, output), None, what))
        if primitive == "all_gather_list":
            work = dist.all_gather(list(output.chunk(self.world_size)), source, group=self.group, async_op=True)
        else:
            work = _all_gather_flat(output, source, group=self.group, async_op=True)
        return self._track(Handle(work, (input, source, output), None, what))

    @_issue_errors_named("all_reduce")
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


class CppCommEngine(_EngineBase):
    """The C++ engine (``csrc/comm``): c10d collectives issued and tracked from C++."""

    kind = "cpp"

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None):
        self._ext = _ext.load("comm")
        super().__init__(process_group)
        self._engine = self._ext.Engine(self.group) if self.world_size > 1 else None
        self._side_streams: dict[int, "torch.cuda.Stream"] = {}

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

    @_issue_errors_named("reduce_scatter")
    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, name: str = "", primitive: Optional[str] = None
    ) -> Handle:
        """As ``TorchCommEngine.reduce_scatter``; the C++ engine holds the buffers until it is done."""
        _, primitive = self._prepare("reduce_scatter", name, output, input, primitive)
        if self.world_size == 1:
            output.copy_(input)
            return Handle(None, ())
        return self._issue("reduce_scatter", input, output, input, name, getattr(self._ext.Primitive, primitive))

    @_issue_errors_named("all_gather")
    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, name: str = "", primitive: Optional[str] = None
    ) -> Handle:
        """As ``TorchCommEngine.all_gather``; the C++ engine holds the buffers until it is done."""
        _, primitive = self._prepare("all_gather", name, input, output, primitive)
        if self.world_size == 1:
            output.copy_(input)
            return Handle(None, ())
        return self._issue("all_gather", output, output, input, name, getattr(self._ext.Primitive, primitive))

    @_issue_errors_named("all_reduce")
    def all_reduce(self, tensor: torch.Tensor, *, op: str = "sum", name: str = "") -> Handle:
        """Reduce ``tensor`` in place over ranks with ``op`` (sum, max or min)."""
        self._check_all_reduce(name, tensor, op)
        if self.world_size == 1:
            return Handle(None, ())
        return self._issue("all_reduce", tensor, tensor, op, name)

    def synchronize(self) -> None:
        """Wait for every operation issued so far; raises the first failure among them."""
        if self._engine is None:
            return
        try:
            self._engine.synchronize()
        except RuntimeError as exc:
            raise CommError(str(exc)) from exc

    def in_flight(self) -> int:
        """Operations the C++ engine still holds (finished ones are dropped first)."""
        return 0 if self._engine is None else self._engine.in_flight()


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
