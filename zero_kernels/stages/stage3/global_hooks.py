"""Stage 3 before the user's global forward hooks: one process-wide hook, there only while they are.

Torch runs global forward hooks (``torch.nn.modules.module.register_module_forward_hook``) before a module's
own, so they would see a module's output before its schedulers route it (``stage3.hooks``). While the user has
any, one global hook of this module runs first among them and lets every live scheduler route the module's
output; with none it is taken off, as any global hook slows every module call in the process. ``follow()``
(at every pre-forward of a scheduled module) puts it on, keeps it first, or takes it off; it also comes off
when the last scheduler leaves or is collected.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from . import guard


class Router(Protocol):
    def _route(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> Any: ...


_live: dict[int, weakref.finalize] = {}  # by id: each live router's end (``leave`` or its collection)
_handle: list[Optional[RemovableHandle]] = [None]


def _hooks() -> dict[int, Any]:
    return torch.nn.modules.module._global_forward_hooks


def _ours() -> Optional[RemovableHandle]:
    """The hook of this module while it is on (one taken off from outside counts as off)."""
    handle = _handle[0]
    if handle is not None and handle.id not in _hooks():
        handle = _handle[0] = None
    return handle


def _route(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
    for end in list(_live.values()):
        alive = end.peek()  # (router, ...) until the router leaves or is collected
        if alive is not None:
            output = alive[0]._route(module, args, kwargs, output)
    return output


def _take_off() -> None:
    handle = _ours()
    if handle is not None:
        handle.remove()
        _handle[0] = None


def join(router: Router) -> None:
    """Let ``router`` route from the global hook while it lives (or until ``leave``)."""
    if id(router) not in _live:
        _live[id(router)] = weakref.finalize(router, _gone, id(router))


def leave(router: Router) -> None:
    gone = _live.get(id(router))
    if gone is not None:
        gone()


def _gone(key: int) -> None:
    """A router left or died: the hook comes off with the last one."""
    _live.pop(key, None)
    if not _live:
        _take_off()


def follow() -> None:
    """Put the hook on (first among the global forward hooks) while the user has any, else take it off."""
    hooks = _hooks()
    handle = _ours()
    if handle is None and not hooks:
        return
    users = any(handle is None or key != handle.id for key in hooks)
    if not users:
        _take_off()
        return
    if handle is None:
        hook = guard.run_eagerly(_route)
        handle = _handle[0] = torch.nn.modules.module.register_module_forward_hook(hook, with_kwargs=True)
    if next(iter(hooks)) != handle.id:
        hooks.move_to_end(handle.id, last=False)
