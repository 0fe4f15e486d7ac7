"""The gradient accumulation window: the gradients a pipeline holds between a step's backward passes.

Between two steps, the backward passes so far (micro-steps under ``no_sync`` or
``gradient_accumulation_steps``, or plain repeated backward) leave their gradients in ``p.grad``
(stages 0 and 1, and backward passes under ``no_sync`` at any stage), at stages 2 and 3 in this
rank's reduced gradient shard (the buckets a reduction wrote since the step), and at stages 0 and 1 with a
wider ``grad_accum_dtype`` in the slots of ``grad_flat`` that hold them (``sums``), with the flags the
next step reads (which parameters had a gradient, whether a synchronised backward ran). The window
is *open* from the first backward after a step or ``zero_grad()`` until the next of them.

``capture`` takes all of it, ``restore`` puts it back: a checkpoint saved inside a window carries
it so that the resumed run continues the window exactly. It is this rank's, laid out for this
world size, stage and bucket size, so it goes back only into the same layout
(``stages.state_door.layout_signature``); ``clear`` empties the window (as ``zero_grad()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .base import Pipeline


@dataclass
class Window:
    """What one rank holds inside a window (``flags`` are plain data; the tensors are this rank's)."""

    flags: dict[str, Any]  # synced, owed, has_grad, stepped_with: parameter indices; written: bucket indices per buffer
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # optimizer index -> p.grad
    shards: dict[int, torch.Tensor] = field(default_factory=dict)  # buffer index -> reduced gradient shard
    sums: dict[int, torch.Tensor] = field(default_factory=dict)  # optimizer index -> its wide sum (``wide_local``)


def capture(pipeline: "Pipeline") -> Window:
    """This rank's window (references, not copies: save it before the next backward or step)."""
    flags = {
        "synced": pipeline.reduced_since_step,
        "owed": pipeline.owed,
        "has_grad": sorted(i for i, has in pipeline.has_grad.items() if has),
        "stepped_with": sorted(pipeline.stepped_with),
        "written": [sorted(buf.written) for buf in pipeline.buffers],
    }
    window = Window(flags)
    for buf in pipeline.buffers:
        for p, index in zip(buf.params, buf.indices):
            if p.grad is not None:
                window.grads[index] = p.grad.detach()
    if not pipeline.grads_in_p_grad:
        window.shards = {b: pipeline.reduced_shard(buf) for b, buf in enumerate(pipeline.buffers) if buf.written}
    for buf in pipeline.buffers if pipeline.wide_local else ():
        for slot in buf.layout.slots:
            if buf.index_of(slot) in pipeline.summed:
                window.sums[buf.index_of(slot)] = buf.grad_flat.narrow(0, slot.offset, slot.numel)
    return window


def clear(pipeline: "Pipeline") -> None:
    """No gradient held: ``p.grad`` is None, no parameter marked, nothing reduced (``zero_grad()``)."""
    pipeline.zero_grad(set_to_none=True)


def restore(pipeline: "Pipeline", window: Window) -> None:
    """Put back a window captured under the same layout (checked by the caller)."""
    clear(pipeline)
    pipeline.has_grad.update(dict.fromkeys(window.flags["has_grad"], True))
    pipeline.stepped_with = set(window.flags["stepped_with"])
    for buf, written in zip(pipeline.buffers, window.flags["written"]):
        buf.written = set(written)
    for b, shard in window.shards.items():
        pipeline.assign_reduced(pipeline.buffers[b], shard)
    for buf in pipeline.buffers:
        for slot in buf.layout.slots:
            held = window.sums.get(buf.index_of(slot))
            if held is not None:
                buf.grad_flat.narrow(0, slot.offset, slot.numel).copy_(held.reshape(-1))
                pipeline.summed.add(buf.index_of(slot))
    for buf in pipeline.buffers:
        for slot in buf.layout.slots:
            grad = window.grads.get(buf.index_of(slot))
            if grad is None:
                continue
            p = buf.params[slot.param]
            if pipeline.grads_in_p_grad:  # the step reads p.grad through grad_flat: p.grad views it
                view = buf.grad_flat.narrow(0, slot.offset, slot.numel).view(slot.shape)
                view.copy_(grad.reshape(slot.shape))
                p.grad = view
            else:
                _set_grad(p, grad.to(buf.dtype).reshape(slot.shape).clone())
    pipeline.reopen(bool(window.flags["synced"]), bool(window.flags.get("owed", False)))


def _set_grad(p: torch.Tensor, grad: torch.Tensor) -> None:
    """``p.grad = grad``, also while stage 3 holds ``p`` freed (an empty tensor), as after its backward."""
    if p.shape == grad.shape:
        p.grad = grad
        return
    data = p.data
    p.data = torch.empty(grad.shape, dtype=p.dtype, device=p.device)
    p.grad = grad
    p.data = data
