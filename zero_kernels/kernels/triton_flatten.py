"""Flatten/unflatten a bucket of tensors in one Triton launch, with cast and scale fused.

A bucket is described by two small int64 tables on the device, built once and cached:

* ``meta``, one row per tensor: its data pointer, its offset in the flat buffer, its element
  count, a dtype code, a layout (strided, contiguous, or contiguous with address, size and
  offset multiples of 16, which the kernel copies with vector loads and stores) and up to four
  (size, stride) pairs;
* ``chunks``, one row per program: (tensor row, first element), ``block`` elements each.

One program copies one chunk, so a launch covers every tensor whatever their number, shapes and
dtypes (float32, bfloat16 and float16 are read or written through the dtype code; the flat
buffer's dtype comes from its pointer). Non-contiguous views are read and written in place
through their strides: a layout is first collapsed (size-1 dimensions dropped, mergeable
dimensions merged) and any layout of at most four strided dimensions runs in the kernel.
Tensors beyond that limit, or of another dtype, are copied by the reference path instead, with
one warning when their bucket's table is built.

Tables are cached on everything they depend on (data pointers, shapes, strides, dtypes,
offsets); ``cache_info()`` reports hits and misses and ``bucket_layouts()`` how each tensor of a
bucket is copied.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from . import tuning
from .reference import Scale, check_flat_args, flatten_ref, unflatten_ref

log = logging.getLogger("zero_kernels")

MAX_STRIDED_DIMS = 4
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_CACHE_SIZE = 256

# Columns of a ``meta`` row.
_PTR: tl.constexpr = tl.constexpr(0)
_FLAT_OFFSET: tl.constexpr = tl.constexpr(1)
_NUMEL: tl.constexpr = tl.constexpr(2)
_DTYPE: tl.constexpr = tl.constexpr(3)
_LAYOUT: tl.constexpr = tl.constexpr(4)  # _STRIDED, _CONTIGUOUS or _ALIGNED
_SIZES: tl.constexpr = tl.constexpr(5)  # sizes of dimensions 1..3 (dimension 0 needs none)
_STRIDES: tl.constexpr = tl.constexpr(8)  # strides of dimensions 0..3
_META_COLS: tl.constexpr = tl.constexpr(12)

# Layouts: strided (sizes and strides used), contiguous, or contiguous with the address, the
# element count and the flat offset all multiples of 16 (so the compiler may vectorise).
_STRIDED: tl.constexpr = tl.constexpr(0)
_CONTIGUOUS: tl.constexpr = tl.constexpr(1)
_ALIGNED: tl.constexpr = tl.constexpr(2)


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr):
    """fp32 ``x`` -> ``DTYPE`` rounded to nearest even, bit for bit as ``torch.Tensor.to`` does.

    bfloat16 is rounded with integer arithmetic so that every Triton backend, the CPU
    interpreter included, produces the same bits; float16 and float32 use the native cast.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)  # any nan -> the quiet nan
        y = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def _chunk(meta_ptr, chunks_ptr):
    """(meta row pointer, first element) of this program's chunk."""
    c = tl.program_id(0).to(tl.int64)
    return meta_ptr + tl.load(chunks_ptr + 2 * c) * _META_COLS, tl.load(chunks_ptr + 2 * c + 1)


@triton.jit
def _strided(row_ptr, idx):
    """Element offsets, from the tensor's data pointer, of its row-major indices ``idx``."""
    if tl.load(row_ptr + _LAYOUT) != _STRIDED:
        off = idx
    else:
        i3 = idx % tl.load(row_ptr + _SIZES + 2)
        rest = idx // tl.load(row_ptr + _SIZES + 2)
        i2 = rest % tl.load(row_ptr + _SIZES + 1)
        rest = rest // tl.load(row_ptr + _SIZES + 1)
        i1 = rest % tl.load(row_ptr + _SIZES)
        i0 = rest // tl.load(row_ptr + _SIZES)
        off = (
            i0 * tl.load(row_ptr + _STRIDES)
            + i1 * tl.load(row_ptr + _STRIDES + 1)
            + i2 * tl.load(row_ptr + _STRIDES + 2)
            + i3 * tl.load(row_ptr + _STRIDES + 3)
        )
    return off


@triton.jit
def _typed(addr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The integer address ``addr`` as a pointer to ``DTYPE``; 16-byte aligned when ``ALIGNED``."""
    ptr = addr.to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _load_fp32(addr, off, mask, code, ALIGNED: tl.constexpr):
    """Elements ``off`` of the tensor at integer address ``addr`` whose dtype code is ``code``, in fp32."""
    if code == 0:
        x = tl.load(_typed(addr, tl.float32, ALIGNED) + off, mask=mask)
    elif code == 1:
        x = tl.load(_typed(addr, tl.bfloat16, ALIGNED) + off, mask=mask).to(tl.float32)
    else:
        x = tl.load(_typed(addr, tl.float16, ALIGNED) + off, mask=mask).to(tl.float32)
    return x


@triton.jit
def _store_fp32(addr, off, x, mask, code, ALIGNED: tl.constexpr):
    """Store fp32 ``x`` at elements ``off`` of the tensor at integer address ``addr``, cast to its dtype."""
    if code == 0:
        tl.store(_typed(addr, tl.float32, ALIGNED) + off, x, mask=mask)
    elif code == 1:
        tl.store(_typed(addr, tl.bfloat16, ALIGNED) + off, cast_rne(x, tl.bfloat16), mask=mask)
    else:
        tl.store(_typed(addr, tl.float16, ALIGNED) + off, cast_rne(x, tl.float16), mask=mask)


@triton.jit
def _scaled(x, scale_ptr, scale, SCALE_MODE: tl.constexpr):
    if SCALE_MODE == 1:
        x = x * scale
    if SCALE_MODE == 2:
        x = x * tl.load(scale_ptr)
    return x


@triton.jit
def _flatten_kernel(
    flat_ptr,  # flat buffer, fp32/bf16/fp16, written at each tensor's offset
    meta_ptr,  # int64 [tensors, _META_COLS]: address, offset, numel, dtype code, layout
    chunks_ptr,  # int64 [programs, 2]: meta row, first element
    scale_ptr,  # one-element fp32 multiplier (read when SCALE_MODE == 2)
    scale,  # fp32 multiplier (used when SCALE_MODE == 1)
    SCALE_MODE: tl.constexpr,  # 0 none, 1 scalar argument, 2 one-element tensor
    BLOCK: tl.constexpr,
):
    row_ptr, start = _chunk(meta_ptr, chunks_ptr)
    addr, numel = tl.load(row_ptr + _PTR), tl.load(row_ptr + _NUMEL)
    code, flat_offset = tl.load(row_ptr + _DTYPE), tl.load(row_ptr + _FLAT_OFFSET)
    if tl.load(row_ptr + _LAYOUT) == _ALIGNED:  # the same copy, with alignment hints: vector loads and stores
        idx = tl.multiple_of(start, 16) + tl.arange(0, BLOCK)
        mask = idx < tl.multiple_of(numel, 16)
        x = _scaled(_load_fp32(addr, idx, mask, code, True), scale_ptr, scale, SCALE_MODE)
        dst = flat_ptr + tl.multiple_of(flat_offset, 16) + idx
        tl.store(dst, cast_rne(x, flat_ptr.dtype.element_ty), mask=mask)
    else:
        idx = start + tl.arange(0, BLOCK)
        mask = idx < numel
        x = _scaled(_load_fp32(addr, _strided(row_ptr, idx), mask, code, False), scale_ptr, scale, SCALE_MODE)
        tl.store(flat_ptr + flat_offset + idx, cast_rne(x, flat_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _unflatten_kernel(
    flat_ptr,  # flat buffer, fp32/bf16/fp16, read at each tensor's offset
    meta_ptr,  # int64 [tensors, _META_COLS]: address, offset, numel, dtype code, layout
    chunks_ptr,  # int64 [programs, 2]: meta row, first element
    scale_ptr,  # one-element fp32 multiplier (read when SCALE_MODE == 2)
    scale,  # fp32 multiplier (used when SCALE_MODE == 1)
    SCALE_MODE: tl.constexpr,  # 0 none, 1 scalar argument, 2 one-element tensor
    BLOCK: tl.constexpr,
):
    row_ptr, start = _chunk(meta_ptr, chunks_ptr)
    addr, numel = tl.load(row_ptr + _PTR), tl.load(row_ptr + _NUMEL)
    code, flat_offset = tl.load(row_ptr + _DTYPE), tl.load(row_ptr + _FLAT_OFFSET)
    if tl.load(row_ptr + _LAYOUT) == _ALIGNED:  # the same copy, with alignment hints: vector loads and stores
        idx = tl.multiple_of(start, 16) + tl.arange(0, BLOCK)
        mask = idx < tl.multiple_of(numel, 16)
        x = tl.load(flat_ptr + tl.multiple_of(flat_offset, 16) + idx, mask=mask).to(tl.float32)
        _store_fp32(addr, idx, _scaled(x, scale_ptr, scale, SCALE_MODE), mask, code, True)
    else:
        idx = start + tl.arange(0, BLOCK)
        mask = idx < numel
        x = tl.load(flat_ptr + flat_offset + idx, mask=mask).to(tl.float32)
        _store_fp32(addr, _strided(row_ptr, idx), _scaled(x, scale_ptr, scale, SCALE_MODE), mask, code, False)


@dataclass(frozen=True)
class _Table:
    meta: torch.Tensor  # int64 [tensors, _META_COLS] on the bucket's device
    chunks: torch.Tensor  # int64 [programs, 2] on the bucket's device
    config: tuning.LaunchConfig  # block = chunk size
    fallback: tuple[int, ...]  # indices of tensors copied by the reference path


_TABLES: OrderedDict[tuple, _Table] = OrderedDict()
_STATS = {"hits": 0, "misses": 0}


def cache_info() -> dict[str, int]:
    """Table cache counters: ``hits``, ``misses`` and current ``size`` (tables held)."""
    return {**_STATS, "size": len(_TABLES)}


def cache_clear() -> None:
    """Drop every cached table and reset the counters."""
    _TABLES.clear()
    _STATS.update(hits=0, misses=0)


def bucket_layouts(tensors: Sequence[torch.Tensor], offsets: Sequence[int], flat: torch.Tensor) -> dict[str, int]:
    """How the kernel copies each tensor of a bucket: counts of ``aligned`` (vectorised),
    ``contiguous``, ``strided`` and ``fallback`` (reference path) tensors; empty ones are skipped."""
    check_flat_args("flatten", tensors, flat, offsets)
    table = _table("flatten", tensors, offsets, flat)
    layouts = table.meta[:, int(_LAYOUT)].tolist()
    names = {int(_ALIGNED): "aligned", int(_CONTIGUOUS): "contiguous", int(_STRIDED): "strided"}
    counts = {name: layouts.count(code) for code, name in names.items()}
    return {**counts, "fallback": len(table.fallback)}


def collapse_layout(shape: Sequence[int], stride: Sequence[int]) -> Optional[tuple[list[int], list[int]]]:
    """(sizes, strides) of exactly ``MAX_STRIDED_DIMS`` dimensions addressing the same elements
    in the same row-major order, or None when the layout needs more strided dimensions."""
    dims: list[list[int]] = []
    for size, step in zip(shape, stride):
        if size == 1:
            continue
        if dims and dims[-1][1] == step * size:
            dims[-1] = [dims[-1][0] * size, step]
        else:
            dims.append([size, step])
    if len(dims) > MAX_STRIDED_DIMS:
        return None
    dims = [[1, 0]] * (MAX_STRIDED_DIMS - len(dims)) + dims
    return [d[0] for d in dims], [d[1] for d in dims]


def _meta_row(op: str, i: int, t: torch.Tensor, offset: int) -> Optional[list[int]]:
    layout = collapse_layout(t.shape, t.stride())
    if t.dtype not in DTYPE_CODES or layout is None:
        return None
    sizes, strides = layout
    if op == "unflatten" and any(step == 0 and size > 1 for size, step in zip(sizes, strides)):
        raise ValueError(f"unflatten: tensor {i} has a stride of 0 (an expanded view); it cannot be written")
    layout = _STRIDED
    if strides[-1] == 1 and all(size == 1 for size in sizes[:-1]):
        aligned = t.data_ptr() % 16 == 0 and t.numel() % 16 == 0 and offset % 16 == 0
        layout = _ALIGNED if aligned else _CONTIGUOUS
    return [t.data_ptr(), offset, t.numel(), DTYPE_CODES[t.dtype], int(layout), *sizes[1:], *strides]


def _build_table(op: str, tensors: Sequence[torch.Tensor], offsets: Sequence[int], device: torch.device) -> _Table:
    rows, fallback, numels = [], [], []
    for i, (t, offset) in enumerate(zip(tensors, offsets)):
        if t.numel() == 0:
            continue
        row = _meta_row(op, i, t, offset)
        if row is None:
            fallback.append(i)
        else:
            rows.append(row)
            numels.append(t.numel())
    if fallback:
        log.warning(
            "%s: %d tensor(s) (indices %s) are copied by the reference path: dtype outside float32/bfloat16/"
            "float16 or a layout needing more than %d strided dimensions",
            op,
            len(fallback),
            fallback[:10],
            MAX_STRIDED_DIMS,
        )
    config = tuning.pick(tuning.FLATTEN, max(numels, default=1))
    block = config.block
    counts = torch.tensor([triton.cdiv(n, block) for n in numels], dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int64), counts)
    first = torch.arange(len(owner), dtype=torch.int64) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    return _Table(
        meta=torch.tensor(rows, dtype=torch.int64).reshape(-1, int(_META_COLS)).to(device),
        chunks=torch.stack([owner, first * block], dim=1).contiguous().to(device),
        config=config,
        fallback=tuple(fallback),
    )


def _table(op: str, tensors: Sequence[torch.Tensor], offsets: Sequence[int], flat: torch.Tensor) -> _Table:
    key = (
        op,
        flat.device,
        tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors),
        tuple(int(o) for o in offsets),
    )
    table = _TABLES.get(key)
    if table is not None:
        _STATS["hits"] += 1
        _TABLES.move_to_end(key)
        return table
    _STATS["misses"] += 1
    table = _build_table(op, tensors, offsets, flat.device)
    _TABLES[key] = table
    if len(_TABLES) > _CACHE_SIZE:
        _TABLES.popitem(last=False)
    return table


def _scale_mode(op: str, scale: Scale, flat: torch.Tensor) -> int:
    if scale is None:
        return 0
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != flat.device:
            raise ValueError(
                f"{op}: scale must be a float or a one-element float32 tensor on {flat.device}, "
                f"got {scale.numel()} element(s) of {scale.dtype} on {scale.device}"
            )
        return 2
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return 1
    raise ValueError(f"{op}: scale must be None, a float or a one-element tensor, got {type(scale)}")


def _launch(op: str, kernel, tensors, flat, offsets, scale: Scale) -> _Table:
    check_flat_args(op, tensors, flat, offsets)
    if flat.dtype not in DTYPE_CODES:
        raise ValueError(f"{op}: flat buffer dtype {flat.dtype}; allowed: float32, bfloat16, float16")
    mode = _scale_mode(op, scale, flat)
    table = _table(op, tensors, offsets, flat)
    if table.chunks.shape[0] > 0:
        with tuning.launch_device(flat):
            kernel[(table.chunks.shape[0],)](
                flat,
                table.meta,
                table.chunks,
                scale if mode == 2 else flat,
                float(scale) if mode == 1 else 1.0,
                SCALE_MODE=mode,
                BLOCK=table.config.block,
                num_warps=table.config.num_warps,
            )
    return table


def flatten_triton(
    tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int], *, scale: Scale = None
) -> torch.Tensor:
    """``reference.flatten_ref`` in one Triton launch per bucket; same arguments, same results."""
    table = _launch("flatten", _flatten_kernel, tensors, flat, offsets, scale)
    for i in table.fallback:
        flatten_ref([tensors[i]], flat, [offsets[i]], scale=scale)
    return flat


def unflatten_triton(
    flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int], *, scale: Scale = None
) -> None:
    """``reference.unflatten_ref`` in one Triton launch per bucket; same arguments, same results."""
    table = _launch("unflatten", _unflatten_kernel, tensors, flat, offsets, scale)
    for i in table.fallback:
        unflatten_ref(flat, [tensors[i]], [offsets[i]], scale=scale)
