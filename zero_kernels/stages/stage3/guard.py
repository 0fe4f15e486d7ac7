"""Stage 3: a freed parameter that is computed with is caught at that operation, not after it went wrong.

A freed parameter holds an empty tensor; used by mistake (by a module that does not gather it, or
outside any forward) it would fail with a puzzling size mismatch deep inside an operator, or worse,
give a quiet wrong number (``p.sum()`` is 0). ``mark_freed`` changes the parameter's class to a
subclass of its own with a ``__torch_function__`` (as torch's ``UninitializedParameter`` changes
its class when it is materialised): any operation on it first calls the ``on_use`` callback given,
which gathers the parameter or raises a clear error. ``mark_gathered`` restores the class, so a
gathered parameter costs nothing extra. Reading metadata (shape, dtype, ``.data``, ``.grad``,
hooks, ``detach()``) is not a use, nor is naming it in backward's ``inputs=``, nor ``p.grad = None``,
nor are the conversions ``nn.Module.to()``, ``.half()``, ``.cpu()`` and the like apply to every
parameter (frameworks call them on a built model): on an empty tensor they give an empty tensor.
``p.grad = g`` with a non-empty ``g`` is a use (no gradient of the full shape fits a freed parameter).
The ``torch.nn.init`` functions that skip ``__torch_function__`` (``kaiming_normal_`` would do nothing on the
empty tensor, ``xavier_uniform_`` fail naming no parameter) are wrapped the first time a parameter is freed, so
they are uses too.

What ``.data``, ``detach()`` and those conversions return for a freed parameter is empty too, and
no gather can fill it later: computing with it (``p.data.norm()``, a snapshot ``p.data.clone()`` and
its restore ``p.data.copy_(...)``, ``ema.lerp_(p.detach())``) would be as quietly wrong. So it is a
``FreedRead``, a tensor whose ``__torch_function__`` passes metadata and those reads and calls the
``on_read_use`` callback given to ``mark_freed`` (which raises) on any other operation. A deep copy of
a freed parameter (``copy.deepcopy(model)``: ``AveragedModel``, EMA helpers) would be empty too: it
calls ``on_use(param, copy.deepcopy)``, which raises; so would a pickled one (``torch.save(model)``, or
``torch.save((opt, model))``, whose model the loaded optimizer would not train): ``on_use(param, pickle.dumps)``.

The callbacks are held weakly: once the scheduler that freed a parameter is gone (its optimizer deleted and
collected), the shards that held its values are gone too, and any use of the parameter, or of what its ``.data``
gave, raises ``ORPHANED`` instead of computing with an empty tensor. (A ``FreedRead`` whose scheduler was replaced,
the hooks put back after a copy, asks the one now in charge.)

Under ``torch.compile`` the callback, and stage 3's hooks (``run_eagerly``), run eagerly: they
issue collectives and change parameters, which a compiled graph must not capture.
"""

from __future__ import annotations

import collections
import copy
import functools
import itertools
import pickle
import sys
import types
import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch._C import _disabled_torch_function_impl

from ..casts import note_cast
from ..class_mark import Mark, mark, tensors, torch_function, unmark

OnUse = Callable[[nn.Parameter, Any], None]  # (parameter, the torch function about to run)

_PASS = {
    "__get__", "__set__", "__delete__", "size", "dim", "numel", "nelement", "element_size", "is_contiguous",
    "data_ptr", "untyped_storage", "storage", "_typed_storage", "detach", "requires_grad_", "register_hook",
    "register_post_accumulate_grad_hook", "__repr__", "__format__", "__reduce_ex__", "__deepcopy__", "__setstate__",
    "__dir__", "is_floating_point", "is_complex", "get_device",
    "to", "cpu", "cuda", "float", "half", "bfloat16", "double", "type", "empty_like", "share_memory_", "pin_memory",
    "_has_compatible_shallow_copy_type",
}  # fmt: skip
_VALUE_VIEWS = ("T", "mT", "H", "mH")
_READS = {"detach", "to", "cpu", "cuda", "float", "half", "bfloat16", "double", "type"}  # results stay marked
_METADATA = {
    "__get__", "__set__", "size", "dim", "numel", "nelement", "element_size", "is_contiguous", "data_ptr",
    "untyped_storage", "storage", "_typed_storage", "__repr__", "__format__", "__dir__", "is_floating_point",
    "is_complex", "get_device", "_has_compatible_shallow_copy_type", *_READS,
}  # fmt: skip
UNDER_TRANSFORM = (
    "ZeRO stage 3: the model's forward runs inside a torch.func transform (vmap, grad, jacrev, ...), where stage 3 "
    "cannot gather parameters: a gather writes in place into buffers the transform captures. Run the transform "
    "inside `with optimizer.gathered_params():` on every rank (every parameter is whole there and the forward gathers "
    "nothing), e.g. per-sample gradients: with opt.gathered_params(): params = {k: v.detach() for k, v in "
    "model.named_parameters()}; g = vmap(grad(loss_fn), in_dims=(None, 0))(params, x)"
)
ORPHANED = (
    "the stage-3 optimizer that kept its shards was deleted, and its values went with it (it is an empty tensor). "
    "Take the full weights out before deleting the optimizer (zero_kernels.save_pretrained(model, optimizer, "
    "directory), or a state dict taken inside `with optimizer.gathered_params():`) and load them into a fresh model, "
    "or give each parameter its value again (`p.data = value`)"
)
_on_use: dict[int, "weakref.WeakMethod"] = {}  # id(parameter) -> callback of the scheduler that freed it
_on_read_use: dict[int, "weakref.WeakMethod"] = {}  # id(parameter) -> its callback for uses of what it gave
_epoch: dict[int, int] = {}  # id(freed parameter) -> a new number at each free and each adoption of assigned values
_epochs = itertools.count()
# id(parameter) -> (storage, epoch) of the empty tensors its latest .data reads gave (held, so no address is reused)
_reads: dict[int, "collections.deque[tuple[torch.UntypedStorage, Optional[int]]]"] = {}
_alive: dict[int, "weakref.ref[nn.Parameter]"] = {}  # id(parameter) -> its reference, whose end drops its entries


def _follow(param: nn.Parameter) -> None:
    """Drop ``param``'s entries from the tables above once it is collected: they are keyed by ``id``, and a
    hyper-parameter search building a model and a stage-3 optimizer after another left a set per parameter."""
    key = id(param)
    ref = _alive.get(key)
    if ref is None or ref() is not param:
        _alive[key] = weakref.ref(param, lambda r, key=key: _forget(key) if _alive.get(key) is r else None)


def _forget(key: int) -> None:
    for table in (_alive, _on_use, _on_read_use, _epoch, _reads):
        table.pop(key, None)


def _orphaned_use(func: Any) -> str:
    return f"ZeRO stage 3: a parameter that holds no values is used ({operation_name(func)}): {ORPHANED}"


def _callback(table: dict[int, "weakref.WeakMethod"], param: Any, func: Any) -> Optional[OnUse]:
    """The callback ``table`` holds for ``param`` (None: none); raises ``ORPHANED`` where its scheduler is gone
    (but for a use of a parameter given values again: ``_emptied``)."""
    ref = table.get(id(param))
    if ref is None:
        return None
    callback = ref()
    if callback is None:
        if table is _on_use and not _emptied(param):
            return None
        raise RuntimeError(_orphaned_use(func))
    return callback


def _emptied(param: nn.Parameter) -> bool:
    """Whether ``param``, freed by a scheduler that is gone, still holds no values. One given values again
    (``p.data = value``, before or after its scheduler went) is an ordinary parameter from here on, for the next
    optimizer on the same model; what was read of it while it was empty still raises (``_on_read_use`` stays)."""
    with torch._C.DisableTorchFunctionSubclass():
        empty = param.numel() == 0
    if not empty:
        _on_use.pop(id(param), None)
        unmark(param, _Freed)
    return empty


# backward's ``inputs=[p]`` names where gradients go, it reads no values: backward gathers as without it
_TARGETS = (torch.autograd.backward, torch.Tensor.backward)


def _sets_grad(func: Any) -> bool:
    """``func`` is ``p.grad = ...``."""
    return (
        getattr(func, "__name__", "") == "__set__"
        and getattr(getattr(func, "__self__", None), "__name__", "") == "grad"
    )


def _views_values(func: Any) -> bool:
    """``func`` is ``p.T``, ``p.mT``, ``p.H`` or ``p.mH``: a view of the values, which a module computes with
    (``x @ w.T``); ``p.data`` and ``detach()`` are metadata reads (``FreedRead``)."""
    descriptor = getattr(func, "__self__", None)
    return getattr(func, "__name__", "") == "__get__" and getattr(descriptor, "__name__", "") in _VALUE_VIEWS


def _uses(func: Any, args: tuple) -> bool:
    """Whether ``func`` on ``args`` uses a freed parameter's values (or, ``p.grad = g`` with a non-empty ``g`` of
    another shape, would give it a gradient of a shape it does not have now)."""
    if _views_values(func):
        return True
    if _sets_grad(func):  # (the optimizer's own code gives ``p.data`` the full shape first: not a use)
        grad = args[1] if len(args) > 1 else None
        return isinstance(grad, torch.Tensor) and grad.numel() > 0 and grad.shape != args[0].shape
    return getattr(func, "__name__", "") not in _PASS and func not in _TARGETS


def _report_use(t: Any, func: Any) -> None:
    """An operation ``func`` on ``t``: a freed parameter's ``on_use`` is called, a ``FreedRead``'s report (or, its
    hooks put back since, the one of the scheduler now in charge); other tensors: nothing."""
    if isinstance(t, _Freed):
        callback = _callback(_on_use, t, func)
    elif isinstance(t, FreedRead):
        param = t._zk_param()
        callback = None if param is None else (t._zk_report() or _callback(_on_read_use, param, func))
        t = param
    else:
        return
    if callback is not None:
        callback(t, func)


def sets_data(func: Any) -> bool:
    """``func`` is ``p.data = ...``."""
    return (
        getattr(func, "__name__", "") == "__set__"
        and getattr(getattr(func, "__self__", None), "__name__", "") == "data"
    )


def _stale(param: nn.Parameter, value: Any) -> bool:
    """``param.data = value``, ``value`` the empty tensor a ``.data`` read of ``param`` (or a ``FreedRead`` of another
    parameter) gave before ``param``'s latest free or adoption: it would keep whatever ``param`` got since, where torch
    puts back the values it was read from. ``p.data, e.data = e.data, p.data`` outside ``gathered_params()`` to
    evaluate with an EMA, and back: the EMA reaches the shard at the evaluation's gather, ``e`` keeps the empty
    tensor, and the swap back changed nothing: training went on from the EMA, the trained weights lost."""
    if not isinstance(value, torch.Tensor) or value is param:
        return False
    with torch._C.DisableTorchFunctionSubclass():
        if value.numel() != 0:
            return False
        if isinstance(value, FreedRead):
            return value._zk_param() is not param or getattr(value, "_zk_epoch", None) != _epoch.get(id(param))
        storage = value.untyped_storage()._cdata
    return any(s._cdata == storage and e != _epoch.get(id(param)) for s, e in _reads.get(id(param), ()))


def _stale_assignment(param: nn.Parameter, value: torch.Tensor, func: Any) -> None:
    """Raise through ``param``'s read callback (it names ``param``) for a stale ``param.data = value``."""
    if isinstance(value, FreedRead) and value._zk_param() is not None:
        _report_use(value, func)
    callback = _callback(_on_read_use, param, func)
    if callback is not None:
        callback(param, func)


def _handle(func: Any, types: Any, args: tuple, kwargs: Any) -> Any:
    if len(args) > 1 and isinstance(args[0], _Freed) and sets_data(func):
        if _stale(args[0], args[1]):
            _stale_assignment(args[0], args[1], func)
        elif isinstance(args[1], torch.Tensor) and not isinstance(args[1], FreedRead) and args[1].numel() == 0:
            _epoch[id(args[0])] = next(_epochs)  # emptied again: the shard took the values assigned (an adoption)
        note_cast(args[0], args[1])
    if _uses(func, args):
        for t in tensors(args, kwargs):
            if isinstance(t, _Freed):
                _report_use(t, func)
    result = _disabled_torch_function_impl(func, types, args, kwargs or {})
    if args and isinstance(args[0], _Freed) and not torch.compiler.is_compiling():
        return _mark_read(func, result, args[0], _on_read_use.get(id(args[0])))
    return result


class _Freed(Mark):
    """Mixed into a parameter's class while the parameter is freed."""

    __torch_function__ = torch_function(_handle)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A copy of a freed parameter would be empty: ``on_use(param, copy.deepcopy)`` raises (or copies it as
        it is when no callback is registered)."""
        original = self._zk_original  # taken first: a parameter given values again loses its mark in the report
        _report_use(self, copy.deepcopy)
        return original.__deepcopy__(self, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled, a freed parameter would be empty (``torch.save(model)``): ``on_use(param, pickle.dumps)`` raises
        (or pickles it as it is when no callback is registered: the optimizer's own copy of the model)."""
        original = self._zk_original
        _report_use(self, pickle.dumps)
        return original.__reduce_ex__(self, protocol)


def _is_read(func: Any) -> bool:
    """``func`` gives a tensor holding (a view or a copy of) its argument's values: ``.data``, detach, conversions."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") in ("data", "T", "mT", "H", "mH")
    return name in _READS


def _mark_read(func: Any, result: Any, param: nn.Parameter, report: "weakref.WeakMethod | None") -> Any:
    """``result`` as a ``FreedRead`` of ``param`` when ``func`` read an emptied parameter (see the module docstring)."""
    if report is None or not _is_read(func) or not isinstance(result, torch.Tensor) or result is param:
        return result
    if isinstance(result, nn.Parameter) or result.numel() != 0:
        return result
    read = result.as_subclass(FreedRead)
    read._zk_param, read._zk_report = weakref.ref(param), report
    read._zk_epoch = _epoch.get(id(param))
    reads, storage = _reads.setdefault(id(param), collections.deque(maxlen=4)), result.untyped_storage()
    if not any(s._cdata == storage._cdata for s, _ in reads):  # reads of one free share its empty storage
        reads.append((storage, read._zk_epoch))
    return read


class FreedRead(torch.Tensor):
    """What ``.data``, ``detach()`` or a conversion gave for a freed parameter: empty, and unusable but for metadata."""

    _zk_param: "weakref.ref"
    _zk_report: "weakref.WeakMethod"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") not in _METADATA:
            for t in tensors(args, kwargs):
                if isinstance(t, FreedRead):
                    _report_use(t, func)
        result = _disabled_torch_function_impl(func, types, args, kwargs or {})
        if args and isinstance(args[0], FreedRead):
            source = args[0]
            param = source._zk_param()
            if param is not None and not isinstance(result, FreedRead):
                read = _mark_read(func, result, param, source._zk_report)
                if isinstance(read, FreedRead):
                    read._zk_epoch = getattr(source, "_zk_epoch", None)  # read when its source was
                return read
        return result


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


# ``torch.nn.init`` functions that skip ``__torch_function__``: on a freed parameter they read its shape (0,) and do
# nothing (``kaiming_normal_``: "Initializing zero-element tensors is a no-op") or fail naming no parameter
_INITS = ("kaiming_normal_", "xavier_uniform_", "xavier_normal_", "orthogonal_", "eye_", "dirac_", "sparse_")


def _guarded_init(init: Callable) -> Callable:
    @functools.wraps(init)
    def guarded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        _report_use(tensor, init)
        return init(tensor, *args, **kwargs)

    guarded._zk_guarded = True  # type: ignore[attr-defined]
    return guarded


def _guard_inits() -> None:
    """Put ``_report_use`` in front of the ``_INITS``, once: on a freed parameter they gather it or raise, naming it. In
    ``torch.nn.init`` and in every module loaded by then that bound them by name, under any name (``from
    torch.nn.init import xavier_uniform_``: torch's MultiheadAttention and Transformer do)."""
    guarded = {}
    for name in _INITS:
        init = getattr(torch.nn.init, name, None)
        if init is not None and not getattr(init, "_zk_guarded", False):
            guarded[id(init)] = _guarded_init(init)
            setattr(torch.nn.init, name, guarded[id(init)])
    if not guarded:
        return
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        for name, value in list(names.items()) if isinstance(names, dict) else ():
            if type(value) is types.FunctionType and id(value) in guarded:  # also under another name
                names[name] = guarded[id(value)]


def mark_freed(param: nn.Parameter, on_use: OnUse, on_read_use: Optional[OnUse] = None) -> None:
    """From now on an operation on ``param`` first calls ``on_use(param, func)``, and one on what its ``.data``,
    ``detach()`` or a conversion gives calls ``on_read_use(param, func)``, which must raise (bound methods, held
    weakly; without ``on_read_use`` those reads give plain empty tensors)."""
    _guard_inits()
    _follow(param)
    _on_use[id(param)] = weakref.WeakMethod(on_use)
    _epoch[id(param)] = next(_epochs)
    if on_read_use is not None:
        _on_read_use[id(param)] = weakref.WeakMethod(on_read_use)
    mark(param, _Freed)


def mark_gathered(param: nn.Parameter) -> None:
    """``param`` holds its value again: its own class back, no callback."""
    _on_use.pop(id(param), None)
    _on_read_use.pop(id(param), None)
    unmark(param, _Freed)


def freed_by(param: nn.Parameter) -> Optional[bool]:
    """Whether ``param`` is freed by a scheduler that still exists (True), freed by one that is gone (False: it
    holds no values any more), or not freed (None)."""
    ref = _on_use.get(id(param)) if isinstance(param, _Freed) else None
    if ref is None:
        return None
    return True if ref() is not None else (False if _emptied(param) else None)


def operation_name(func: Any) -> str:
    """A readable name of the torch function ``func`` for error messages."""
    if _sets_grad(func):
        return "p.grad = ..."
    if sets_data(func):
        return "p.data = ..."
    if _views_values(func):
        return f"p.{func.__self__.__name__}"
    name = getattr(func, "__name__", None) or repr(func)
    module = getattr(func, "__module__", None) or ""
    return name if module.startswith("torch._C") or not module else f"{module}.{name}"


def outside_forward(name: str, func: Any, where: str, needs_grad: bool) -> str:
    """The error for freed parameter ``name`` used by ``func`` ``where`` no module gathers it; ``needs_grad``: the
    use would need its gradient (grad mode on, the parameter trainable), which ``gathered_params()`` cannot give:
    its end frees the values backward would read."""
    head = f"ZeRO stage 3: parameter '{name}' is used ({operation_name(func)}) {where}, where it is not gathered: "
    if func is torch.autograd.grad:
        return head + (
            "torch.autograd.grad with respect to parameters is not supported at stage 3 (nor by DDP): backward "
            "reduces each parameter's gradient into the ranks' shards as its module's backward ends, and the "
            "parameter holds its values only around its module's forward and backward. Call loss.backward() and "
            "let the optimizer step; torch.autograd.grad with respect to inputs (not parameters) works"
        )
    if _sets_grad(func):
        return head + (
            "it holds no values between uses (shape (0,)), so a gradient of its full shape cannot be set on it. Set "
            "gradients by hand inside `with optimizer.gathered_params():`, where parameters have their full shapes "
            "(the next step reduces them as backward's), or let backward make them"
        )
    fix = (
        "Read it inside a module's forward (register it there with zero_kernels.register_external_parameter(module, "
        "parameter) if another module holds it), or inside `with optimizer.gathered_params():`"
    )
    if getattr(func, "__name__", "").endswith("_") and not getattr(func, "__name__", "").startswith("__"):
        fix = (
            "An in-place write (an initialisation, a fill) goes inside `with optimizer.gathered_params():`, the same "
            "on every rank (it then reaches every rank's shard and master), or before the optimizer is built"
        )
    elif needs_grad:
        fix = (
            "A term that needs its gradient (an L2 penalty added to the loss, a head tied to it) must be computed "
            "inside a module's forward, e.g. the model's own: register the parameter for that module with "
            "zero_kernels.register_external_parameter(module, parameter) when another module holds it. "
            "`with optimizer.gathered_params():` is for reads without gradients (its end frees the values that "
            "backward would need). An L2 penalty lam * sum(p**2) is also what ShardedFusedAdam(..., "
            "weight_decay=2 * lam, adam_w_mode=False) adds to the gradients in the step"
        )
    return (
        head + "stage 3 gathers parameters only around the forward (and backward) of the modules that need them. " + fix
    )
