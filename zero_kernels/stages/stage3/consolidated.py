"""Stage 3's model as one full state dict in host memory, gathered a unit at a time: what a save of full weights writes.

``gathered_params()`` makes every parameter whole on every rank at once, so a model that fits only at stage 3 does not
fit there, and saving it for ``from_pretrained`` ran out of memory. ``model_state_dict`` reads the model as
``model.state_dict()`` would (its names and order, buffers and extra state), each unit gathered exactly, copied to
host memory on the ranks that keep a copy, and freed before the next one is gathered, as DeepSpeed's
``save_16bit_model`` gathers one module at a time: the device holds one unit beyond this rank's shards; a rank that
keeps the copy holds the model in host memory, the others nothing. A parameter under several names (tied) is one copy
under each, so ``save_pretrained`` finds it tied as in the model's own state dict.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from . import guard

if TYPE_CHECKING:
    from .pipeline import Stage3Pipeline


def model_state_dict(pipeline: "Stage3Pipeline", model: nn.Module, keep: bool) -> Optional[dict[str, Any]]:
    """``model``'s full state dict in host memory where ``keep``, else None; a collective (every rank calls it).

    Args:
        pipeline: the stage-3 pipeline of the optimizer that trains ``model`` (or a part of it).
        model: the module whose state dict is made (the optimizer's model, or a module around it).
        keep: whether this rank keeps the copy (the writer's rank); the others only take part in the gathers.

    Raises:
        RuntimeError: a parameter of ``model`` is emptied by another stage-3 optimizer (named); raised on every
            rank, after the gathers.
    """
    entries = model.state_dict(keep_vars=True)
    wanted = {id(value) for value in entries.values() if isinstance(value, torch.Tensor)}
    copies: dict[int, torch.Tensor] = {}
    gathered: set[int] = set()
    failure: Optional[BaseException] = None
    for params in pipeline.each_unit_whole():
        gathered.update(id(p) for p in params)
        if not keep or failure is not None:
            continue  # still gathered: every rank takes part in every unit's gather
        try:
            for p in params:
                if id(p) in wanted and id(p) not in copies:
                    copies[id(p)] = _host_copy(p)
        except Exception as exc:  # this rank's copy failed (host memory): raised once the gathers are over
            failure = exc
    if failure is not None:
        raise failure
    _refuse_emptied(entries, gathered)
    if not keep:
        return None
    return collections.OrderedDict((name, _entry(value, copies)) for name, value in entries.items())


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _entry(value: Any, copies: dict[int, torch.Tensor]) -> Any:
    """The saved form of one state-dict entry: its unit's copy, a host copy of a tensor kept whole (a buffer, a
    parameter no unit holds), or the value itself (extra state)."""
    if not isinstance(value, torch.Tensor):
        return value
    if id(value) not in copies:
        copies[id(value)] = _host_copy(value)
    return copies[id(value)]


def _refuse_emptied(entries: dict[str, Any], gathered: set[int]) -> None:
    """A parameter that no unit of this pipeline gathered (``gathered``: their ids) and another stage-3 optimizer
    emptied (or one that is gone) holds no full value here."""
    for name, value in entries.items():
        if isinstance(value, nn.Parameter) and id(value) not in gathered and guard.freed_by(value) is not None:
            raise RuntimeError(
                f"ZeRO stage 3: the model's {name!r} is emptied by another stage-3 optimizer (each rank holds only its "
                "shard), so its full weights cannot be saved with this one: save the part each optimizer trains with "
                "that optimizer"
            )
