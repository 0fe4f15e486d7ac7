"""``model.zero_grad()`` reaching what a ``ShardedFusedAdam`` keeps of the gradients besides ``p.grad``.

Stages 2 and 3 (and stages 0-1 with a ``grad_accum_dtype`` wider than the gradients) move each backward's
gradients out of ``p.grad`` into buffers of their own, which ``nn.Module.zero_grad`` cannot see; at every stage the
optimizer also keeps what a backward told it (a ``clip_grad_norm_`` measured, an unscaled fp16 backward to refuse).
A backward whose gradients are not meant for a step (a GAN's generator step through the discriminator, an
input-saliency backward after the step, a spiking batch skipped after clipping), followed by ``model.zero_grad()``
as torch's examples write it, would be added into the next step, or refused there, where ``torch.optim.AdamW``
discards it.

So once a ``ShardedFusedAdam`` exists, ``nn.Module.zero_grad`` (wrapped once per process) also runs, after torch's
own and with the same ``set_to_none``, the ``zero_grad`` of each live optimizer that trains only parameters of the
module (those it holds: trainable when it took them, whether frozen for a while since or not) and holds gradients
since its last step or ``zero_grad`` (``window_open``), or, with ``set_to_none=False``, in any case (its zero
gradients then stay, as ``p.grad`` does in AdamW, for a branch some steps leave unused). Between accumulation
micro-steps the window's gradients stay, ``p.grad`` included (``mid_window``). Modules that each hold only some of
an optimizer's parameters (one optimizer over an encoder and a decoder, cleared with ``enc.zero_grad();
dec.zero_grad()``) clear its gradients once the modules zeroed since the last backward hold all of them together
(``ZeroedPart``): a part alone cannot be cleared (the gradients are bucketed, reduced and sharded). A step that
comes after a part was zeroed and before the rest was says once per optimizer that the part's gradients were not
cleared (where the step reads ``p.grad``, torch's own cleared them, and nothing is said). An unrelated module costs
one look at each of its parameters.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

from torch import nn

from .. import live
from ..log import LOGGER_NAME
from . import mid_window

logger = logging.getLogger(LOGGER_NAME)
_installed = False
_warned: "weakref.WeakSet[Any]" = weakref.WeakSet()  # optimizers told that a part's zero_grad cleared nothing


def install() -> None:
    """Wrap ``nn.Module.zero_grad`` (once per process; the optimizer calls this when built)."""
    global _installed
    if _installed:
        return
    nn.Module.zero_grad = _routed(nn.Module.zero_grad)
    _installed = True


def _routed(original: Callable[..., None]) -> Callable[..., None]:
    def zero_grad(self: nn.Module, set_to_none: bool = True) -> None:
        with mid_window.module_call(self):
            original(self, set_to_none)
        _clear_held(self, set_to_none)

    zero_grad.__doc__ = original.__doc__
    zero_grad.__wrapped__ = original  # type: ignore[attr-defined]
    return zero_grad


def _clear_held(module: nn.Module, set_to_none: bool) -> None:
    """Run ``zero_grad`` of each live optimizer that holds gradients (any, with ``set_to_none`` False) and trains
    only parameters of ``module``, or of the modules zeroed with it since the last backward (``ZeroedPart``)."""
    ids: list[int] = []  # the module's parameters, looked at once, when an optimizer needs them
    for opt in live.optimizers():
        pipeline = opt.pipeline
        if not (pipeline.window_open or not set_to_none):
            continue
        ids = ids or [id(p) for p in module.parameters()]
        mine = live.owned(opt, ids)  # one built later on the same parameters took them over
        held = pipeline.where  # id(parameter) -> its place, for every parameter the optimizer trains
        if mine and (len(mine) == len(held) or ZeroedPart.add(pipeline, mine, type(module).__name__)):
            opt.zero_grad(set_to_none)


class ZeroedPart:
    """The parameters of an optimizer held by the modules zeroed since its last step, ``zero_grad`` or gradient
    (``pipeline.grad_arrivals``), when they are not all of them; kept on the pipeline, which drops it with the
    window."""

    def __init__(self, arrivals: int) -> None:
        self.arrivals = arrivals
        self.ids: set[int] = set()
        self.modules: list[str] = []

    @classmethod
    def add(cls, pipeline: Any, ids: set[int], module: str) -> bool:
        """Add a module's part; whether the parts now hold every parameter of the optimizer."""
        part = pipeline.zeroed_part
        if part is None or part.arrivals != pipeline.grad_arrivals:
            part = pipeline.zeroed_part = cls(pipeline.grad_arrivals)
        part.ids |= ids
        part.modules.append(module)
        if len(part.ids) < len(pipeline.where):
            return False
        pipeline.zeroed_part = None
        return True


def warn_part_left(opt: Any) -> None:
    """Before a step: say once per optimizer when modules holding a part of its parameters were zeroed since the
    last step and the rest was not, so the part's gradients held out of ``p.grad`` were not cleared."""
    pipeline = opt.pipeline
    part = pipeline.zeroed_part
    if part is None or pipeline.grads_in_p_grad or opt in _warned:
        return
    _warned.add(opt)
    logger.warning(
        "zero_kernels: %s.zero_grad() held %d of the %d parameters of a ShardedFusedAdam (stage %d), which holds "
        "their gradients out of p.grad (bucketed and reduced): a part cannot be cleared, so this step uses the "
        "gradients of every backward since the last step. Zero modules that together hold all of its parameters "
        "after the last backward you want dropped (enc.zero_grad(); dec.zero_grad()), or call opt.zero_grad(). "
        "Said once per optimizer",
        ", ".join(part.modules),
        len(part.ids),
        len(pipeline.where),
        opt.options.stage,
    )
