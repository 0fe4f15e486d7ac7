"""A client optimizer, ``deepspeed.initialize(model, optimizer=..., lr_scheduler=...)``, as ``zk.initialize`` takes it.

DeepSpeed wraps the optimizer a script built (``torch.optim.AdamW(model.parameters(), lr=...)``, or the one a
callable builds from ``model_parameters``) in its ZeRO optimizer, which updates with that optimizer's param groups;
the config's ``optimizer`` section is then not used. zero_kernels builds its ``ShardedFusedAdam`` from the same
groups: each group's parameters, hyper-parameters (``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``,
``maximize``) and any other key in it (a scheduler's ``initial_lr``); ``torch.optim.Adam`` adds its weight decay
to the gradient (L2) unless built with ``decoupled_weight_decay=True``, ``torch.optim.AdamW`` decouples it. A client
that has stepped already hands over its state (``load_state_dict``). A scheduler object built on the client (the
usual ``get_linear_schedule_with_warmup(optimizer, ...)`` before ``deepspeed.initialize``) is moved onto the new
optimizer, whose groups carry the keys it keeps there, and steps at applied updates as the config's does.

Other optimizer classes are refused naming the class: ``ShardedFusedAdam`` runs Adam and AdamW only.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Iterable, Optional

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

CLIENT_CLASSES = (torch.optim.Adam, torch.optim.AdamW)
_IMPLEMENTATION = ("foreach", "fused", "capturable")  # how torch runs the step: ShardedFusedAdam's own is used


def resolve(client: Any, model: nn.Module, model_parameters: Optional[Iterable[Any]]) -> torch.optim.Optimizer:
    """The client optimizer: ``client`` itself, or what a callable builds from ``model_parameters`` (the model's
    parameters when None), as DeepSpeed calls it; ``ValueError`` for anything but Adam or AdamW."""
    if not isinstance(client, torch.optim.Optimizer) and callable(client):
        client = client(model.parameters() if model_parameters is None else model_parameters)
    if type(client) not in CLIENT_CLASSES:
        raise ValueError(
            f"initialize: optimizer= {type(client).__name__} is not taken: zero_kernels shards Adam and AdamW "
            "only. Pass torch.optim.AdamW(...) or torch.optim.Adam(...) (or a callable building one from the "
            'parameters), or describe it in the config\'s "optimizer" section ({"type": "AdamW", "params": '
            '{"lr": ...}})'
        )
    return client


def groups(client: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The client's param groups as ``ShardedFusedAdam`` takes them (empty ones left out, as DeepSpeed does); its
    implementation flags (``foreach``, ``fused``, ``capturable``) left to ``ShardedFusedAdam``."""
    taken = []
    for group in client.param_groups:
        if group["params"]:
            copy = {k: v for k, v in group.items() if k not in _IMPLEMENTATION}
            taken.append({**copy, "params": list(group["params"])})
    return taken


def decoupled(client: torch.optim.Optimizer) -> bool:
    """Whether the client decouples its weight decay: AdamW, or Adam built with ``decoupled_weight_decay=True`` (a
    group saying otherwise is refused by ``ShardedFusedAdam``, which has one mode)."""
    return bool(client.defaults.get("decoupled_weight_decay", isinstance(client, torch.optim.AdamW)))


def defaults(client: torch.optim.Optimizer) -> dict[str, Any]:
    """The client's defaults ``ShardedFusedAdam`` takes (those a later ``add_param_group`` fills in)."""
    keys = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "differentiable")
    return {k: client.defaults[k] for k in keys if k in client.defaults}


def adopt_state(client: torch.optim.Optimizer, optimizer: torch.optim.Optimizer) -> None:
    """The state of a client that has stepped, loaded into ``optimizer`` (nothing for a new one)."""
    if client.state:
        optimizer.load_state_dict(client.state_dict())


def built_on(scheduler: Any, client: Optional[torch.optim.Optimizer]) -> bool:
    """Whether ``scheduler`` is a scheduler object stepping ``client``."""
    return client is not None and isinstance(scheduler, LRScheduler) and scheduler.optimizer is client


def move_scheduler(scheduler: LRScheduler, optimizer: torch.optim.Optimizer) -> LRScheduler:
    """``scheduler``, built on the client, stepping ``optimizer`` from now on (and the schedulers it chains, as
    ``SequentialLR`` and ``ChainedScheduler`` keep them); ``optimizer.step`` is marked as torch marks the step of
    the optimizer a scheduler is built on, so the scheduler's first ``step()`` does not warn."""
    for inner in [scheduler, *getattr(scheduler, "_schedulers", ())]:
        inner.optimizer = optimizer
    _mark_step(optimizer)
    return scheduler


def _mark_step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step`` setting ``optimizer._opt_called`` as a scheduler's constructor makes it (through a weak
    reference: the optimizer stays free of a reference cycle)."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return
    func, ref = step.__func__, weakref.ref(optimizer)

    @functools.wraps(func)
    def marked(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        target._opt_called = True  # type: ignore[union-attr]
        return func(target, *args, **kwargs)

    marked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = marked  # type: ignore[method-assign]
