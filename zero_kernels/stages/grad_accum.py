"""How ``data_types.grad_accum_dtype`` (a pipeline's ``accum_dtype``) acts at each stage, and the warning where it
is not the dtype the gradients add up in (a dtype narrower than them; fp16 beside bf16, which add up in fp32).

DeepSpeed 0.19 (``engine.get_data_types``, ``_do_optimizer_sanity_check``) takes the key as the dtype
gradients are added up in over micro-steps. With bf16/fp16 training and ``"fp32"``: its ZeRO-3 reduces every
micro-step and adds the reduced partition into an fp32 buffer; at stage 1 its BF16_Optimizer (bf16 without
CPU offload), or its ZeRO-1 optimizer with an fp32 copy of each gradient (fp16, or CPU offload), adds each
micro-step's gradients up in fp32 before reducing them; at stage 0 0.19 refuses the mix
(``NotImplementedError``; 0.7.6 to 0.18.4 used the BF16_Optimizer). Its ZeRO-2 takes the key but adds the
micro-steps' reduced gradients up in the training dtype (the first micro-step's partition is the
accumulator), casting to fp32 only at the boundary.

zero_kernels acts on it at every stage. At stages 2 and 3, where each accumulation micro-step reduces its gradients
(in the communication dtype; ``Pipeline.reduces_micro_steps``), it widens the gradient shard they are added into,
DeepSpeed's ZeRO-3 numerics; at stage 2 that is more precise than DeepSpeed's. At stages 0 and 1
(``Pipeline.accumulates_locally``) the full local gradient buffer ``grad_flat`` takes the wider dtype
(``local_dtype``; ``Pipeline.wide_local``): every backward's gradients are added into it as their hooks fire and
``p.grad`` is set to None (``add_local``; ``p.grad`` must have the parameter's dtype), as DeepSpeed's BF16_Optimizer
empties ``p.grad`` into its fp32 buffers; the reduction reads the sum from there, in the communication dtype as
without the key (stage 0 all-reduces it at the synchronised backward, stage 1 reduce-scatters it at the step), so
the update sees the fp32 sum. So with it ``p.grad`` is None after backward at every stage, as DeepSpeed shows it;
clipping and a ``GradScaler`` work through the optimizer, as at stages 2-3. At stage 0 zero_kernels acts where
DeepSpeed 0.19 refuses: what its earlier versions did, and what the key asks. Memory at stages 0-1: ``grad_flat``
takes 4 bytes per element instead of 2 (``memory_report()``'s ``grads``), and stage 1's gradient shard is fp32 (its
``buffers``); autograd's own ``p.grad`` lives only until its hook. Time: a window of 4 micro-steps of a
6.3M-parameter bf16 model on 2 gloo ranks took 1.2x (stage 1) and 1.3x (stage 0) as long as with bf16 accumulation
(medians of 14 windows, alternating, on a loaded machine): the fp32 adds, autograd's new ``p.grad`` at every
backward and the casts around the reduction. A dtype narrower than the gradients never narrows them (warned); fp16
gradients with ``"bf16"`` (or bf16 with ``"fp16"``) add up in fp32, the one dtype that holds both (warned).

Default (the key absent): the gradients' own dtype at every stage. That is DeepSpeed's default since 0.17.6
(the training dtype, whatever the stage; 0.7.7 to 0.17.5 chose fp32 for bf16 at stage 0 only), so a drop-in
user gets DeepSpeed's numbers; it is also what ``torch.optim.AdamW`` does (autograd adds micro-steps up in
``p.grad``), the reference of the numerics contract (bf16 storage: no more than twice torch's own error).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .base import FlatBuffer, Pipeline

log = logging.getLogger("zero_kernels")

NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def local_dtype(pipeline: "Pipeline", buf: "FlatBuffer") -> torch.dtype:
    """The dtype of ``buf``'s local gradient buffer ``grad_flat`` at stages 0-1: the gradients' own, or the wider
    ``accum_dtype`` where the stage acts on it there (``Pipeline.accumulates_locally``)."""
    if pipeline.accumulates_locally and pipeline.accum_dtype is not None:
        return torch.promote_types(buf.dtype, pipeline.accum_dtype)
    return buf.dtype


def add_local(pipeline: "Pipeline", buf: "FlatBuffer", slot: int, p: torch.Tensor) -> None:
    """``p.grad`` into its slot of the wide ``grad_flat`` (copied by the first gradient of the window, added by the
    next ones: ``Pipeline.summed``), and ``p.grad`` set to None (``Pipeline.wide_local``)."""
    s = buf.layout.slots[slot]
    view = buf.grad_flat.narrow(0, s.offset, s.numel)
    index = buf.index_of(slot)
    if index in pipeline.summed:
        view.add_(p.grad.reshape(-1).to(view.dtype))  # on CPU 2x faster than adding bf16 into fp32 directly
    else:
        view.copy_(p.grad.reshape(-1))
        pipeline.summed.add(index)
    p.grad = None


def warn_unused(pipeline: "Pipeline", buf: "FlatBuffer", warned: set[str]) -> None:
    """Warn once (``warned`` holds the messages given) where ``pipeline.accum_dtype`` is not the dtype the
    gradients of ``buf`` add up in: narrower than them (it does not act), or a 16-bit dtype beside 16-bit gradients
    of the other kind (fp16 and bf16: neither holds the other's values, so they add up in fp32)."""
    accum = pipeline.accum_dtype
    if accum is None or accum == buf.dtype:
        return
    wide = torch.promote_types(buf.dtype, accum)
    if wide == accum:
        return
    grads = NAMES.get(buf.dtype, str(buf.dtype))
    asked = f"data_types.grad_accum_dtype={NAMES.get(accum, accum)!r}"
    if wide == buf.dtype:
        message = (
            f"{asked} is narrower than the {grads} gradients: zero_kernels never rounds gradients to a narrower "
            f"dtype and accumulates them in {grads} (DeepSpeed would accumulate in the narrower one)"
        )
    else:
        message = (
            f"{asked} cannot hold the {grads} gradients' values (nor they its): zero_kernels accumulates them in "
            f"{NAMES.get(wide, wide)}; give 'fp32' (the same numbers) or {grads!r} to say which"
        )
    if message not in warned:
        warned.add(message)
        log.warning(message)
