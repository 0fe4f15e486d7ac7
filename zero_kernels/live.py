"""The live ``ShardedFusedAdam`` optimizers of this process, and which of them trains a parameter.

Code that meets parameters without meeting the optimizer (torch's gradient clipping, a
``DistributedDataParallel`` wrapper, Accelerate's ``prepare``) asks here whether a sharded
optimizer trains them. Optimizers are held weakly: one that is garbage collected is forgotten.
When two live optimizers hold the same parameter, the one built last is its owner (as for the
gradient hooks, ``stages.base``).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Iterable

import torch

_live: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()  # optimizer -> construction order
_order = itertools.count()


def register(optimizer: Any) -> None:
    """Remember ``optimizer`` (a ``ShardedFusedAdam``) for as long as it lives."""
    _live[optimizer] = next(_order)


def forget(optimizer: Any) -> None:
    """Stop counting ``optimizer`` (taken off its model) as live."""
    _live.pop(optimizer, None)


def optimizers() -> list[Any]:
    """The live optimizers, oldest first."""
    return [opt for opt, _ in sorted(_live.items(), key=lambda item: item[1])]


def params_of(optimizer: Any) -> list[torch.Tensor]:
    """The parameters ``optimizer`` trains (every param group)."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def owners() -> dict[int, Any]:
    """``id(parameter)`` -> the live optimizer that trains it (the one built last, where several do)."""
    found: dict[int, Any] = {}
    for opt in optimizers():
        found.update((id(p), opt) for p in params_of(opt))
    return found


def owned(optimizer: Any, ids: Iterable[int]) -> set[int]:
    """Of the parameter ids ``ids``, those ``optimizer`` trains as their owner (no live optimizer built later trains
    them too, ``owners``); ids of parameters it does not train cost one look each."""
    held = optimizer.pipeline.where  # id(parameter) -> its place, for every parameter the optimizer trains
    mine = {i for i in ids if i in held}
    if mine:
        table = owners()
        mine = {i for i in mine if table.get(i) is optimizer}
    return mine


def training(params: Iterable[torch.Tensor]) -> list[Any]:
    """The live optimizers that train some of ``params``, oldest first."""
    table = owners()
    hit = {id(table[id(p)]): table[id(p)] for p in params if id(p) in table}
    return [opt for opt in optimizers() if id(opt) in hit]
