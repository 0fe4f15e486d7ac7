"""``model.zero_grad()`` reaching the gradients a ``ShardedFusedAdam`` keeps out of ``p.grad``.

Stages 2 and 3 (and stages 0-1 with a ``grad_accum_dtype`` wider than the gradients) move each backward's
gradients out of ``p.grad`` into buffers of their own, which ``nn.Module.zero_grad`` cannot see. A backward whose
gradients are not meant for a step (a GAN's generator step through the discriminator, an input-saliency backward
after the step), followed by ``model.zero_grad()`` as torch's examples write it, would be added into the next
step, where ``torch.optim.AdamW`` discards it.

So once a ``ShardedFusedAdam`` exists, ``nn.Module.zero_grad`` (wrapped once per process) also clears, after
torch's own, the gradients held by each live optimizer that keeps them out of ``p.grad``, holds some since its
last step or ``zero_grad`` (``window_open``), and trains only parameters of the module (those it holds: trainable
when it took them, whether frozen for a while since or not): that
optimizer's own ``zero_grad`` runs, with the same ``set_to_none`` (ignored between accumulation micro-steps, as
that call is). A module holding only some of such an optimizer's parameters cannot clear a part of its gradients
(they are bucketed, reduced and sharded): it clears none, and says so once per optimizer.
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
    """Run ``zero_grad`` of each live optimizer that holds gradients out of ``p.grad`` and trains only parameters of
    ``module``; warn once for one that trains some of them and others too."""
    holding = [opt for opt in live.optimizers() if _holds_grads(opt)]
    if not holding:
        return
    mine = {id(p) for p in module.parameters()}
    for opt in holding:
        trained = set(opt.pipeline.where)  # trainable when the optimizer took them, frozen for now or not
        if trained <= mine:
            opt.zero_grad(set_to_none)
        elif trained & mine:
            _warn_part(opt, len(trained & mine), len(trained), type(module).__name__)


def _holds_grads(opt: Any) -> bool:
    pipeline = opt.pipeline
    return not pipeline.grads_in_p_grad and pipeline.window_open


def _warn_part(opt: Any, part: int, whole: int, module: str) -> None:
    if opt in _warned:
        return
    _warned.add(opt)
    logger.warning(
        "zero_kernels: %s.zero_grad() holds %d of the %d parameters of a ShardedFusedAdam (stage %d) that keeps its "
        "gradients out of p.grad: it cannot clear a part of them, so it clears none (call opt.zero_grad() to drop "
        "them). Said once per optimizer",
        module,
        part,
        whole,
        opt.options.stage,
    )
