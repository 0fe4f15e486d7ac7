"""A client optimizer, ``deepspeed.initialize(model, optimizer=..., lr_scheduler=...)``, as ``zk.initialize`` takes it.

DeepSpeed wraps the optimizer a script built (``torch.optim.AdamW(model.parameters(), lr=...)``, or the one a
callable builds from ``model_parameters``) in its ZeRO optimizer, which updates with that optimizer's own param
groups; the config's ``optimizer`` section is then not used. zero_kernels builds its ``ShardedFusedAdam`` on the same
group dicts (``groups``: shared, not copied, so that whatever changes the client's groups, such as a scheduler built
on the client and stepped by the script, or ``client.param_groups[0]["lr"] = ...``, changes the update; empty
groups are removed from the client, as DeepSpeed removes them): each group's parameters, hyper-parameters (``lr``,
``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``maximize``) and any other key in it (a scheduler's
``initial_lr``); ``torch.optim.Adam`` adds its weight decay to the gradient (L2) unless built with
``decoupled_weight_decay=True``, ``torch.optim.AdamW`` decouples it. A client that has stepped already hands over its
state (``load_state_dict``). A scheduler object built on the client and passed (the usual
``get_linear_schedule_with_warmup(optimizer, ...)`` before ``deepspeed.initialize``) is moved onto the new optimizer,
with the schedulers it chains, and steps at applied updates as the config's does. The client itself is retired
(``retire``): its ``step()`` raises, since stepping it would update the replicated parameters with this rank's
unreduced gradients, and so do its ``load_state_dict()`` and ``add_param_group()``, which the ShardedFusedAdam
would not follow.

Other optimizer classes are refused naming the class: ``ShardedFusedAdam`` runs Adam and AdamW only.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

CLIENT_CLASSES = (torch.optim.Adam, torch.optim.AdamW)


def resolve(client: Any, model: nn.Module, model_parameters: Optional[Iterable[Any]]) -> torch.optim.Optimizer:
    """The client optimizer: ``client`` itself, or what a callable builds from ``model_parameters`` (the model's
    parameters when None), as DeepSpeed calls it; ``ValueError`` for anything but Adam or AdamW."""
    if not isinstance(client, torch.optim.Optimizer) and callable(client):
        client = client(model.parameters() if model_parameters is None else model_parameters)
    if type(client) not in CLIENT_CLASSES:
        built = type(client).__name__ == "ShardedFusedAdam"
        instead = (
            "it is zero_kernels' optimizer already: use it without initialize, which builds its own"
            if built
            else "zero_kernels shards Adam and AdamW only. Pass torch.optim.AdamW(...) or torch.optim.Adam(...) (or a "
            'callable building one from the parameters), or describe it in the config\'s "optimizer" section '
            '({"type": "AdamW", "params": {"lr": ...}})'
        )
        raise ValueError(f"initialize: optimizer= {type(client).__name__} is not taken: {instead}")
    return client


def groups(client: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The client's param group dicts themselves, for ``ShardedFusedAdam`` to share: its empty groups removed from
    it (as DeepSpeed removes them) and ``capturable`` (torch's CUDA-graph form of its own step) cleared."""
    client.param_groups[:] = [g for g in client.param_groups if g["params"]]
    for group in client.param_groups:
        if group.get("capturable"):
            group["capturable"] = False
    return client.param_groups


def hyper(client: torch.optim.Optimizer) -> dict[str, Any]:
    """``ShardedFusedAdam``'s keyword arguments for the client's algorithm: its defaults and its weight-decay mode
    (``adam_w_mode``); its params are ``groups(client)``."""
    return {**defaults(client), "adam_w_mode": decoupled(client)}


def keep(client: torch.optim.Optimizer) -> Callable[[], None]:
    """A function putting the client's param groups back as they are now (the list, each dict's keys and values, and
    the values of the tensors in them: a scheduler writes a tensor ``lr`` or ``betas`` in place), for an initialize
    that fails after ``groups``, the ``ShardedFusedAdam`` built on them or a scheduler changed them."""
    kept = [(group, dict(group)) for group in client.param_groups]
    values = [(t, t.detach().clone()) for _, items in kept for t in _hyper_tensors(items)]

    def restore() -> None:
        for group, items in kept:
            group.clear()
            group.update(items)
        client.param_groups[:] = [group for group, _ in kept]
        with torch.no_grad():
            for tensor, value in values:
                tensor.copy_(value)

    return restore


def _hyper_tensors(group: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors a group's hyper-parameters hold (a tensor ``lr``, tensor ``betas``), not its parameters."""
    found = []
    for key, value in group.items():
        if key in ("params", "param_names"):
            continue
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, torch.Tensor):
                found.append(item)
    return found


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
    """``scheduler``, built on the client, stepping ``optimizer`` from now on, with the schedulers it chains at any
    depth (``SequentialLR`` and ``ChainedScheduler`` keep them in ``_schedulers``); ``optimizer.step`` is marked as
    torch marks the step of the optimizer a scheduler is built on, so the scheduler's first ``step()`` does not
    warn."""
    pending = [scheduler]
    while pending:
        inner = pending.pop()
        inner.optimizer = optimizer
        pending.extend(getattr(inner, "_schedulers", ()))
    _mark_step(optimizer)
    return scheduler


_RETIRED = {
    "step": "stepping this one would update the parameters with this rank's unreduced gradients",
    "load_state_dict": "loading into this one would give it group dicts the ShardedFusedAdam does not share",
    "add_param_group": "a group added here would not be trained",
}


def retire(client: torch.optim.Optimizer, optimizer: torch.optim.Optimizer) -> None:
    """The client, once ``optimizer`` trains with its groups: its ``step()``, ``load_state_dict()`` and
    ``add_param_group()`` raise saying to call the ShardedFusedAdam's instead, and each step of ``optimizer`` counts
    as the client's for the schedulers still built on it (torch's check that ``optimizer.step()`` ran before
    ``lr_scheduler.step()``)."""
    for method, why in _RETIRED.items():
        setattr(client, method, _refusal(type(client).__name__, method, why))
    client.step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer._step_marks.append(weakref.ref(client))  # every call, micro-steps too (the step hooks run at updates)


def _refusal(name: str, method: str, why: str) -> Callable[..., None]:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"this {name} was given to zero_kernels.initialize(optimizer=...): call {method}() of the "
            f"ShardedFusedAdam that initialize returned (it trains with this optimizer's param groups); {why}"
        )

    return refuse


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
