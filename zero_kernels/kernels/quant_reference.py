"""Block quantization in pure PyTorch: the oracle every fast quantizer matches bit for bit, and the fallback.

A flat tensor is cut into blocks of ``block`` elements (the last one padded with zeros). Each block gets
one float32 scale, ``absmax / qmax`` (qmax 127 for 8 bits, 7 for 4 bits), and each element the integer
``round_half_even(x / scale)`` clamped to ``[-qmax, qmax]``. Where ``qmax * scale`` would round past the
float32 maximum (an absmax within a few ulps of it, ~3.4e38) the scale is one ulp smaller, so that every
dequantized value of a finite block is finite. All math is float32 whatever the input dtype,
with a true division by the scale (no reciprocal), so every backend gets the same integers.

Error: for a block whose scale is a normal float32, ``|dequantize(quantize(x)) - x| <= scale / 2`` up to
float32 rounding of ``x / scale`` and of ``q * scale`` (at most ``2 * qmax * scale * 2**-24`` more), plus
half a unit in the last place of the output dtype when dequantizing to bf16/fp16.

An all-zero block has scale 0 and dequantizes to zeros. A block holding a non-finite value gets a
non-finite scale (inf for infinities, NaN for a NaN) and all its integers 0, so it dequantizes to NaN
everywhere: a non-finite check downstream still sees it, and no garbage integer is ever sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

QMAX = {8: 127, 4: 7}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class QuantizedBlocks:
    """A flat tensor of ``numel`` elements quantized in blocks of ``block`` elements.

    ``data`` is uint8: the int8 values as bytes (bits=8) or two int4 values per byte, low nibble first
    (bits=4); ``scales`` holds one float32 per block (0 for an all-zero block).
    """

    data: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: int
    block: int

    @property
    def num_blocks(self) -> int:
        return self.scales.numel()

    def nbytes(self) -> int:
        """The bytes that cross the wire: the packed integers and the scales."""
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    @classmethod
    def empty(cls, numel: int, bits: int, block: int, device: torch.device | str = "cpu") -> "QuantizedBlocks":
        """Uninitialised buffers for ``numel`` elements (a receive buffer, or ``out`` of ``quantize``)."""
        check_format(bits, block)
        blocks = num_blocks(numel, block)
        data = torch.empty(blocks * block * bits // 8, dtype=torch.uint8, device=device)
        return cls(data, torch.empty(blocks, dtype=torch.float32, device=device), int(numel), bits, block)


def num_blocks(numel: int, block: int) -> int:
    return -(-int(numel) // int(block))


def check_format(bits: int, block: int) -> None:
    """ValueError unless ``bits`` is 4 or 8 and ``block`` a positive integer (even for 4 bits)."""
    if bits not in QMAX:
        raise ValueError(f"quantize: bits must be 4 or 8, got {bits!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"quantize: block must be a positive int, got {block!r}")
    if bits == 4 and block % 2:
        raise ValueError(f"quantize: block must be even for bits=4 (two values per byte), got {block}")


def check_quantize_args(x: torch.Tensor, bits: int, block: int, out: Optional[QuantizedBlocks]) -> None:
    """The checks every backend makes before it runs; errors name what is wrong."""
    check_format(bits, block)
    if x.dtype not in DTYPES:
        raise TypeError(f"quantize: x must be float32, bfloat16 or float16, got {x.dtype}")
    if out is not None:
        want = (x.numel(), bits, block)
        if (out.numel, out.bits, out.block) != want:
            raise ValueError(
                f"quantize: out holds (numel, bits, block)={(out.numel, out.bits, out.block)}, need {want}"
            )
        check_buffers(out, x.device)


def check_buffers(qb: QuantizedBlocks, device: torch.device) -> None:
    """``qb``'s data and scales have the dtype, size, layout and device its numel, bits and block imply."""
    check_format(qb.bits, qb.block)
    blocks = num_blocks(qb.numel, qb.block)
    for name, t, dtype, n in (
        ("data", qb.data, torch.uint8, blocks * qb.block * qb.bits // 8),
        ("scales", qb.scales, torch.float32, blocks),
    ):
        if t.dtype != dtype or t.numel() != n or not t.is_contiguous() or t.device != device:
            raise ValueError(
                f"QuantizedBlocks.{name} must be a contiguous {dtype} tensor of {n} elements on {device}, "
                f"got {t.dtype} of {t.numel()} on {t.device}{'' if t.is_contiguous() else ' (not contiguous)'}"
            )


def check_dequantize_args(qb: QuantizedBlocks, dtype: torch.dtype, out: Optional[torch.Tensor]) -> None:
    check_buffers(qb, qb.data.device)
    if dtype not in DTYPES:
        raise TypeError(f"dequantize: dtype must be float32, bfloat16 or float16, got {dtype}")
    if out is not None and (out.dtype != dtype or out.numel() != qb.numel or not out.is_contiguous()):
        raise ValueError(
            f"dequantize: out must be a contiguous {dtype} tensor of {qb.numel} elements, "
            f"got {out.dtype} of {out.numel()}"
        )
    if out is not None and out.device != qb.data.device:
        raise ValueError(f"dequantize: out is on {out.device}, the blocks on {qb.data.device}")


def _blocks_fp32(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.reshape(-1).float()
    pad = num_blocks(flat.numel(), block) * block - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, block)


def finite_top(scales: torch.Tensor, qmax: int) -> torch.Tensor:
    """``scales`` with each finite one whose ``qmax * scale`` overflows float32 one ulp toward zero."""
    overflows = (scales * qmax).isinf() & scales.isfinite()
    return torch.where(overflows, torch.nextafter(scales, torch.zeros_like(scales)), scales)


def quantize_ref(x: torch.Tensor, bits: int, block: int, out: Optional[QuantizedBlocks] = None) -> QuantizedBlocks:
    """Quantize ``x`` (any shape, read flat; fp32/bf16/fp16) to ``bits``-bit integers in blocks of ``block``."""
    check_quantize_args(x, bits, block, out)
    qmax = QMAX[bits]
    blocks = _blocks_fp32(x, block)
    absmax = blocks.abs().amax(dim=1) if blocks.numel() else blocks.new_zeros(0)  # NaN propagates
    scales = finite_top(absmax / qmax, qmax)
    safe = torch.where(scales.isfinite() & (scales != 0), scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-qmax, qmax)
    q = torch.where((scales.isfinite() & (scales != 0))[:, None], q, torch.zeros_like(q)).to(torch.int8)
    data = pack(q.reshape(-1), bits)
    if out is None:
        return QuantizedBlocks(data, scales, x.numel(), bits, block)
    out.data.copy_(data)
    out.scales.copy_(scales)
    return out


def dequantize_ref(qb: QuantizedBlocks, dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ``qb.numel`` values of ``qb`` as a 1-D tensor of ``dtype`` (``q * scale`` in float32, then cast)."""
    check_dequantize_args(qb, dtype, out)
    q = unpack(qb.data, qb.bits).view(-1, qb.block) if qb.num_blocks else qb.scales.new_zeros(0, qb.block)
    values = (q.float() * qb.scales[:, None]).reshape(-1)[: qb.numel].to(dtype)
    if out is None:
        return values
    out.view(-1).copy_(values)
    return out


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 values as uint8 bytes; for 4 bits two per byte, the even index in the low nibble."""
    if bits == 8:
        return q.view(torch.uint8)
    nibbles = q.view(torch.uint8) & 0x0F
    return nibbles[0::2] | (nibbles[1::2] << 4)


def unpack(data: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of ``pack``: int8 values (4-bit nibbles sign-extended)."""
    if bits == 8:
        return data.view(torch.int8)
    low = (data & 0x0F).to(torch.int8)
    high = (data >> 4).to(torch.int8)
    return ((torch.stack((low, high), dim=1).reshape(-1) ^ 8) - 8).to(torch.int8)


__all__ = ["QMAX", "QuantizedBlocks", "quantize_ref", "dequantize_ref", "pack", "unpack", "num_blocks"]
