"""Another optimizer stepping parameters whose gradients a ``ShardedFusedAdam`` takes: refused.

At stages 2-3 (and at stages 0-1 with a wider ``grad_accum_dtype``) the optimizer moves each gradient out of ``p.grad``
during backward (into its buckets and shards), so ``p.grad`` is None when the step comes. A ``torch.optim.AdamW`` (or
any other optimizer) built on those parameters while the sharded one lives, to continue from its
``full_state_dict()`` for instance, would find no gradient and leave every parameter as it is: its steps would do
nothing, silently. So a global step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``, put on once
per process when the first ``ShardedFusedAdam`` is built) refuses such a step, naming a parameter and the ways out.
An optimizer that wraps a ``ShardedFusedAdam`` (Accelerate's ``AcceleratedOptimizer``, through ``.optimizer``) is that
optimizer; parameters that the sharded optimizers do not train, whose gradients stay in ``p.grad`` (stages 0-1), or
that do not require grad (backward gives them no gradient to take: the other optimizer's step is AdamW's no-op) are
left alone. The same hook says once where such an optimizer steps parameters of the model whose gradients no sharded
optimizer reduces (``optim.unreduced``).
"""

from __future__ import annotations

from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import live
from . import unreduced

_installed = False


def install() -> None:
    """Put the step pre-hook on (once per process)."""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_refuse_foreign_step)
        _installed = True


def _wraps_sharded(optimizer: Any, sharded: list[Any]) -> bool:
    seen = 0
    while optimizer is not None and seen < 8:  # wrappers of wrappers, never a cycle
        if any(optimizer is s for s in sharded):
            return True
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return False


# where wrappers that are optimizers of their own keep the optimizer they wrap (timm's Lookahead: ``_base_optimizer``,
# davda54's SAM: ``base_optimizer``); only ``.optimizer`` marks a wrapper that forwards and does nothing else
_WRAPPED_AS = ("_base_optimizer", "base_optimizer", "_optimizer")


def _wrapped_as(optimizer: Any, sharded: list[Any]) -> str:
    """The attribute through which ``optimizer`` holds one of the sharded optimizers ('' where it does not)."""
    for name in _WRAPPED_AS:
        inner = getattr(optimizer, name, None)
        if inner is not None and inner is not optimizer and _wraps_sharded(inner, sharded):
            return name
    return ""


def _taken(sharded: Any, index: int, p: Any) -> bool:
    """Whether ``sharded`` takes gradients of its parameter ``index`` (``p``) away from ``p.grad``: it requires grad,
    or had one taken before it was frozen (held for the step, or used by the last step: torch's ``p.grad`` would
    still hold it). A tensor that does not require grad and never had a gradient gets none from backward: another
    optimizer's step over it is AdamW's no-op."""
    pipeline = sharded.pipeline
    return p.requires_grad or bool(pipeline.has_grad.get(index)) or index in pipeline.stepped_with


def _refuse_wrapper(optimizer: Any, sharded: Any, index: int) -> None:
    """Raise where ``optimizer`` is a wrapper of ``sharded`` that is an optimizer of its own (``_WRAPPED_AS``)."""
    wrapped_as = _wrapped_as(optimizer, [sharded])
    if wrapped_as:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): it wraps a ShardedFusedAdam at stage {sharded.options.stage} "
            f"(as .{wrapped_as}) and works on the parameters itself, as torch's optimizers do: at this stage "
            f"p.grad is None after backward (the gradients of {sharded._param_name(index)} and the others are "
            "in the optimizer's buckets and shards) and opt.state[p] takes no keys of its own, so such a wrapper "
            "skips what it does for parameters without p.grad (timm's Lookahead: its slow update) or fails. Keep "
            "the wrapper's values per parameter in a dict of its own, test p.requires_grad rather than p.grad, and "
            "hold the ShardedFusedAdam as .optimizer"
        )


def _refuse_foreign_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    sharded = live.optimizers()
    if not sharded or _wraps_sharded(optimizer, sharded):
        return
    unreduced.warn_once(optimizer)
    params = [p for g in getattr(optimizer, "param_groups", ()) for p in g["params"]]
    ids = {id(p) for p in params}
    for sharded in live.training(params):
        if sharded.pipeline.grads_in_p_grad:
            continue
        taken = [i for i, p in enumerate(live.params_of(sharded)) if id(p) in ids and _taken(sharded, i, p)]
        if not taken:
            continue
        index = taken[0]
        _refuse_wrapper(optimizer, sharded, index)
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): {sharded._param_name(index)} is trained by a live ShardedFusedAdam "
            f"at stage {sharded.options.stage}, which takes its gradients out of p.grad during backward (into its "
            "buckets and shards), so this optimizer would find none and leave the parameters unchanged. Step the "
            "ShardedFusedAdam, or let it go first (del it, so that it is garbage collected) and build this one from "
            "its full_state_dict()"
        )
