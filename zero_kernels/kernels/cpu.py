"""C++ CPU backend of the fused kernels: the ``*_ref`` signatures, run by the ``ops`` extension.

Arguments are validated here with the reference's checks before any C++ runs (the C++ entry
points check again); bias corrections are computed here in float64. Importing this module builds
nothing: the extension is built or loaded on the first call and raises
``zero_kernels._build.ext.ExtensionUnavailable`` when that is impossible.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional, Sequence

import torch

from .._build import ext as _ext
from .quant_reference import QuantizedBlocks
from .reference import (
    SCALE_NONE,
    SCALE_TENSOR,
    Scale,
    adam_scalars,
    check_adam_args,
    check_flat_args,
    check_quantized,
    in_window,
    scale_kind,
)


def _ops() -> ModuleType:
    return _ext.load("ops")


def _scale_value(what: str, scale: Scale) -> Optional[float]:
    """A float or a one-element float32 tensor as a Python float; None stays None."""
    kind = scale_kind(what, scale)
    if kind == SCALE_NONE:
        return None
    return float(scale.item()) if kind == SCALE_TENSOR else float(scale)


def adam_step_cpu(
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
) -> None:
    """One fused Adam/AdamW step on a flat CPU shard, in place; arguments as ``reference.adam_step_ref``.

    With ``quantized``, each thread updates whole quantization blocks and quantizes each one right after
    its update, while it is in cache (the epilogue).
    """
    check_adam_args(param, grad, exp_avg, exp_avg_sq, found_inf, out, max_exp_avg_sq, skip_if)
    check_quantized(quantized, param, window)
    param, grad, exp_avg, exp_avg_sq, out, max_exp_avg_sq = in_window(
        window, param, grad, exp_avg, exp_avg_sq, out, max_exp_avg_sq
    )
    if skip_if is not None and skip_if.item() != 0:  # a CPU tensor: reading it costs nothing
        if quantized is not None:  # the blocks of the parameters as they are
            written = out if out is not None else param
            _ops().quantize(written, 8, quantized.block, quantized.data, quantized.scales)
        return
    step_size, bc2_sqrt = adam_scalars(lr=lr, beta1=beta1, beta2=beta2, step=step)
    _ops().adam_step(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step_size=step_size,
        bc2_sqrt=bc2_sqrt,
        adamw=adamw,
        grad_scale=_scale_value("adam_step: grad_scale", grad_scale),
        found_inf=found_inf,
        out=out,
        max_exp_avg_sq=max_exp_avg_sq,
        maximize=bool(maximize),
        adopt_out=bool(adopt_out),
        quantized_data=None if quantized is None else quantized.data,
        quantized_scales=None if quantized is None else quantized.scales,
        quantized_block=0 if quantized is None else quantized.block,
    )


def flatten_cpu(
    tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int], *, scale: Scale = None
) -> torch.Tensor:
    """Copy CPU tensors into ``flat`` at ``offsets`` (cast, optional fp32 scale); returns ``flat``."""
    check_flat_args("flatten", tensors, flat, offsets)
    return _ops().flatten(list(tensors), flat, [int(o) for o in offsets], scale=_scale_value("flatten: scale", scale))


def unflatten_cpu(
    flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int], *, scale: Scale = None
) -> None:
    """Copy ``flat`` back into CPU tensors in place at ``offsets`` (cast, optional fp32 scale)."""
    check_flat_args("unflatten", tensors, flat, offsets)
    _ops().unflatten(flat, list(tensors), [int(o) for o in offsets], scale=_scale_value("unflatten: scale", scale))


__all__ = ["adam_step_cpu", "flatten_cpu", "unflatten_cpu"]
