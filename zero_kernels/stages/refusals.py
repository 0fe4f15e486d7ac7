"""Gradient misuse one rank finds on its own, raised on every rank at the step.

Some misuses show on one rank only, at a point that depends on its data: at stages 0 and 2 a
bucket is reduced once every parameter in it has its gradient, so whether a parameter's second
gradient of one backward pass (reentrant activation checkpointing) comes after that reduction
depends on which parameters the rank's data gave a gradient. Raising where it is found would leave
the other ranks waiting in their next collective until the process group's timeout. So the rank
records the first problem (``Refusals.record``), drops the gradient it cannot place, and goes on
issuing the same collectives as its peers; the step's one exchange (``stats``) carries two columns
per rank (the problem and the parameter), and every rank raises the same ``RuntimeError``, naming
the rank and the parameter, before anything is updated. On one rank nothing waits: it raises where
it is found. Problems:

- ``SECOND_GRADIENT``: a gradient that arrives after its parameter's gradients were reduced in this
  backward (``grad_state.second_gradient``).
- ``UNSEEN_GRADIENT``: stages 2-3 keep no ``p.grad`` (a backward moves it into the reduced shard);
  one left there at the step, which no reduction took (``p.grad = ...`` set by hand after the
  step's synchronised backward), would be ignored by the step.
- ``AFTER_CLIP``: a gradient that arrives after ``clip_grad_norm_`` measured the norm (or ``scale_grads_``
  scaled the gradients): torch clips what ``p.grad`` held then and adds later gradients unclipped; the step here
  clips the sum.
- ``STATE_WRITTEN``: with ``super_offload``, this rank's optimizer state was written between backward, which updated
  it ahead of the step (``speculation``), and the step, through a tensor taken from ``opt.state`` before that
  backward: neither keeping nor rolling back the update would keep the write as without it.
- ``UNSCALED_BACKWARD``: with fp16 loss scaling, a gradient from a backward the optimizer did not
  scale (``loss.backward()`` in place of ``opt.backward(loss)``): the step would divide it by the loss
  scale. DeepSpeed refuses it too ("Loss scaling is required"). Raised at the step even on one rank,
  so that a ``torch.amp.GradScaler`` given with the fp16 config is reported as such first (``amp``).

Kept until the step raises, ``zero_grad()`` discards the gradients, or a step without problems ends.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..comm.agreement import ranks_text
from .grad_state import second_gradient

NONE, SECOND_GRADIENT, UNSEEN_GRADIENT, AFTER_CLIP, UNSCALED_BACKWARD, STATE_WRITTEN = 0, 1, 2, 3, 4, 5


def describe(kind: int, stage: int, name: str) -> str:
    """The error for problem ``kind`` of parameter ``name`` at ``stage``."""
    if kind == SECOND_GRADIENT:
        return second_gradient(stage, name)
    if kind == UNSEEN_GRADIENT:
        return (
            f"ShardedFusedAdam (stage {stage}): {name} has a gradient in p.grad that no reduction took: stage {stage} "
            "moves each backward's gradients into this rank's shard of the reduced gradients (p.grad is None after "
            "backward), and a gradient set in p.grad after the step's synchronised backward (any backward through the "
            "model, torch.autograd.grad's too) would be ignored. Put "
            "what you add into the loss (or a gradient hook) before backward, or run that backward under "
            "opt.no_sync() (its gradients are then reduced at the step); nothing was updated"
        )
    if kind == STATE_WRITTEN:
        return state_written(name)
    if kind == UNSCALED_BACKWARD:
        return (
            f"ShardedFusedAdam (stage {stage}): loss scaling is required (fp16 is enabled), but {name} got its "
            "gradient from a backward that did not scale the loss (loss.backward() called directly); call "
            "opt.backward(loss) on the ShardedFusedAdam (the optimizer zero_kernels.initialize returns; DeepSpeed's "
            "engine.backward(loss)) in place of loss.backward(); nothing was updated"
        )
    return (
        f"ShardedFusedAdam (stage {stage}): {name} got a gradient after clip_grad_norm_ measured the gradients' "
        "norm (or scale_grads_ scaled them, or safe_set_full_grad set one): torch.optim.AdamW would see the earlier "
        "gradients clipped (scaled, set) and this one not, which the fused step cannot do. Call them after the last "
        "backward of the step; nothing was updated"
    )


def state_written(name: str) -> str:
    """The error for a state written between backward and the step under ``super_offload`` (``speculation``)."""
    return (
        f"zero_optimization.offload_optimizer.super_offload: the optimizer state of the buffer holding {name} was "
        "written between backward, which updated it ahead of the step, and the step, through a tensor taken from "
        "opt.state before that backward; take it from opt.state again after backward (that rolls the update back) "
        "or turn super_offload off; nothing was updated"
    )


class Refusals:
    """The first problem this rank found since the gradients were last cleared (see the module docstring)."""

    def __init__(self) -> None:
        self.kind, self.index = NONE, -1

    def record(self, kind: int, index: int) -> None:
        """Remember problem ``kind`` of parameter ``index`` (optimizer numbering) unless one is held already."""
        if self.kind == NONE:
            self.kind, self.index = kind, index

    def clear(self) -> None:
        self.kind, self.index = NONE, -1

    def columns(self) -> list[float]:
        """This rank's columns of the step's exchange."""
        return [float(self.kind), float(self.index)]

    def verify(
        self,
        rows: Sequence[Sequence[float]],
        stage: int,
        name: Callable[[int], str],
        global_ranks: Optional[Sequence[int]] = None,
    ) -> None:
        """Raise on every rank when some rank's ``columns()`` (``rows``, in rank order) hold a problem.

        Args:
            rows: every rank's two columns, as the step's exchange gathered them.
            stage: the ZeRO stage, for the message.
            name: names a parameter by its optimizer index.
            global_ranks: the exchange's engine's (``ranks_text``), for the message.
        """
        for rank, (kind, index) in enumerate(rows):
            if int(kind) != NONE:
                where = found_on(rank, len(rows), global_ranks)
                raise RuntimeError(describe(int(kind), stage, name(int(index))) + where)


def found_on(rank: int, world_size: int, global_ranks: Optional[Sequence[int]]) -> str:
    """Where a problem every rank raises was found: `` (found on rank 1 (global rank 2) of 2; every rank raises)``,
    nothing on one rank."""
    if world_size == 1:
        return ""
    return f" (found on {ranks_text([rank], global_ranks)} of {world_size}; every rank raises)"
