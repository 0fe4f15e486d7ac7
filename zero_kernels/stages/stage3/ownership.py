"""One stage-3 optimizer per parameter: a second optimizer on parameters a stage-3 optimizer holds is refused.

A stage-3 optimizer keeps each rank's shard of a parameter and empties the parameter between uses;
its hooks on the model gather it. A second optimizer built on it (or ``zk.initialize`` run again on
the model) would take the empty tensors for the values and put a second set of hooks on the model,
and fail later with errors that say nothing of the cause. So it is refused before anything changes
(as FSDP refuses to wrap a module twice), naming the parameter: held by a stage-3 optimizer that
exists (whether emptied now or kept whole under ``stage3_param_persistence_threshold``), or emptied
by one that was deleted, whose shards took the values with them (``guard.ORPHANED``).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from ..grad_ready import owners
from . import guard


def _held(p: torch.Tensor) -> bool:
    """``p`` belongs to a stage-3 pipeline that exists (it holds ``p``, so ``id(p)`` is ``p``'s)."""
    ref = owners.get(id(p))
    pipeline = ref() if ref is not None else None
    return pipeline is not None and pipeline.stage == 3


def refuse_held(params: Iterable[torch.Tensor], describe: Callable[[torch.Tensor], str]) -> None:
    """Raise ``ValueError`` naming the first of ``params`` that a stage-3 optimizer holds or emptied.

    Args:
        params: the parameters a new optimizer is about to take.
        describe: names a parameter in errors.
    """
    for p in params:
        freed = guard.freed_by(p) if isinstance(p, torch.nn.Parameter) else None
        if freed is False:
            raise ValueError(f"ZeRO stage 3: {describe(p)} holds no values: {guard.ORPHANED}")
        if freed or _held(p):
            raise ValueError(
                f"ZeRO stage 3: {describe(p)} is held (sharded) by another stage-3 optimizer; a parameter can "
                "belong to one stage-3 optimizer only (as FSDP wraps a module once). Keep training with that "
                "optimizer, or take the full weights out with it (zero_kernels.save_pretrained(model, optimizer, "
                "directory), or a state dict taken inside `with optimizer.gathered_params():`) and build the new "
                "optimizer on a fresh model loaded with them"
            )
