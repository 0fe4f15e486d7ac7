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
left alone.
"""

from __future__ import annotations

from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import live

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


def _refuse_foreign_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    sharded = live.optimizers()
    if not sharded or _wraps_sharded(optimizer, sharded):
        return
    # a tensor that does not require grad gets no gradient from backward: the sharded optimizer takes nothing there
    params = [p for g in getattr(optimizer, "param_groups", ()) for p in g["params"] if p.requires_grad]
    ids = {id(p) for p in params}
    for sharded in live.training(params):
        if sharded.pipeline.grads_in_p_grad:
            continue
        index = next(i for i, p in enumerate(live.params_of(sharded)) if id(p) in ids)
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): {sharded._param_name(index)} is trained by a live ShardedFusedAdam "
            f"at stage {sharded.options.stage}, which takes its gradients out of p.grad during backward (into its "
            "buckets and shards), so this optimizer would find none and leave the parameters unchanged. Step the "
            "ShardedFusedAdam, or let it go first (del it, so that it is garbage collected) and build this one from "
            "its full_state_dict()"
        )
