"""Which gradients a step uses, whichever way the user clears them between steps.

Frameworks clear gradients with ``model.zero_grad()`` (or ``p.grad = None``), never reaching the
optimizer, so the gradient state a pipeline keeps for itself must not outlive a step:

- After every step, taken or skipped (fp16 overflow), the pipeline forgets which parameters had
  a gradient and drops the reduced gradient shard of stages 2 and 3, as DeepSpeed's engine does
  after its step. Nothing is zeroed then (nor by ``opt.zero_grad()``): the next reduction of each
  bucket overwrites its part of the shard, later ones add to it, and ``zero_unwritten`` zeroes,
  before the step reads them, the parts no reduction wrote; this saves a memset of the shard per
  step and per ``zero_grad()``, and a read. ``model.zero_grad()``, ``opt.zero_grad()`` or neither:
  the next step sees only the gradients of the backward passes after this step. Accumulation over several backward
  passes (``no_sync``, ``gradient_accumulation_steps``, or plain repeated ``backward``) before one
  step is unchanged. A step with neither a backward nor ``opt.zero_grad()`` since one that dropped gradients
  updates nothing where ``torch.optim.AdamW`` would apply ``p.grad`` again: said once (``warn_spent``).
- Stages 0 and 1 keep gradients in ``p.grad`` (views of the flat gradient buffer; with a wider
  ``grad_accum_dtype`` they do not: ``p.grad`` is emptied into that buffer, and the rules of stages 2 and 3
  below apply, the slots that got no gradient since the step being zeroed before the reduction), so what the
  user does to ``p.grad`` is seen: at the step, a parameter has a gradient exactly when
  ``p.grad is not None`` (as ``torch.optim.AdamW`` decides), and before a bucket is reduced the
  slots of parameters whose ``p.grad`` was dropped are zeroed (the buffer still holds the values
  of an earlier step there).
- Stages 2 and 3 keep no ``p.grad``. ``opt.zero_grad(set_to_none=False)`` after a step keeps the
  parameters that had a gradient in it marked as having one (a zero gradient, as
  ``torch.optim.AdamW`` sees ``p.grad`` filled with zeros); ``set_to_none=True`` and
  ``model.zero_grad()`` leave them unmarked. Between a backward and the step only
  ``opt.zero_grad()`` can discard the gradients already reduced into the shard.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

from . import norms
from .layout import Bucket

if TYPE_CHECKING:
    from .base import FlatBuffer, Pipeline

log = logging.getLogger("zero_kernels")


def read_grad_flags(pipeline: "Pipeline") -> None:
    """Stages whose gradients live in ``p.grad``: a parameter has a gradient iff ``p.grad is not None``."""
    if not pipeline.grads_in_p_grad:  # the hooks marked them (``wide_local``: p.grad is emptied)
        return
    for buf in pipeline.buffers:
        if buf.grad_flat is None:
            continue
        for slot in buf.layout.slots:
            pipeline.has_grad[buf.index_of(slot)] = buf.params[slot.param].grad is not None


def zero_dropped_grads(pipeline: "Pipeline", buf: "FlatBuffer", bucket: Bucket) -> None:
    """Before ``bucket`` is reduced (stages 0-1): zero the slots of parameters whose ``p.grad`` the user dropped, or
    (``wide_local``) that got no gradient since the last step or ``zero_grad``."""
    if buf.grad_flat is None:
        return
    for index in bucket.slots:
        slot = buf.layout.slots[index]
        if pipeline.wide_local:
            dropped = buf.index_of(slot) not in pipeline.summed
        else:
            dropped = buf.params[slot.param].grad is None
        if dropped:
            lo, hi = max(slot.offset, bucket.start), min(slot.offset + slot.numel, bucket.start + bucket.numel)
            buf.grad_flat[lo:hi].zero_()


def clear_after_step(pipeline: "Pipeline") -> None:
    """Forget this step's gradients (see the module docstring); called at the end of every step."""
    pipeline.stepped_with = {i for i, has in pipeline.has_grad.items() if has}
    pipeline.spent = bool(pipeline.stepped_with) and not pipeline.grads_in_p_grad
    pipeline.has_grad = dict.fromkeys(pipeline.has_grad, False)
    for buf in pipeline.buffers:
        buf.written.clear()
    pipeline.reset_grad_sync()


def warn_spent(pipeline: "Pipeline") -> None:
    """Before a step: say once per optimizer when neither a backward nor ``zero_grad()`` came since a step that
    dropped its gradients (``spent``): ``torch.optim.AdamW`` would apply ``p.grad`` again, this step has none."""
    if not pipeline.spent or pipeline.window_open or pipeline.spent_warned:
        return
    pipeline.spent_warned = True
    log.warning(
        "ShardedFusedAdam (stage %d): step() without a backward or zero_grad() since the last step, which dropped "
        "the gradients it used (this stage keeps no p.grad; DeepSpeed's engine does the same): this step updates "
        "nothing, where torch.optim.AdamW would apply the same gradients again. Said once per optimizer",
        pipeline.stage,
    )


def zero_unwritten(pipeline: "Pipeline") -> None:
    """Zero the parts of the gradient shards that no reduction wrote since the last step or ``zero_grad``."""
    for buf in pipeline.buffers:
        if buf.grad_shard is None:
            continue
        for bucket in buf.layout.buckets:
            if bucket.index not in buf.written:
                pipeline.zero_reduced(buf, bucket)
                buf.written.add(bucket.index)


def keep_zero_grads(pipeline: "Pipeline") -> None:
    """``zero_grad(set_to_none=False)`` where ``p.grad`` is not what the step reads (stages 2-3, ``wide_local``):
    parameters that had a gradient in the last step keep one (zero: nothing is added into their slot)."""
    for buf in pipeline.buffers:
        if buf.grad_flat is not None and pipeline.grads_in_p_grad:
            continue
        for i in buf.indices:
            if i in pipeline.stepped_with:
                pipeline.has_grad[i] = True


def grad_norm(pipeline: "Pipeline", grad_scale: float, order: float = 2.0) -> torch.Tensor:
    """Global norm of order ``order`` (L2, another positive number or ``inf``: ``norms``) of this step's reduced
    gradients times ``grad_scale``, a float64 0-d tensor on their device that the host does not read here (a
    collective: every rank calls it).

    Args:
        pipeline: the optimizer's pipeline.
        grad_scale: multiplier of the reduced gradients (1 / loss scale with fp16 loss scaling, else 1 /
            accumulation steps).
        order: the norm's order, checked by ``norms.norm_order``.
    """
    pipeline.finish_grad_sync()
    if order != 2.0:
        column = norms.local_column(pipeline.norm_views(), pipeline.column_device, order)
        norms.reduce(pipeline.engine, column, order)
        return norms.value(column, order) * grad_scale
    sq = pipeline.grad_column(norm=True)
    if pipeline.world_size > 1:
        pipeline.engine.all_reduce(sq, op="sum", name="clip.norm").wait()
    return sq.sqrt() * grad_scale


def second_gradient(stage: int, name: str) -> str:
    """The error for a gradient that arrives after its parameter's gradients were reduced in this backward (or in
    an earlier one that raised: the two look the same from a gradient hook)."""
    return (
        f"ShardedFusedAdam (stage {stage}): {name} got a second gradient in one backward pass, after its gradients "
        "were reduced. Either an earlier backward raised (an out-of-memory error caught, say) and this one ran "
        "without opt.zero_grad() between: call opt.zero_grad() after catching the error, which drops the failed "
        "backward's gradients; or a parameter is used in more than one segment of reentrant activation "
        "checkpointing: use torch.utils.checkpoint(..., use_reentrant=False) (in transformers: "
        "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})), or stage 1"
    )


SAMPLE = 16  # elements of each local gradient buffer ``sample_local`` keeps


def sample_local(pipeline: "Pipeline") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(positions, values) of ``SAMPLE`` evenly spaced elements of each buffer's local gradients (``grad_flat``,
    what ``p.grad`` views at stages 0-1): ``local_changed`` later tells whether they were written since."""
    out = []
    for buf in pipeline.buffers:
        if buf.grad_flat is not None and buf.grad_flat.numel():
            at = torch.linspace(0, buf.grad_flat.numel() - 1, SAMPLE, device=buf.grad_flat.device).long()
            out.append((at, buf.grad_flat[at].clone()))
    return out


def local_changed(pipeline: "Pipeline", sample: list[tuple[torch.Tensor, torch.Tensor]]) -> Optional[bool]:
    """Whether some finite nonzero element ``sample_local`` kept has another value now (a scaling of ``p.grad``
    changes every one of them); None where it kept none (all zero: no scaling would show)."""
    bufs = [b for b in pipeline.buffers if b.grad_flat is not None and b.grad_flat.numel()]
    telling = False
    for buf, (at, values) in zip(bufs, sample):
        keep = values.isfinite() & (values != 0)
        if bool(keep.any()):
            telling = True
            if not torch.equal(buf.grad_flat[at][keep], values[keep]):
                return True
    return False if telling else None


_VERDICTS = (None, False, True)  # ``local_changed``'s answers, in the order ``agreed_change`` ranks them


def agreed_change(pipeline: "Pipeline", changed: Optional[bool]) -> Optional[bool]:
    """``local_changed``'s verdict, the same on every rank (a small collective on several ranks): True where some rank
    saw its sample change, else False where some rank's sample could tell, else None.

    Every rank read gradients that the same calls scaled alike, but a rank's sample may hold zeros only (the rows of
    an embedding its batch did not use) or non-finite values (an overflow on that rank): that rank alone reduced again
    at the step, a collective the others did not issue (gloo aborted with "Received data size doesn't match")."""
    if pipeline.world_size == 1:
        return changed
    code = torch.tensor([float(_VERDICTS.index(changed))], device=pipeline.column_device)
    pipeline.engine.all_reduce(code, op="max", name="grads.sample").wait()
    return _VERDICTS[int(code.item())]
