"""The collective-order audit: every rank of a distributed test must issue the same collectives in the same order.

Collectives pair up in issue order, so ranks that issue different sequences crash inside the backend,
hang, or (same kinds and sizes) silently mix data. ``install()`` (run in every rank ``tests.helpers.dist`` spawns)
wraps the comm engines' collectives to record ``(op, numel)`` per process group, in issue order, and
``Pipeline.step`` to audit after every step that returns: the ranks of the pipeline's group exchange
what they recorded since the last audit, and every rank raises ``AssertionError`` naming the first
difference unless all recorded the same. So every distributed test model is audited at every step.

``audited(group)`` gives what each audit compared (one list of ``(op, numel, name)`` per step), for
tests that count collectives.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Optional

import torch.distributed as dist

from zero_kernels import comm
from zero_kernels.stages.base import Pipeline

Record = tuple[str, int, str]  # (op, numel of the full buffer, the bucket's name)

_pending: "weakref.WeakKeyDictionary[Any, list[Record]]" = weakref.WeakKeyDictionary()
_history: "weakref.WeakKeyDictionary[Any, list[list[Record]]]" = weakref.WeakKeyDictionary()
_installed = False


def _group(engine: Any) -> Optional[Any]:
    ref = getattr(engine, "_group", None)
    return ref() if ref is not None else None


def _full(op: str, args: tuple, kwargs: dict) -> Any:
    """The tensor whose size names the collective: the full buffer (all-reduce: the tensor)."""
    if op == "all_reduce":
        return kwargs.get("tensor", args[0] if args else None)
    if op == "reduce_scatter":
        return kwargs.get("input", args[1] if len(args) > 1 else None)
    return kwargs.get("output", args[0] if args else None)


def _recording(op: str, method: Callable) -> Callable:
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        group = _group(self)
        if self.world_size > 1 and group is not None:
            full = _full(op, args, kwargs)
            _pending.setdefault(group, []).append((op, int(full.numel()), kwargs.get("name", "")))
        return method(self, *args, **kwargs)

    call._audited = True
    return call


def _describe(everyone: list[list[Record]]) -> str:
    at = 0
    while all(at < len(r) for r in everyone) and len({r[at][:2] for r in everyone}) == 1:
        at += 1
    lines = []
    for rank, records in enumerate(everyone):
        shown = ", ".join(f"{op} {numel} ({name})" for op, numel, name in records[max(0, at - 2) : at + 3])
        lines.append(f"rank {rank} ({len(records)} collectives): ...{shown}")
    return f"the ranks issued different collectives since the last step, first at #{at}:\n" + "\n".join(lines)


def audit(engine: Any) -> None:
    """Compare what every rank of ``engine``'s group recorded since the last audit (a collective over it).

    The exchange goes straight through ``torch.distributed``, not through the engine: tests that spy on an
    engine's collectives or on the package's host reads see only the optimizer's own."""
    group = _group(engine)
    if engine.world_size == 1 or group is None:
        return
    mine = _pending.pop(group, [])
    everyone: list[Any] = [None] * engine.world_size
    dist.all_gather_object(everyone, mine, group=group)
    _history.setdefault(group, []).append(mine)
    if any([r[:2] for r in records] != [r[:2] for r in mine] for records in everyone):
        raise AssertionError(f"collective-order audit on rank {engine.rank}: {_describe(everyone)}")


def audited(group: Any) -> list[list[Record]]:
    """What each audit of ``group`` compared, one list per step, oldest first."""
    return _history.get(group, [])


def install() -> None:
    """Record the engines' collectives and audit after every ``Pipeline.step`` (in this process, once)."""
    global _installed
    if _installed:
        return
    _installed = True
    for engine_class in (comm.TorchCommEngine, comm.CppCommEngine):
        for op in ("reduce_scatter", "all_gather", "all_reduce"):
            setattr(engine_class, op, _recording(op, getattr(engine_class, op)))
    step = Pipeline.step

    @functools.wraps(step)
    def audited_step(self: Pipeline, *args: Any, **kwargs: Any) -> Any:
        result = step(self, *args, **kwargs)
        audit(self.engine)
        return result

    Pipeline.step = audited_step
