"""Block quantization in Triton: one program per block, the reference's integers and scales bit for bit.

Quantize reads each element once and writes its integer (a byte, or half a byte for int4) and the
block's scale; dequantize reads the integers and the scale and writes each value once. A block of
``block`` elements is one power-of-two tile (masked beyond the block and beyond ``numel``), read and
written contiguously; for int4 the tile is split into its even and odd elements, the low and high nibbles
of each byte (the 127 and 7 below are ``quant_reference.QMAX``). Every kernel opens with ``block_tile``
(the block of this program, its start a multiple of the largest power of two up to 16 dividing ``block``,
so that loads vectorise); ``quantize_int8_tile`` quantizes a block held in registers, shared with the Adam
kernel's epilogue (``triton_adam``).

Math is fp32 with an IEEE-rounded division (``tl.div_rn``), rounded half to even by adding and
subtracting 1.5 * 2**23 (exact for |v| <= 2**22, and the values are clamped to [-qmax, qmax] first),
and the low-precision stores round to nearest even as ``torch.Tensor.to`` does. Tensors must be on a
CUDA device, or on the CPU when Triton runs in interpreter mode (``TRITON_INTERPRET=1`` before import).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import tuning
from .quant_reference import QuantizedBlocks, check_dequantize_args, check_quantize_args
from .triton_flatten import cast_rne

_RNE_MAGIC: tl.constexpr = tl.constexpr(12582912.0)  # 1.5 * 2**23: v + it - it rounds v to an integer, ties to even


@triton.jit
def _block_scale(x_even, x_odd, QMAX_: tl.constexpr):
    """absmax / qmax of the block's values (NaN when one is NaN, inf when one is infinite), one ulp smaller
    where ``qmax * scale`` would overflow (``quant_reference.finite_top``)."""
    absmax = tl.maximum(tl.max(tl.abs(x_even), axis=0), tl.max(tl.abs(x_odd), axis=0))
    has_nan = tl.max(((x_even != x_even) | (x_odd != x_odd)).to(tl.int32), axis=0)
    scale = tl.div_rn(absmax, QMAX_ * 1.0)
    overflows = (scale * QMAX_ == float("inf")) & (scale != float("inf"))
    scale = tl.where(overflows, (scale.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True), scale)
    return tl.where(has_nan > 0, float("nan"), scale)


@triton.jit
def _round(x, scale, QMAX_: tl.constexpr):
    """rint(x / scale) clamped to [-qmax, qmax] as int32; 0 where the scale is 0 or not finite."""
    usable = (scale == scale) & (tl.abs(scale) != float("inf")) & (scale != 0.0)
    v = tl.div_rn(x, tl.where(usable, scale, 1.0))
    v = tl.minimum(tl.maximum(v, -QMAX_ * 1.0), QMAX_ * 1.0)
    v = (v + _RNE_MAGIC) - _RNE_MAGIC
    return tl.where(usable, v, 0.0).to(tl.int32)


@triton.jit
def block_tile(block, ALIGN: tl.constexpr, TILE: tl.constexpr):
    """This program's block: its index ``b``, the tile's lanes, their element indices ``b * block + lane`` and
    which lanes are in the block. ``ALIGN``, a power of two dividing ``block``, is passed on to the compiler
    (``block // ALIGN * ALIGN`` is ``block``): runs of ``ALIGN`` lanes start aligned and share their mask, so
    loads and stores vectorise."""
    b = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, TILE)
    span = block // ALIGN * ALIGN
    return b, lane, b * span + lane, lane < span


@triton.jit
def quantize_int8_tile(x, data_ptr, scales_ptr, b, idx, in_block):
    """Block ``b``'s fp32 values ``x`` (0 past the data) as int8 bytes at ``data_ptr + idx`` (lanes ``in_block``)
    and its scale at ``scales_ptr + b``."""
    scale = _block_scale(x, x, 127)
    q = _round(x, scale, 127)
    tl.store(data_ptr + idx, q.to(tl.int8).to(tl.uint8, bitcast=True), mask=in_block)
    tl.store(scales_ptr + b, scale)


@triton.jit
def _quantize_kernel(
    x_ptr,  # input, fp32/bf16/fp16, numel elements, read only
    data_ptr,  # uint8 out: num_blocks * block * BITS / 8 bytes
    scales_ptr,  # fp32 out: one scale per block
    numel,
    block,
    BITS: tl.constexpr,
    ALIGN: tl.constexpr,  # a power of two dividing block
    TILE: tl.constexpr,  # a power of two >= block
):
    b, lane, idx, in_block = block_tile(block, ALIGN, TILE)
    x = tl.load(x_ptr + idx, mask=in_block & (idx < numel), other=0.0).to(tl.float32)
    if BITS == 8:
        quantize_int8_tile(x, data_ptr, scales_ptr, b, idx, in_block)
    else:
        x_even, x_odd = tl.split(tl.reshape(x, [TILE // 2, 2]))
        scale = _block_scale(x_even, x_odd, 7)
        byte = (_round(x_even, scale, 7) & 0x0F) | ((_round(x_odd, scale, 7) & 0x0F) << 4)
        half = tl.arange(0, TILE // 2)
        tl.store(data_ptr + b * (block // 2) + half, byte.to(tl.uint8), mask=half < block // 2)
        tl.store(scales_ptr + b, scale)


@triton.jit
def _dequantize_kernel(
    data_ptr,  # uint8 in: num_blocks * block * BITS / 8 bytes
    scales_ptr,  # fp32 in: one scale per block
    out_ptr,  # out, fp32/bf16/fp16, numel elements
    numel,
    block,
    BITS: tl.constexpr,
    ALIGN: tl.constexpr,  # a power of two dividing block
    TILE: tl.constexpr,  # a power of two >= block
):
    b, lane, idx, in_block = block_tile(block, ALIGN, TILE)
    scale = tl.load(scales_ptr + b)
    if BITS == 8:
        q = tl.load(data_ptr + idx, mask=in_block, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    else:
        half = tl.arange(0, TILE // 2)
        byte = tl.load(data_ptr + b * (block // 2) + half, mask=half < block // 2, other=0).to(tl.int32)
        low = ((byte & 0x0F) ^ 8) - 8
        high = (((byte >> 4) & 0x0F) ^ 8) - 8
        q = tl.reshape(tl.join(low, high), [TILE]).to(tl.float32)
    value = cast_rne(q * scale, out_ptr.dtype.element_ty)
    tl.store(out_ptr + idx, value, mask=in_block & (idx < numel))


def block_align(block: int) -> int:
    """The largest power of two up to 16 that divides ``block``: what every block's start is a multiple of."""
    return min(16, block & -block)


def block_launch_meta(block: int, per_warp: int) -> dict[str, int]:
    """The launch of one program per block of ``block`` elements: its tile (the next power of two), its
    alignment, and ``per_warp`` elements per warp, up to 8 warps."""
    tile = triton.next_power_of_2(block)
    return {
        "ALIGN": block_align(block),
        "TILE": tile,
        "num_warps": min(8, max(1, tile // per_warp)),
        "enable_fp_fusion": tuning.FP_FUSION,
    }


def _launch_meta(block: int) -> dict[str, int]:
    """32 elements per thread: an int4 thread then packs 16 bytes."""
    return block_launch_meta(block, 1024)


def quantize_triton(x: torch.Tensor, bits: int, block: int, out: Optional[QuantizedBlocks] = None) -> QuantizedBlocks:
    """``quant_reference.quantize_ref`` by the Triton kernel."""
    check_quantize_args(x, bits, block, out)
    qb = QuantizedBlocks.empty(x.numel(), bits, block, x.device) if out is None else out
    if qb.num_blocks:
        flat = x.contiguous().view(-1)
        with tuning.launch_device(flat):
            _quantize_kernel[(qb.num_blocks,)](
                flat, qb.data, qb.scales, flat.numel(), block, BITS=bits, **_launch_meta(block)
            )
    return qb


def dequantize_triton(qb: QuantizedBlocks, dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``quant_reference.dequantize_ref`` by the Triton kernel."""
    check_dequantize_args(qb, dtype, out)
    values = torch.empty(qb.numel, dtype=dtype, device=qb.data.device) if out is None else out
    if qb.num_blocks:
        with tuning.launch_device(values):
            _dequantize_kernel[(qb.num_blocks,)](
                qb.data, qb.scales, values, qb.numel, qb.block, BITS=qb.bits, **_launch_meta(qb.block)
            )
    return values


__all__ = [
    "quantize_triton",
    "dequantize_triton",
    "block_tile",
    "quantize_int8_tile",
    "block_align",
    "block_launch_meta",
]
