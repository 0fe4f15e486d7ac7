"""Block quantization behind one face: ``quantize`` and ``dequantize`` (format and error in ``quant_reference``).

``impl`` picks the backend as for the other kernels (``dispatch.resolve_impl``; None reads
``ZERO_KERNELS_IMPL``): Triton on CUDA tensors, the C++ kernel of the ``ops`` extension on CPU tensors
when it is built, else the pure-PyTorch reference. Every backend produces the reference's integers,
scales and dequantized values bit for bit.
"""

from __future__ import annotations

import importlib
from typing import Callable, Optional

import torch

from .dispatch import resolve_impl
from .quant_reference import QuantizedBlocks, dequantize_ref, quantize_ref

# backend -> (module in this package, quantize, dequantize)
_BACKENDS = {
    "triton": ("triton_quant", "quantize_triton", "dequantize_triton"),
    "cpu": ("quant_cpu", "quantize_cpu", "dequantize_cpu"),
}


def _functions(impl: Optional[str], device: torch.device) -> tuple[Callable, Callable]:
    backend = resolve_impl(impl, device)
    if backend == "torch":
        return quantize_ref, dequantize_ref
    module, quant, dequant = _BACKENDS[backend]
    loaded = importlib.import_module(f"{__package__}.{module}")
    return getattr(loaded, quant), getattr(loaded, dequant)


def quantize(
    x: torch.Tensor, bits: int, block: int, out: Optional[QuantizedBlocks] = None, *, impl: Optional[str] = None
) -> QuantizedBlocks:
    """``x`` (read flat; fp32, bf16 or fp16) as ``bits``-bit integers with one float32 scale per ``block``."""
    return _functions(impl, x.device)[0](x, bits, block, out)


def dequantize(
    qb: QuantizedBlocks, dtype: torch.dtype, out: Optional[torch.Tensor] = None, *, impl: Optional[str] = None
) -> torch.Tensor:
    """The ``qb.numel`` values of ``qb`` as a 1-D tensor of ``dtype`` (written into ``out`` when given)."""
    return _functions(impl, qb.data.device)[1](qb, dtype, out)


__all__ = ["QuantizedBlocks", "quantize", "dequantize"]
