"""Who may train a parameter: a second optimizer on parameters another one holds is refused where it would go wrong.

A stage-3 optimizer keeps each rank's shard of a parameter and empties the parameter between uses;
its hooks on the model gather it. A second optimizer built on it (or ``zk.initialize`` run again on
the model) would take the empty tensors for the values and put a second set of hooks on the model,
and fail later with errors that say nothing of the cause. So it is refused before anything changes
(as FSDP refuses to wrap a module twice), naming the parameter: held by a stage-3 optimizer that
exists (whether emptied now or kept whole under ``stage3_param_persistence_threshold``), or emptied
by one that was deleted, whose shards took the values with them (``guard.ORPHANED``).

Any stage (``warn_shared``). Two optimizers may share parameters as two ``torch.optim.AdamW`` do (a shared trunk
under an actor's and a critic's optimizer: each steps it with its own state) only where both leave the gradient in
``p.grad`` for their steps to read (stages 0-1 without a wider ``grad_accum_dtype``). Where either takes it away
(stages 2-3 move it into their buckets; a wider ``grad_accum_dtype`` into its own buffer) only one of them would
ever see it, and the other would step without it, so the second optimizer is refused, naming the parameter. A
deleted optimizer lives on in a reference cycle until Python's collector runs: on a clash the collector runs once
first, so that ``del old; new = ShardedFusedAdam(...)`` works without a ``gc.collect()``.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any, Callable, Iterable, Optional

import torch

from .grad_ready import owners
from .stage3 import guard


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


def _other_holder(p: torch.Tensor, pipeline: Any) -> Optional[Any]:
    """The live pipeline other than ``pipeline`` that holds ``p`` (the latest built), if any."""
    ref = owners.get(id(p))
    held = ref() if ref is not None else None
    return held if held is not None and held is not pipeline else None


def _leaves_p_grad(pipeline: Any, p: torch.Tensor) -> bool:
    """Whether ``pipeline``'s step reads ``p``'s gradient from ``p.grad`` (stages 0-1, accumulated in its own
    dtype), where another optimizer's step can read it too."""
    accum = pipeline.accum_dtype
    return pipeline.accumulates_locally and (accum is None or torch.promote_types(p.dtype, accum) == p.dtype)


def warn_shared(params: Iterable[torch.Tensor], pipeline: Any, describe: Callable[[torch.Tensor], str]) -> None:
    """Warn, naming the first of ``params`` that another live optimizer holds where one of the two
    takes the gradient out of ``p.grad`` (see the module docstring).

    Args:
        params: the parameters the optimizer of ``pipeline`` is about to take.
        pipeline: its pipeline (built, not yet holding them).
        describe: names a parameter in errors.
    """
    params = list(params)
    if any(_other_holder(p, pipeline) is not None for p in params):
        gc.collect()  # a deleted optimizer, still in its reference cycle, gives its parameters up
    for p in params:
        other = _other_holder(p, pipeline)
        if other is None or (_leaves_p_grad(other, p) and _leaves_p_grad(pipeline, p)):
            continue
        warnings.warn(
            f"{describe(p)} is held by another ShardedFusedAdam (stage {other.stage}) that is still alive; a "
            f"parameter can be shared by two of them only at stages 0-1 without a wider grad_accum_dtype (each "
            f"reads p.grad), while this one is stage {pipeline.stage}{_how(pipeline, other, p)}: only one of them "
            "would see its gradient. Train it with one optimizer (param groups can give it other settings), or "
            "delete the other optimizer (every reference to it) before building this one; from now on this one "
            "trains it",
            stacklevel=4,
        )
        return


def _how(pipeline: Any, other: Any, p: torch.Tensor) -> str:
    if pipeline.accumulates_locally and not _leaves_p_grad(pipeline, p):
        return " with a wider grad_accum_dtype"
    if other.accumulates_locally and not _leaves_p_grad(other, p):
        return " and the other accumulates in a wider grad_accum_dtype"
    return ""
