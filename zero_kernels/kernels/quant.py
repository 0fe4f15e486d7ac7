"""Block quantization behind one face: ``quantize`` and ``dequantize`` (format and error in ``quant_reference``).

Every backend produces the reference's integers and scales bit for bit; for now every call runs the
pure-PyTorch reference.
"""

from __future__ import annotations

from typing import Optional

import torch

from .quant_reference import QuantizedBlocks, dequantize_ref, quantize_ref


def quantize(x: torch.Tensor, bits: int, block: int, out: Optional[QuantizedBlocks] = None) -> QuantizedBlocks:
    """``x`` (read flat; fp32, bf16 or fp16) as ``bits``-bit integers with one float32 scale per ``block``."""
    return quantize_ref(x, bits, block, out)


def dequantize(qb: QuantizedBlocks, dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ``qb.numel`` values of ``qb`` as a 1-D tensor of ``dtype`` (written into ``out`` when given)."""
    return dequantize_ref(qb, dtype, out)


__all__ = ["QuantizedBlocks", "quantize", "dequantize"]
