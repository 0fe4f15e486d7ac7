"""Who may train a parameter: a stage-3 optimizer's alone; elsewhere one that lost its gradient to a later one stops.

A stage-3 optimizer keeps each rank's shard of a parameter and empties the parameter between uses;
its hooks on the model gather it. A second optimizer built on it (or ``zk.initialize`` run again on
the model) would take the empty tensors for the values and put a second set of hooks on the model,
and fail later with errors that say nothing of the cause. So it is refused before anything changes
(as FSDP refuses to wrap a module twice), naming the parameter: held by a stage-3 optimizer that
exists (whether emptied now or kept whole under ``stage3_param_persistence_threshold``), or emptied
by one that was deleted, whose shards took the values with them (``guard.ORPHANED``).

Any stage (``check_step``). Two optimizers may share parameters as two ``torch.optim.AdamW`` do (a shared trunk
under an actor's and a critic's optimizer: each steps it with its own state) where both leave the gradient in
``p.grad`` for their steps to read (stages 0-1 without a wider ``grad_accum_dtype``). Where either takes it away
(stages 2-3 move it into their buckets; a wider ``grad_accum_dtype`` into its own buffer), the one built last gets
it and the other would step without it: that one's ``step()`` raises, naming the parameter, before anything is
updated. Building the second one is not refused: ``opt = ShardedFusedAdam(model, ...)`` run again builds the new
one while the old one is still bound, and the old one is never stepped again. A deleted optimizer kept by a
reference cycle (a stage-3 pipeline, until Python's collector runs) does not count: on a clash the collector runs
once first.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Iterable, Optional

import torch

from .grad_ready import owners
from .stage3 import guard


def _holder(p: torch.Tensor) -> Optional[Any]:
    """The live pipeline that holds ``p`` (the one built last; it holds ``p``, so ``id(p)`` is ``p``'s), if any."""
    ref = owners.get(id(p))
    return ref() if ref is not None else None


def _held(p: torch.Tensor) -> bool:
    """``p`` belongs to a stage-3 pipeline that exists."""
    pipeline = _holder(p)
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


def others_held(params: Iterable[torch.Tensor], taken: Iterable[torch.Tensor]) -> set[int]:
    """``id`` of each of ``params`` not among ``taken`` that a live optimizer holds (another optimizer's, for an
    optimizer being built on ``taken`` of a model whose parameters are ``params``)."""
    mine = {id(p) for p in taken}
    return {id(p) for p in params if id(p) not in mine and _holder(p) is not None}


def _later_holder(p: torch.Tensor, pipeline: Any) -> Optional[Any]:
    """The live pipeline other than ``pipeline`` that holds ``p`` (the one built last), if any."""
    held = _holder(p)
    return held if held is not pipeline else None


def _leaves_p_grad(pipeline: Any, p: torch.Tensor) -> bool:
    """Whether ``pipeline``'s step reads ``p``'s gradient from ``p.grad`` (stages 0-1, accumulated in its own
    dtype), where another optimizer's step can read it too."""
    accum = pipeline.accum_dtype
    return pipeline.accumulates_locally and (accum is None or torch.promote_types(p.dtype, accum) == p.dtype)


def _lost(pipeline: Any) -> list[tuple[torch.Tensor, Any]]:
    """``pipeline``'s parameters that a pipeline built later took, with it, where one of the two takes the
    gradient away."""
    lost = []
    for buf in pipeline.buffers:
        for p in buf.params:
            later = _later_holder(p, pipeline)
            if later is not None and not (_leaves_p_grad(later, p) and _leaves_p_grad(pipeline, p)):
                lost.append((p, later))
    return lost


def check_step(pipeline: Any, name_of: Callable[[torch.Tensor], str]) -> None:
    """Raise ``ValueError`` before ``pipeline``'s step changes anything when another optimizer built later took one
    of its parameters' gradient (see the module docstring).

    Args:
        pipeline: the stepping optimizer's pipeline.
        name_of: names a parameter in errors.
    """
    if not _lost(pipeline):
        return
    gc.collect()  # a deleted optimizer still in a reference cycle gives its parameters up
    lost = _lost(pipeline)
    if lost:
        p, later = lost[0]
        raise ValueError(
            f"{name_of(p)} is also held by a ShardedFusedAdam built after this one (stage {later.stage}), which "
            "gets its gradient (the optimizer built last does), so this one would step it without one: two "
            "optimizers share a parameter as two AdamW do only at stages 0-1 without a wider grad_accum_dtype (both "
            f"read p.grad); this one is stage {pipeline.stage}. Train it with one optimizer (param groups can give it "
            "other settings), or delete this one if the later one replaces it; nothing was updated"
        )
