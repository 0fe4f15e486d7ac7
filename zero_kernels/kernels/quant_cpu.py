"""C++ CPU backend of block quantization: the ``quant_reference`` signatures, run by the ``ops`` extension.

Arguments are checked with the reference's checks before any C++ runs (the C++ entry points check
again); the output buffers are allocated here. Importing this module builds nothing.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._build import ext as _ext
from .quant_reference import QuantizedBlocks, check_dequantize_args, check_quantize_args


def quantize_cpu(x: torch.Tensor, bits: int, block: int, out: Optional[QuantizedBlocks] = None) -> QuantizedBlocks:
    """``quant_reference.quantize_ref`` on a CPU tensor, by the C++ kernel."""
    check_quantize_args(x, bits, block, out)
    qb = QuantizedBlocks.empty(x.numel(), bits, block, x.device) if out is None else out
    _ext.load("ops").quantize(x.contiguous().view(-1), bits, block, qb.data, qb.scales)
    return qb


def dequantize_cpu(qb: QuantizedBlocks, dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``quant_reference.dequantize_ref`` on CPU blocks, by the C++ kernel."""
    check_dequantize_args(qb, dtype, out)
    values = torch.empty(qb.numel, dtype=dtype, device=qb.data.device) if out is None else out
    _ext.load("ops").dequantize(qb.data, qb.scales, qb.bits, qb.block, values.view(-1))
    return values


__all__ = ["quantize_cpu", "dequantize_cpu"]
