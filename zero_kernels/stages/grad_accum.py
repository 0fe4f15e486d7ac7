"""Where ``data_types.grad_accum_dtype`` (a pipeline's ``accum_dtype``) acts, and the warnings where it does not.

DeepSpeed 0.19 (``engine.get_data_types``, ``_do_optimizer_sanity_check``) takes the key as the dtype
gradients are added up in over micro-steps. With bf16/fp16 training and ``"fp32"``: its ZeRO-3 reduces every
micro-step and adds the reduced partition into an fp32 buffer; at stage 1 its BF16_Optimizer (bf16 without
CPU offload), or its ZeRO-1 optimizer with an fp32 copy of each gradient (fp16, or CPU offload), adds each
micro-step's gradients up in fp32 before reducing them; at stage 0 0.19 refuses the mix
(``NotImplementedError``; 0.7.6 to 0.18.4 used the BF16_Optimizer). Its ZeRO-2 takes the key but adds the
micro-steps' reduced gradients up in the training dtype (the first micro-step's partition is the
accumulator), casting to fp32 only at the boundary.

zero_kernels acts on it at stages 2 and 3 (``Pipeline.accumulates_reduced``): each accumulation micro-step
reduces its gradients (in the communication dtype) and adds them into a gradient shard of the wider dtype
(``Pipeline.reduces_micro_steps``), DeepSpeed's ZeRO-3 numerics; at stage 2 that is more precise than
DeepSpeed's. At stages 0 and 1 micro-steps still add up in ``p.grad`` (the gradients' dtype), which the step,
``clip_grad_norm_``, a ``GradScaler`` and checkpoints of an open window all read there: a warning says so.
A dtype narrower than the gradients never narrows them (warned too).

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


def warn_unused(pipeline: "Pipeline", buf: "FlatBuffer", warned: set[str]) -> None:
    """Warn once (``warned`` holds the messages given) where ``pipeline.accum_dtype`` does not act on ``buf``."""
    accum = pipeline.accum_dtype
    if accum is None or accum == buf.dtype:
        return
    key = f"data_types.grad_accum_dtype={NAMES.get(accum, accum)!r}"
    grads = NAMES.get(buf.dtype, str(buf.dtype))
    if torch.promote_types(buf.dtype, accum) == buf.dtype:
        message = (
            f"{key} is narrower than the {grads} gradients: zero_kernels never rounds gradients to a narrower "
            f"dtype and accumulates them in {grads} (DeepSpeed would accumulate in the narrower one)"
        )
    elif not pipeline.accumulates_reduced:
        message = (
            f"{key} is not acted on at stage {pipeline.stage}: accumulation micro-steps add the {grads} gradients "
            f"up in p.grad, in {grads} (DeepSpeed adds them up in fp32 at stage 1, and refuses the setting at "
            "stage 0 since 0.18.5); it acts at stages 2 and 3"
        )
    else:
        return
    if message not in warned:
        warned.add(message)
        log.warning(message)
