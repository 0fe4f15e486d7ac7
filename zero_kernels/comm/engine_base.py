"""What both engines share: rank facts, argument checks, error naming and the world-size-1 path."""

from __future__ import annotations

import functools
import logging
import os
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .handles import Handle
from .primitives import (
    ALL_GATHER_PRIMITIVES,
    DEFAULT_PRIMITIVES,
    REDUCE_OPS,
    REDUCE_SCATTER_PRIMITIVES,
    CommError,
    choose_primitive,
    describe_choices,
    forked_message,
)

log = logging.getLogger("zero_kernels")


def issue_errors_named(operation: str) -> Callable:
    """Turn a backend error raised while ``operation`` is issued into a ``CommError`` naming it.

    A peer that died makes gloo fail already when an operation is posted (sends and receives), not
    only in ``wait()``; the caller then sees the same error type either way.
    """

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def issue(self: "EngineBase", *args: Any, name: str = "", **kwargs: Any) -> Handle:
            try:
                return method(self, *args, name=name, **kwargs)
            except CommError:
                raise
            except RuntimeError as exc:  # RuntimeError, DistBackendError: a ValueError is a bad argument
                raise CommError(f"{self.describe(operation, name)} failed: {exc}") from exc

        return issue

    return wrap


def backend_of(group: Optional[dist.ProcessGroup]) -> str:
    """The backend that carries the data of ``group``: ``dist.get_backend``, or where that names none
    (``init_process_group()`` without a backend gives "undefined"; a per-device string such as
    "cpu:gloo,cuda:nccl") the one the group uses for CUDA tensors where CUDA is there, else for CPU ones."""
    return resolve_backend(dist.get_backend(group), dist.get_backend_config(group), torch.cuda.is_available())


def resolve_backend(name: str, config: str, cuda: bool) -> str:
    """``backend_of`` given the group's backend name, its per-device config ("cpu:gloo,cuda:nccl") and whether
    CUDA is there."""
    if name != "undefined" and ":" not in name:
        return name
    per_device = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
    fallback = per_device.get("cpu") or next(iter(per_device.values()), name)
    return per_device.get("cuda" if cuda else "cpu", fallback)


def _global_ranks(group: Optional[dist.ProcessGroup], distributed: bool) -> Optional[tuple[int, ...]]:
    """The global rank of each of ``group``'s ranks, in its order, where the group numbers its ranks apart from the
    job's (``dist.get_process_group_ranks``); None where its rank r is global rank r."""
    if not distributed:
        return None
    ranks = tuple(dist.get_process_group_ranks(group))
    return None if ranks == tuple(range(dist.get_world_size())) else ranks


def check_pair(what: str, shard: torch.Tensor, full: torch.Tensor, world_size: int) -> None:
    for role, t in (("shard", shard), ("full buffer", full)):
        if not t.is_contiguous():
            raise ValueError(f"{what}: the {role} must be contiguous")
    if full.numel() != shard.numel() * world_size:
        raise ValueError(
            f"{what}: full buffer has {full.numel()} elements, expected {world_size} x {shard.numel()} (shard elements)"
        )


def check_primitive(what: str, primitive: str, allowed: tuple[str, ...]) -> None:
    if primitive not in allowed:
        raise ValueError(f"{what}: primitive {primitive!r}; allowed: {', '.join(allowed)}")


class EngineBase:
    """Rank facts, argument checks and the world-size-1 path shared by both engines."""

    kind = ""
    extra_primitives: tuple[str, ...] = ()  # primitives this engine has beyond the shared ones

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None):
        self.distributed = dist.is_available() and dist.is_initialized()
        self.pid = os.getpid()  # the process whose ranks this engine's collectives pair with (``_ensure_group``)
        group = process_group if process_group is not None else (dist.group.WORLD if self.distributed else None)
        self._group = None if group is None else weakref.ref(group)
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.global_ranks = _global_ranks(group, self.distributed)  # for messages that name other ranks
        own = "" if self.global_ranks is None else f" (global rank {self.global_ranks[self.rank]})"
        self.where = f"rank {self.rank} of {self.world_size}{own}"  # this rank, for messages
        self.backend = backend_of(group) if self.distributed else "local"
        log.info(
            "zero_kernels comm: %s engine on %s, rank %d of %d; primitives: %s",
            self.kind,
            self.backend,
            self.rank,
            self.world_size,
            describe_choices(self.backend),
        )

    def late_world_size(self) -> int:
        """The default group's size where this engine was built before ``init_process_group`` and torch.distributed
        is initialised now (its optimizer then trains this process's parameters alone), else 0."""
        if self.distributed or not (dist.is_available() and dist.is_initialized()):
            return 0
        return dist.get_world_size()

    def launched_world_size(self) -> int:
        """``WORLD_SIZE`` where a launcher (``torchrun``) started several processes but torch.distributed was never
        initialised and this engine has no group (its optimizer then trains this process's parameters alone),
        else 0."""
        if self.distributed or (dist.is_available() and dist.is_initialized()):
            return 0
        value = os.environ.get("WORLD_SIZE", "").strip()
        return int(value) if value.isdigit() and int(value) > 1 else 0

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The process group (None without one). Held weakly, so that ``destroy_process_group()`` really
        destroys it, and with it the backend's threads, while an optimizer is still alive."""
        return self._ensure_group("zero_kernels comm")

    @property
    def group_held(self) -> Optional[dist.ProcessGroup]:
        """The process group object for what runs no collective (a copy or a pickle of the optimizer naming it): as
        ``group``, without refusing a forked process (``forked_message``: a checkpoint writer forked from the
        training process may pickle the optimizer)."""
        group = None if self._group is None else self._group()
        return group if group is not None else self._ensure_group("zero_kernels comm")  # a destroyed one: its error

    def _ensure_group(self, what: str) -> Optional[dist.ProcessGroup]:
        if self._group is None:
            return None
        if os.getpid() != self.pid:
            raise CommError(forked_message(what, self.pid))
        group = self._group()
        if group is None:
            raise CommError(
                f"{what}: the process group of this {self.kind} engine was destroyed; "
                "create the optimizer again after init_process_group"
            )
        return group

    def describe(self, operation: str, name: str) -> str:
        return f"zero_kernels comm: {operation} of bucket '{name}' on {self.where} ({self.backend})"

    def primitive_for(self, operation: str, tensor: torch.Tensor) -> str:
        """The primitive this engine uses for ``operation`` on a bucket like ``tensor`` (the full buffer)."""
        primitive = choose_primitive(self.backend, operation, tensor.numel() * tensor.element_size())
        return DEFAULT_PRIMITIVES[operation] if tensor.is_cuda and primitive.endswith("_p2p") else primitive

    def _prepare(
        self, operation: str, name: str, shard: torch.Tensor, full: torch.Tensor, primitive: Optional[str]
    ) -> tuple[str, str]:
        what = self.describe(operation, name)
        self._ensure_group(what)
        check_pair(what, shard, full, self.world_size)
        if primitive is None:
            primitive = self.primitive_for(operation, full)
        allowed = REDUCE_SCATTER_PRIMITIVES if operation == "reduce_scatter" else ALL_GATHER_PRIMITIVES
        check_primitive(what, primitive, allowed + tuple(p for p in self.extra_primitives if p.startswith(operation)))
        return what, primitive

    def _check_all_reduce(self, name: str, tensor: torch.Tensor, op: str) -> str:
        what = self.describe("all_reduce", name)
        self._ensure_group(what)
        if op not in REDUCE_OPS:
            raise ValueError(f"{what}: op {op!r}; allowed: {', '.join(REDUCE_OPS)}")
        if not tensor.is_contiguous():
            raise ValueError(f"{what}: the tensor must be contiguous")
        return what
