"""Another optimizer's parameters in a model a ``ShardedFusedAdam`` trains on several ranks: their gradients are the
rank's own.

No ``DistributedDataParallel`` wraps the model: the sharded optimizer reduces the gradients of the parameters it
trains, and no others. Parameters of the same model given to another optimizer (``torch.optim.SGD`` for the
embeddings, a Muon-style split of the matrices) keep this rank's own gradient in ``p.grad``, so each rank steps them
on its own data and the ranks drift apart without an error (DDP + two optimizers reduces them all). So the first step
of such an optimizer on some of them says so once, at WARNING, naming one, with the two ways out: all-reduce their
gradients before that step (which it cannot see: a loop that does is told too), or give them to the
``ShardedFusedAdam`` (param groups give them other settings). Only
parameters of a model a live sharded optimizer was given (``pipeline.module``: at stage 3, or built on a module or
with ``module=``) are looked at: a reference model trained beside it on each rank is left alone.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from .. import live

log = logging.getLogger("zero_kernels")

_said: "weakref.WeakSet[Any]" = weakref.WeakSet()  # optimizers already warned about (or found clean)


def _name(module: torch.nn.Module, p: torch.Tensor) -> str:
    return next((name for name, q in module.named_parameters() if q is p), f"of shape {tuple(p.shape)}")


def warn_once(optimizer: Any) -> None:
    """At ``optimizer``'s first step that finds gradients, warn if some of its parameters belong to a model a live
    ``ShardedFusedAdam`` trains on several ranks without being trained by one (see the module docstring)."""
    if optimizer in _said:
        return
    params = [p for g in getattr(optimizer, "param_groups", ()) for p in g["params"]]
    if not any(getattr(p, "grad", None) is not None for p in params):
        return
    _said.add(optimizer)
    held = live.owners()
    for sharded in live.optimizers():
        module = sharded.pipeline.module
        if module is None or sharded.pipeline.world_size < 2:
            continue
        mine = {id(p) for p in module.parameters()}
        loose = [p for p in params if p.grad is not None and id(p) in mine and id(p) not in held]
        if loose:
            more = f" and {len(loose) - 1} more" if len(loose) > 1 else ""
            log.warning(
                "%s.step(): parameter %r%s of the model a ShardedFusedAdam trains on %d ranks: the ShardedFusedAdam "
                "reduces the gradients of the parameters it trains only (no DistributedDataParallel wraps the model), "
                "so these keep each rank's own gradient unless the loop all-reduces them before this step "
                "(torch.distributed.all_reduce(p.grad, op=ReduceOp.AVG)); without it each rank steps them on its own "
                "data and the ranks drift apart. Or give them to the ShardedFusedAdam (a param group gives them other "
                "settings). Said once, whether or not the loop reduces them",
                type(optimizer).__name__,
                _name(module, loose[0]),
                more,
                sharded.pipeline.world_size,
            )
            return
