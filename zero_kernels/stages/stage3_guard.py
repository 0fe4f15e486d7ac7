"""Stage 3: a freed parameter that is computed with is caught at that operation, not after it went wrong.

A freed parameter holds an empty tensor; used by mistake (by a module that does not gather it, or
outside any forward) it would fail with a puzzling size mismatch deep inside an operator, or worse,
give a quiet wrong number (``p.sum()`` is 0). ``mark_freed`` changes the parameter's class to a
subclass of its own with a ``__torch_function__`` (as torch's ``UninitializedParameter`` changes
its class when it is materialised): any operation on it first calls the ``on_use`` callback given,
which gathers the parameter or raises a clear error. ``mark_gathered`` restores the class, so a
gathered parameter costs nothing extra. Reading metadata (shape, dtype, ``.data``, ``.grad``,
hooks, ``detach()``) is not a use, nor are the conversions ``nn.Module.to()``, ``.half()``,
``.cpu()`` and the like apply to every parameter (frameworks call them on a built model): on an
empty tensor they give an empty tensor.

Under ``torch.compile`` the callback, and stage 3's hooks (``run_eagerly``), run eagerly: they
issue collectives and change parameters, which a compiled graph must not capture.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch._C import _disabled_torch_function_impl

OnUse = Callable[[nn.Parameter, Any], None]  # (parameter, the torch function about to run)

_PASS = {
    "__get__", "__set__", "__delete__", "size", "dim", "numel", "nelement", "element_size", "is_contiguous",
    "data_ptr", "untyped_storage", "storage", "_typed_storage", "detach", "requires_grad_", "register_hook",
    "register_post_accumulate_grad_hook", "__repr__", "__format__", "__reduce_ex__", "__deepcopy__", "__setstate__",
    "__dir__", "is_floating_point", "is_complex", "get_device",
    "to", "cpu", "cuda", "float", "half", "bfloat16", "double", "type", "empty_like", "share_memory_", "pin_memory",
    "_has_compatible_shallow_copy_type",
}  # fmt: skip
_on_use: dict[int, "weakref.WeakMethod"] = {}  # id(parameter) -> callback of the scheduler that freed it
_classes: dict[type, type] = {}


class _Freed:
    """Mixed into a parameter's class while the parameter is freed; ``_zk_original`` is that class."""

    _zk_original: type

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if torch.compiler.is_compiling():
            return _handle_eagerly(func, types, args, kwargs)
        return _handle(func, types, args, kwargs)


def _handle(func: Any, types: Any, args: tuple, kwargs: Any) -> Any:
    if getattr(func, "__name__", "") not in _PASS:
        for t in _tensors(args, kwargs):
            ref = _on_use.get(id(t)) if isinstance(t, _Freed) else None
            callback = ref() if ref is not None else None
            if callback is not None:
                callback(t, func)
    return _disabled_torch_function_impl(func, types, args, kwargs or {})


_handle_eagerly = torch._disable_dynamo(_handle)  # torch.compile runs it (a graph break), never traces it


def run_eagerly(fn: Callable) -> Callable:
    """``fn`` as a hook that ``torch.compile`` runs eagerly (a graph break) instead of tracing it.

    Without ``torch.compile`` this costs one flag check per call.
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    disabled = torch._disable_dynamo(call)

    @functools.wraps(fn)
    def hook(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return hook


def _tensors(args: tuple, kwargs: Any) -> Iterator[Any]:
    """The arguments of an operation, and the items of list and tuple arguments (``torch.cat([a, b])``)."""
    for arg in (*args, *(kwargs or {}).values()):
        if isinstance(arg, (list, tuple)):
            yield from arg
        else:
            yield arg


def _freed_class(cls: type) -> type:
    if cls not in _classes:
        _classes[cls] = type(f"Freed{cls.__name__}", (_Freed, cls), {"_zk_original": cls})
    return _classes[cls]


def mark_freed(param: nn.Parameter, on_use: OnUse) -> None:
    """From now on an operation on ``param`` first calls ``on_use(param, func)`` (a bound method, held weakly)."""
    _on_use[id(param)] = weakref.WeakMethod(on_use)
    if not isinstance(param, _Freed):
        param.__class__ = _freed_class(type(param))


def mark_gathered(param: nn.Parameter) -> None:
    """``param`` holds its value again: its own class back, no callback."""
    _on_use.pop(id(param), None)
    if isinstance(param, _Freed):
        param.__class__ = type(param)._zk_original


def operation_name(func: Any) -> str:
    """A readable name of the torch function ``func`` for error messages."""
    name = getattr(func, "__name__", None) or repr(func)
    module = getattr(func, "__module__", None) or ""
    return name if module.startswith("torch._C") or not module else f"{module}.{name}"
