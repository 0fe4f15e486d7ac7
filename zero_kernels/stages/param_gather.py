"""Stages 1-2 with ``overlap_param_gather``: the parameter all-gather after the step, finished at first use.

Without the option the step all-gathers every bucket of updated parameters and waits for all of
them before it returns, so the gather is exposed. With it (Megatron's ``overlap_param_gather``)
the step issues the same all-gathers in the same order and returns; each bucket's gather is waited
for only when a parameter it writes is first used, so the gathers run on the backend's threads
(gloo) or stream (NCCL) while the next forward computes with the buckets already there.

Every parameter of a bucket still in flight is marked pending: its class becomes a subclass of its
own with a ``__torch_function__`` (as stage 3 marks freed parameters, ``stage3_guard``). The first
operation on it that can see its values (any operation but metadata: shape, dtype, device, ``grad``,
``requires_grad``, ``data_ptr``) first waits for the gathers issued up to its last bucket, then gives
every parameter those gathers completed its own class back, and runs. So whatever reads a parameter
waits first, wherever it runs: a module's forward, a functional use in a parent's forward, a weight
tied into two modules, ``p.data``, ``p.detach()``, ``model.state_dict()``, ``model.load_state_dict``
(which would otherwise be overwritten by the gather still in flight), ``copy.deepcopy(model)``,
``torch.save``; the optimizer's own paths (step, ``zero_grad``, state dicts, checkpoints,
``gathered_params``) call ``wait`` first. What cannot be caught is a tensor taken from a parameter
before the step (a ``p.data`` or ``model.state_dict()`` kept across it) and read after: call
``opt.wait_params()`` before such a read.

Gathers complete in the order they were issued (every rank issues the same collectives in the same
order), so waiting for one bucket waits for the buckets issued before it too; a failed gather raises
``CommError`` at every use until the next step raises it as well.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn
from torch._C import _disabled_torch_function_impl

from ..comm.handles import Handle
from .class_mark import Mark, mark, tensors, torch_function, unmark
from .layout import Bucket

if TYPE_CHECKING:
    from .buffers import FlatBuffer

# Operations that read no value of a parameter: they run on a pending one without waiting.
_CALLS = {
    "size", "dim", "numel", "nelement", "element_size", "is_contiguous", "is_floating_point", "is_complex",
    "get_device", "data_ptr", "untyped_storage", "requires_grad_", "register_hook", "__len__",
    "register_post_accumulate_grad_hook", "_has_compatible_shallow_copy_type",
}  # fmt: skip
_GETS = {
    "shape", "dtype", "device", "requires_grad", "grad", "_grad", "is_leaf", "grad_fn", "_grad_fn", "layout",
    "ndim", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "output_nr", "_version",
    "_backward_hooks", "_post_accumulate_grad_hooks", "itemsize", "nbytes", "names",
}  # fmt: skip
_SETS = {"grad", "_grad", "requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks"}

_waiting: dict[int, "ParamGathers"] = {}  # id(pending parameter) -> the gathers it waits for


def _reads_values(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        attribute = getattr(getattr(func, "__self__", None), "__name__", "")
        return attribute not in (_GETS if name == "__get__" else _SETS)
    return name not in _CALLS


def _handle(func: Any, types: Any, args: tuple, kwargs: Any) -> Any:
    if not _reads_values(func):
        return _disabled_torch_function_impl(func, types, args, kwargs or {})
    for t in tensors(args, kwargs):
        if isinstance(t, _Pending):
            wait_for(t)
    return func(*args, **(kwargs or {}))  # the parameters have their own classes back: dispatch as usual


class _Pending(Mark):
    """Mixed into a parameter's class while a gather into it is in flight."""

    __torch_function__ = torch_function(_handle)


def _restore(param: nn.Parameter) -> None:
    _waiting.pop(id(param), None)
    unmark(param, _Pending)


def wait_for(param: nn.Parameter) -> None:
    """Wait for the gathers ``param`` is pending on (a copy of a pending parameter just gets its class back)."""
    gathers = _waiting.get(id(param))
    if gathers is None:
        _restore(param)
    else:
        gathers.wait(param)


def is_pending(param: torch.Tensor) -> bool:
    """Whether a gather into ``param`` is still in flight (no operation has waited for it yet)."""
    return isinstance(param, _Pending)


class ParamGathers:
    """The all-gathers of one step that nothing has waited for yet, and the parameters they write.

    Args:
        enabled: keep the gathers in flight after the step (``overlap_param_gather`` at stages 1-2);
            when False, ``defer`` hands every handle back for the step to wait for.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._handles: list[Handle] = []  # in issue order
        self._done = 0  # handles[:done] waited for
        self._last: dict[int, tuple[int, nn.Parameter]] = {}  # id(param) -> (its last handle, param), until armed
        self._release: list[list[nn.Parameter]] = []  # position -> parameters whose last handle it is
        self._position: dict[int, int] = {}  # id(pending param) -> its last handle

    def defer(self, buf: "FlatBuffer", bucket: Bucket, handle: Optional[Handle]) -> Optional[Handle]:
        """Keep ``handle``, the gather of ``bucket`` of ``buf``, in flight; returns what the step waits for
        itself: ``handle`` when not overlapping, else None."""
        if handle is None or not self.enabled:
            return handle
        position = len(self._handles)
        self._handles.append(handle)
        self._release.append([])
        for slot in bucket.slots:
            p = buf.param_of(slot)
            self._last[id(p)] = (position, p)
        return None

    def arm(self) -> None:
        """Mark every parameter a kept gather writes as pending (at the end of the step)."""
        for position, p in self._last.values():
            self._release[position].append(p)
            self._position[id(p)] = position
            _waiting[id(p)] = self
            mark(p, _Pending)
        self._last = {}

    def wait(self, param: Optional[nn.Parameter] = None) -> None:
        """Wait for the gathers up to ``param``'s last bucket (None: all of them); what they wrote is released."""
        last = len(self._handles) - 1 if param is None else self._position.get(id(param), -1)
        while self._done <= last:
            self._handles[self._done].wait()  # a CommError releases nothing: every use raises it
            for p in self._release[self._done]:
                self._position.pop(id(p), None)
                _restore(p)
            self._release[self._done] = []
            self._done += 1
        if self._done == len(self._handles):
            self._handles, self._release, self._done = [], [], 0

    @property
    def in_flight(self) -> int:
        """Gathers kept after the step that nothing has waited for yet."""
        return len(self._handles) - self._done
