"""The scheduler a config builds steps at applied updates only, as DeepSpeed's engine steps it.

DeepSpeed's engine calls ``lr_scheduler.step()`` at an accumulation boundary whose update was applied
(not on an fp16 overflow skip). Here the training loop calls it after every ``optimizer.step()``; the
scheduler ``SchedulerConfig.build`` returns is the config's class with ``step()`` advancing only when the
optimizer's ``applied_steps`` grew since its last ``step()``, so that loop follows DeepSpeed's schedule
with ``gradient_accumulation_steps > 1`` and with skipped steps (``gate`` gives a scheduler built by the
``lr_scheduler=`` callable of ``initialize`` the same ``step()``). The subclass keeps the class's name, its
``isinstance`` checks, its ``state_dict()`` (the count seen is left out, and set again by a load) and
pickling.
"""

from __future__ import annotations

from typing import Any

from torch.optim.lr_scheduler import LRScheduler

_SEEN = "_applied_steps_seen"  # absent during the constructor's initial step, which always runs
_GATED: dict[type, type] = {}


class AtUpdates:
    """Mixin of an ``LRScheduler`` whose optimizer counts ``applied_steps`` (itself or the optimizer it wraps)."""

    optimizer: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        setattr(self, _SEEN, applied_steps(self.optimizer))

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance the schedule if the optimizer applied an update since the last call (else nothing)."""
        if _SEEN in self.__dict__:
            applied = applied_steps(self.optimizer)
            if applied == self.__dict__[_SEEN]:
                return
            self.__dict__[_SEEN] = applied
        super().step(*args, **kwargs)  # type: ignore[misc]

    def state_dict(self) -> dict[str, Any]:
        """The class's state dict (without the count seen, which belongs to this optimizer object)."""
        return {k: v for k, v in super().state_dict().items() if k != _SEEN}  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as the class does; the next ``step()`` advances after the optimizer's next applied update."""
        super().load_state_dict({k: v for k, v in state_dict.items() if k != _SEEN})  # type: ignore[misc]
        setattr(self, _SEEN, applied_steps(self.optimizer))

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        """Pickled as its class's subclass made again (the subclass is not a module attribute)."""
        return _rebuild, (type(self).__bases__[1],), self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy counts from its optimizer's count (a copied optimizer counts its own updates from 0)."""
        self.__dict__.update({k: v for k, v in state.items() if k != _SEEN})
        setattr(self, _SEEN, applied_steps(self.optimizer))


def counting(optimizer: Any) -> Any:
    """The optimizer that counts ``applied_steps``: ``optimizer`` or the one it wraps (Accelerate's
    ``AcceleratedOptimizer`` keeps it as ``.optimizer``); None when neither counts them."""
    while getattr(type(optimizer), "applied_steps", None) is None:
        optimizer = getattr(optimizer, "optimizer", None)
        if optimizer is None:
            return None
    return optimizer


def applied_steps(optimizer: Any) -> int:
    """The applied updates of ``optimizer`` or of the optimizer it wraps (``counting``)."""
    return counting(optimizer).applied_steps


def _rebuild(cls: type[LRScheduler]) -> LRScheduler:
    gated = at_updates(cls)
    return gated.__new__(gated)


def at_updates(cls: type[LRScheduler]) -> type[LRScheduler]:
    """``cls`` stepping at the optimizer's applied updates (one subclass per class, named as it)."""
    if cls not in _GATED:
        _GATED[cls] = type(cls.__name__, (AtUpdates, cls), {"__doc__": cls.__doc__, "__module__": __name__})
    return _GATED[cls]


def gate(scheduler: LRScheduler) -> LRScheduler:
    """``scheduler``, built on an optimizer that counts ``applied_steps`` (or wraps one), made to step at its
    applied updates from now on (its class becomes ``at_updates`` of its class)."""
    scheduler.__class__ = at_updates(type(scheduler))
    setattr(scheduler, _SEEN, applied_steps(scheduler.optimizer))
    return scheduler
