"""Fused kernels behind one signature: ``adam_step``, ``flatten``, ``unflatten``.

Each public function takes the arguments of its ``*_ref`` twin in ``reference.py`` plus
``impl`` (None reads ``ZERO_KERNELS_IMPL``), and the dispatcher picks the backend:

========  ====================================================================================
auto      Triton on CUDA tensors; the C++ extension on CPU tensors when it builds; else torch
triton    the Triton kernels (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``)
cpu       the C++ CPU kernels of the ``ops`` extension (CPU tensors)
torch     the pure-PyTorch reference
========  ====================================================================================

Backends are imported on first use, so importing this package needs neither triton nor a
compiler; asking for a backend that is missing raises an error that says what to install.
"""

from __future__ import annotations

import importlib
from typing import Callable, Optional, Sequence

import torch

from .._build import ext as _ext
from ..env import IMPLS, settings
from .quant_reference import QuantizedBlocks
from .reference import Scale, adam_step_ref, flatten_ref, unflatten_ref

# backend -> operation -> (module in this package, function); "torch" is the reference.
_BACKENDS = {
    "triton": {
        "adam_step": ("triton_adam", "adam_step_triton"),
        "flatten": ("triton_flatten", "flatten_triton"),
        "unflatten": ("triton_flatten", "unflatten_triton"),
    },
    "cpu": {
        "adam_step": ("cpu", "adam_step_cpu"),
        "flatten": ("cpu", "flatten_cpu"),
        "unflatten": ("cpu", "unflatten_cpu"),
    },
}
_REFERENCE = {"adam_step": adam_step_ref, "flatten": flatten_ref, "unflatten": unflatten_ref}


def _import_backend(module: str):
    """Import ``zero_kernels.kernels.<module>``; a missing triton becomes a readable error."""
    try:
        return importlib.import_module(f"{__package__}.{module}")
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "triton":
            raise RuntimeError("the Triton kernels need the triton package: `pip install triton`") from exc
        if exc.name == f"{__package__}.{module}":
            raise _ext.ExtensionUnavailable(f"backend module {exc.name} is not part of this installation") from exc
        raise


def _triton_usable_on(device: torch.device) -> None:
    interpreted = _import_backend("triton_adam").INTERPRETED
    if device.type == "cuda" or (device.type == "cpu" and interpreted):
        return
    raise RuntimeError(
        f"impl='triton' got tensors on {device}: the Triton kernels run on CUDA devices, or on the CPU only "
        "when TRITON_INTERPRET=1 is set before zero_kernels.kernels loads them; use impl='cpu' or impl='torch'"
    )


def _cpu_usable_on(device: torch.device) -> None:
    if device.type != "cpu":
        raise ValueError(f"impl='cpu' runs on CPU tensors; these are on {device}")
    _ext.load("ops")
    _import_backend("cpu")


def _auto(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            _import_backend("triton_adam")
        except RuntimeError as exc:
            _ext.warn_once(f"{exc}; using the pure-PyTorch kernels on CUDA tensors")
            return "torch"
        return "triton"
    if device.type == "cpu" and _ext.available("ops"):
        try:
            _import_backend("cpu")
        except _ext.ExtensionUnavailable as exc:
            _ext.warn_once(f"{exc}; using the pure-PyTorch kernels on CPU tensors")
            return "torch"
        return "cpu"
    return "torch"


def resolve_impl(impl: Optional[str], device: torch.device) -> str:
    """The backend ("triton", "cpu" or "torch") that ``impl`` selects for tensors on ``device``.

    Raises ValueError for an unknown name, RuntimeError when Triton cannot run on ``device``, and
    ``ExtensionUnavailable`` when ``impl="cpu"`` but the C++ extension cannot be built.
    """
    name = settings().impl if impl is None else impl
    if name not in IMPLS:
        raise ValueError(f"impl={name!r} is not a kernel backend; allowed: {', '.join(IMPLS)} (or None)")
    if name == "auto":
        return _auto(device)
    if name == "triton":
        _triton_usable_on(device)
    elif name == "cpu":
        _cpu_usable_on(device)
    return name


def _function(op: str, impl: Optional[str], device: torch.device) -> Callable:
    backend = resolve_impl(impl, device)
    if backend == "torch":
        return _REFERENCE[op]
    module, function = _BACKENDS[backend][op]
    return getattr(_import_backend(module), function)


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    adamw: bool = True,
    grad_scale: Scale = None,
    found_inf: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    max_exp_avg_sq: Optional[torch.Tensor] = None,
    maximize: bool = False,
    skip_if: Optional[torch.Tensor] = None,
    window: Optional[tuple[int, int]] = None,
    adopt_out: bool = False,
    quantized: Optional[QuantizedBlocks] = None,
    impl: Optional[str] = None,
) -> None:
    """One Adam/AdamW step on a flat shard, in place; see ``reference.adam_step_ref`` for the arguments."""
    _function("adam_step", impl, param.device)(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        adamw=adamw,
        grad_scale=grad_scale,
        found_inf=found_inf,
        out=out,
        max_exp_avg_sq=max_exp_avg_sq,
        maximize=maximize,
        skip_if=skip_if,
        window=window,
        adopt_out=adopt_out,
        quantized=quantized,
    )


def flatten(
    tensors: Sequence[torch.Tensor],
    flat: torch.Tensor,
    offsets: Sequence[int],
    *,
    scale: Scale = None,
    impl: Optional[str] = None,
) -> torch.Tensor:
    """Copy tensors into ``flat`` at ``offsets`` (cast, optionally scaled); see ``reference.flatten_ref``."""
    return _function("flatten", impl, flat.device)(tensors, flat, offsets, scale=scale)


def unflatten(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    offsets: Sequence[int],
    *,
    scale: Scale = None,
    impl: Optional[str] = None,
) -> None:
    """Copy ``flat`` back into tensors at ``offsets``, in place; see ``reference.unflatten_ref``."""
    _function("unflatten", impl, flat.device)(flat, tensors, offsets, scale=scale)
