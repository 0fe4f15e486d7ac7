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
micro-steps that call is ignored, as it always is. A module holding only some of an optimizer's parameters cannot
clear a part of its gradients (they are bucketed, reduced and sharded): it clears none, and says so once per
optimizer while that optimizer holds gradients out of ``p.grad`` (where the step reads ``p.grad``, torch's own
clears that part). An unrelated module costs one look at each of its parameters.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

from torch import nn

from .. import live
from ..log import LOGGER_NAME

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
        original(self, set_to_none)
        _clear_held(self, set_to_none)

    zero_grad.__doc__ = original.__doc__
    zero_grad.__wrapped__ = original  # type: ignore[attr-defined]
    return zero_grad


def _clear_held(module: nn.Module, set_to_none: bool) -> None:
    """Run ``zero_grad`` of each live optimizer that trains only parameters of ``module`` and holds gradients (any,
    with ``set_to_none`` False); warn once for one holding gradients that trains some of them and others too."""
    ids: list[int] = []  # the module's parameters, looked at once, when an optimizer needs them
    for opt in live.optimizers():
        pipeline = opt.pipeline
        if not (pipeline.window_open or not set_to_none):
            continue
        ids = ids or [id(p) for p in module.parameters()]
        held = pipeline.where  # id(parameter) -> its place, for every parameter the optimizer trains
        mine = sum(1 for i in ids if i in held)
        if mine == len(held) and mine:
            opt.zero_grad(set_to_none)
        elif mine and pipeline.window_open and not pipeline.grads_in_p_grad:
            _warn_part(opt, mine, len(held), type(module).__name__)


def _warn_part(opt: Any, part: int, whole: int, module: str) -> None:
    if opt in _warned:
        return
    _warned.add(opt)
    logger.warning(
        "zero_kernels: %s.zero_grad() holds %d of the %d parameters of a ShardedFusedAdam (stage %d), which holds "
        "gradients they cannot reach (bucketed and reduced): it cannot clear a part of them, so it clears none (call "
        "opt.zero_grad() to drop them). Said once per optimizer",
        module,
        part,
        whole,
        opt.options.stage,
    )
