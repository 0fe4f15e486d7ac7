"""Methods a stage-3 pipeline puts on the model's modules for its life, in place of their class's: an attribute of
the module, a method bound to it (``generation``'s synced ``generate``, ``resize``'s guarded
``resize_token_embeddings``).

``put_on`` binds one on each module it is wanted on, unless the module has a method of its own under that name: ours
(bound to it, or to the model a deep copy was made from) or the class's own bound method, which a model pickled while
it had ours comes back with, are not. ``take_off`` removes it where it is still ours (the pipeline's ``close``).
"""

from __future__ import annotations

import types
from typing import Any, Callable

from torch import nn


def put_on(
    model: nn.Module, name: str, func: Callable[..., Any], wanted: Callable[[nn.Module], bool]
) -> list[nn.Module]:
    """Bind ``func`` as ``name`` on each module of ``model`` that is ``wanted`` and has no method of its own there;
    returns those modules."""
    put = []
    for module in model.modules():
        if wanted(module) and _free(module, name, func):
            setattr(module, name, types.MethodType(func, module))
            put.append(module)
    return put


def _free(module: nn.Module, name: str, func: Callable[..., Any]) -> bool:
    given = vars(module).get(name)
    return given is None or getattr(given, "__func__", None) in (func, getattr(type(module), name, None))


def take_off(modules: list[nn.Module], name: str, func: Callable[..., Any]) -> None:
    """Remove ``name`` from ``modules`` where it is still ``func`` bound (what ``put_on`` gave)."""
    for module in modules:
        if getattr(vars(module).get(name), "__func__", None) is func:
            delattr(module, name)
