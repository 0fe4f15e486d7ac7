"""Callbacks of the optimizer that autograd or a module calls (hooks, the end of a backward): held weakly and run
eagerly.

``weakly(method, *first)`` calls ``method`` (a bound method) with ``first`` before the caller's arguments through a
weak reference: a hook stays on a parameter, on the model or on a graph node (a tensor's hooks are invisible to the
cycle collector), and must not keep its object, and through it the optimizer, its shards and its files, alive; once
the object is gone the call does nothing (or, given ``gone``, raises it: a call that cannot go on without the
object, such as a stage-3 backward that must gather parameters the deleted optimizer freed). It runs eagerly, never
traced: a backward called inside a compiled function (a whole compiled ``train_step``) calls it under Dynamo. One
module-level function is disabled for Dynamo, once: a wrapper made per callback (``torch._disable_dynamo`` of a
closure) would be built at each one's first call (a graph node's hook is made by every forward) and would hold its
closure in a reference cycle until the collector runs.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Optional

import torch


def weakly(method: Callable[..., Any], *first: Any, gone: Optional[str] = None) -> Callable[..., Any]:
    """``method`` called with ``first`` before the caller's arguments, through a weak reference, eagerly; once
    its object is gone: nothing, or ``RuntimeError(gone)``."""
    return functools.partial(_call_weakly, weakref.WeakMethod(method), first, gone)


@torch._disable_dynamo  # one function, disabled once
def _call_weakly(ref: weakref.WeakMethod, first: tuple, gone: Optional[str], *args: Any, **kwargs: Any) -> Any:
    bound = ref()
    if bound is None and gone is not None:
        raise RuntimeError(gone)
    return None if bound is None else bound(*first, *args, **kwargs)
