"""A mark on a parameter: its class swapped for a subclass of its own whose ``__torch_function__`` sees every
operation on it (as torch's ``UninitializedParameter`` changes its class once materialised). Unmarking gives the
class back, so an unmarked parameter costs nothing. Stages 1-2 mark the parameters whose gather is in flight
(``param_gather``), stage 3 its freed parameters (``stage3.guard``)."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch import nn

Handler = Callable[[Any, Any, tuple, Any], Any]  # (func, types, args, kwargs) -> what the operation gives

_classes: dict[tuple[type, type], type] = {}  # (mark, class of a parameter) -> the marked class


class Mark:
    """Base of a mark, mixed in before a parameter's class; ``_zk_original`` is that class."""

    _zk_original: type


def torch_function(handler: Handler) -> classmethod:
    """A mark's ``__torch_function__``: ``handler`` runs every operation; under ``torch.compile`` it runs eagerly
    (a graph break), never traced (it may wait, gather or raise)."""
    eagerly = torch._disable_dynamo(handler)

    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if torch.compiler.is_compiling():
            return eagerly(func, types, args, kwargs)
        return handler(func, types, args, kwargs)

    return classmethod(__torch_function__)


def mark(param: nn.Parameter, kind: type[Mark]) -> None:
    """Give ``param`` the class ``<Kind><its class>`` (``_Freed`` on a ``Parameter``: ``FreedParameter``)."""
    if isinstance(param, kind):
        return
    cls = type(param)
    if (kind, cls) not in _classes:
        _classes[kind, cls] = type(f"{kind.__name__.lstrip('_')}{cls.__name__}", (kind, cls), {"_zk_original": cls})
    param.__class__ = _classes[kind, cls]


def unmark(param: nn.Parameter, kind: type[Mark]) -> None:
    """Give ``param`` its own class back, if it is marked ``kind``."""
    if isinstance(param, kind):
        param.__class__ = type(param)._zk_original


def tensors(args: tuple, kwargs: Any) -> Iterator[Any]:
    """The arguments of an operation, and the items of list and tuple arguments (``torch.cat([a, b])``)."""
    for arg in (*args, *(kwargs or {}).values()):
        if isinstance(arg, (list, tuple)):
            yield from arg
        else:
            yield arg
