"""Fused kernels behind one signature: ``adam_step``, ``flatten``, ``unflatten``; block ``quantize`` and
``dequantize`` (``quant``) for what crosses the wire.

The dispatcher (:mod:`zero_kernels.kernels.dispatch`) picks the backend per call: Triton, the C++
CPU kernels, or the pure-PyTorch ``*_ref`` twins of ``reference``. Backends are imported on first
use, so importing this package needs neither triton nor a compiler.
"""

from __future__ import annotations

from .dispatch import adam_step, flatten, resolve_impl, unflatten
from .quant import dequantize, quantize
from .quant_reference import QuantizedBlocks, dequantize_ref, quantize_ref
from .reference import adam_step_ref, flatten_ref, unflatten_ref

__all__ = [
    "adam_step",
    "flatten",
    "unflatten",
    "resolve_impl",
    "adam_step_ref",
    "flatten_ref",
    "unflatten_ref",
    "QuantizedBlocks",
    "quantize",
    "dequantize",
    "quantize_ref",
    "dequantize_ref",
]
