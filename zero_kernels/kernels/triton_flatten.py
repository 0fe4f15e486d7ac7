"""Flatten/unflatten a bucket of tensors in one Triton launch, with cast and scale fused.

A bucket is described by two small int64 tables on the device, built once and cached:

* ``meta``, one row per tensor: its address, its offset in the flat buffer, its element count, a
  dtype code, a layout (strided, contiguous, or aligned: contiguous with both ends 16-byte aligned
  and a size that is a multiple of 16, copied with vector loads and stores) and up to four
  (size, stride) pairs;
* ``chunks``, one row per program: (tensor row, first element), ``chunk`` elements each, the
  contiguous tensors' chunks first, then the strided ones'.

One program copies one chunk, ``TILE`` elements at a time, so a launch covers every tensor whatever
their number, shapes and dtypes. Dtypes (float32, bfloat16, float16) are runtime codes, the flat
buffer's included: one compiled kernel serves every dtype pair. Strided tensors are copied by their
own launch of the ``STRIDED`` variant, so the contiguous copy carries none of its index arithmetic
(and stays far below 128 registers). A layout is first collapsed (size-1 dimensions dropped,
mergeable dimensions merged); any layout of at most four strided dimensions runs in the kernel.
Tensors beyond that limit, or of another dtype, are copied by the reference path instead, with
one warning when their bucket's table is built.

Tables and host synchronisation. A launch of ONE tensor (what stage 2 does for each gradient as it
arrives) uses a table that holds no address: the tensor's address is a kernel argument. Its table
depends only on the layout (shape, strides, dtype, offset, and the residues modulo 16 of the
tensor's and the flat buffer's addresses, which decide the aligned rows), so it is built once per
layout and then found again whatever address the tensor has in later steps. Several tensors need
their addresses in the table; those tables are keyed on the addresses too and the last
``POINTER_TABLES`` are kept. A table goes to a CUDA device through pinned memory, asynchronously,
on the current stream: building one never blocks the host. ``cache_info()`` counts hits, tables
built and host copies; ``bucket_layouts()`` says how each tensor of a bucket is copied.
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
from .reference import (
    SCALE_FLOAT,
    SCALE_TENSOR,
    Scale,
    check_flat_args,
    flatten_ref,
    scale_kind,
    unflatten_ref,
)

log = logging.getLogger("zero_kernels")

MAX_STRIDED_DIMS = 4
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
POINTER_TABLES = 256  # tables of several tensors (keyed on their addresses) kept
LAYOUT_TABLES = 4096  # tables of one tensor (keyed on its layout) kept: models of new shapes trained one by one

# Columns of a ``meta`` row.
_PTR: tl.constexpr = tl.constexpr(0)  # address, relative to the launch's base address
_FLAT_OFFSET: tl.constexpr = tl.constexpr(1)
_NUMEL: tl.constexpr = tl.constexpr(2)
_DTYPE: tl.constexpr = tl.constexpr(3)
_LAYOUT: tl.constexpr = tl.constexpr(4)  # _STRIDED, _CONTIGUOUS or _ALIGNED
_SIZES: tl.constexpr = tl.constexpr(5)  # sizes of dimensions 1..3 (dimension 0 needs none)
_STRIDES: tl.constexpr = tl.constexpr(8)  # strides of dimensions 0..3
_META_COLS: tl.constexpr = tl.constexpr(12)

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
def _element_size(code):
    return tl.where(code == 0, 4, 2).to(tl.int64)


@triton.jit
def _typed(addr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The integer address ``addr`` as a pointer to ``DTYPE``; 16-byte aligned when ``ALIGNED``."""
    ptr = addr.to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _strided_offsets(idx, size1, size2, size3, stride0, stride1, stride2, stride3):
    """Element offsets, from the tensor's address, of its row-major indices ``idx`` (int64)."""
    i3 = idx % size3
    rest = idx // size3
    i2 = rest % size2
    rest = rest // size2
    return (rest // size1) * stride0 + (rest % size1) * stride1 + i2 * stride2 + i3 * stride3


@triton.jit
def _copy_tiles(
    tensor,  # typed pointer: the tensor's first element to copy (its address when STRIDED)
    flat,  # typed pointer: the flat buffer's first element to copy
    n,  # elements to copy (int32)
    start,  # index in the tensor of the first one (used when STRIDED)
    s,  # fp32 multiplier, applied when scaled
    scaled,
    shape,  # (size1, size2, size3, stride0, stride1, stride2, stride3), used when STRIDED
    TO_FLAT: tl.constexpr,
    STRIDED: tl.constexpr,
    ALIGNED: tl.constexpr,
    TILE: tl.constexpr,
):
    offs = tl.arange(0, TILE)
    for t in range(0, n, TILE):
        first = t
        rem = n - t
        if ALIGNED:  # t is a multiple of TILE; n, and so rem, of 16
            first = tl.multiple_of(first, 16)
            rem = tl.multiple_of(rem, 16)
        mask = offs < rem
        if STRIDED:
            size1, size2, size3, stride0, stride1, stride2, stride3 = shape
            at = _strided_offsets(start + first + offs, size1, size2, size3, stride0, stride1, stride2, stride3)
        else:
            at = first + offs
        if TO_FLAT:
            x = tl.load(tensor + at, mask=mask).to(tl.float32)
        else:
            x = tl.load(flat + first + offs, mask=mask).to(tl.float32)
        if scaled:
            x = x * s
        if TO_FLAT:
            tl.store(flat + first + offs, cast_rne(x, flat.dtype.element_ty), mask=mask)
        else:
            tl.store(tensor + at, cast_rne(x, tensor.dtype.element_ty), mask=mask)


@triton.jit
def _copy_to_flat_of(tensor, flat_addr, flat_code, n, start, s, scaled, shape, TO_FLAT, STRIDED, ALIGNED, TILE):
    """``_copy_tiles`` with the flat buffer's pointer typed by its runtime dtype code."""
    if flat_code == 0:
        _copy_tiles(
            tensor, _typed(flat_addr, tl.float32, ALIGNED), n, start, s, scaled, shape, TO_FLAT, STRIDED, ALIGNED, TILE
        )
    elif flat_code == 1:
        _copy_tiles(
            tensor, _typed(flat_addr, tl.bfloat16, ALIGNED), n, start, s, scaled, shape, TO_FLAT, STRIDED, ALIGNED, TILE
        )
    else:
        _copy_tiles(
            tensor, _typed(flat_addr, tl.float16, ALIGNED), n, start, s, scaled, shape, TO_FLAT, STRIDED, ALIGNED, TILE
        )


@triton.jit
def _copy(tensor_addr, code, flat_addr, flat_code, n, start, s, scaled, shape, TO_FLAT, STRIDED, ALIGNED, TILE):
    """``_copy_tiles`` with both pointers typed by their runtime dtype codes."""
    if code == 0:
        _copy_to_flat_of(
            _typed(tensor_addr, tl.float32, ALIGNED),
            flat_addr, flat_code, n, start, s, scaled, shape, TO_FLAT, STRIDED, ALIGNED, TILE,
        )  # fmt: skip
    elif code == 1:
        _copy_to_flat_of(
            _typed(tensor_addr, tl.bfloat16, ALIGNED),
            flat_addr, flat_code, n, start, s, scaled, shape, TO_FLAT, STRIDED, ALIGNED, TILE,
        )  # fmt: skip
    else:
        _copy_to_flat_of(
            _typed(tensor_addr, tl.float16, ALIGNED),
            flat_addr, flat_code, n, start, s, scaled, shape, TO_FLAT, STRIDED, ALIGNED, TILE,
        )  # fmt: skip


@triton.jit(do_not_specialize=["flat_addr", "flat_code", "base_addr", "scale_addr", "scale", "scale_mode", "chunk"])
def _flatten_kernel(
    flat_addr: tl.int64,  # address of the flat buffer's element 0 (fp32/bf16/fp16)
    flat_code: tl.int32,  # dtype code of the flat buffer
    base_addr: tl.int64,  # added to every tensor's address column (a launch of one tensor: its address)
    meta_ptr,  # int64 [tensors, _META_COLS]: address, flat offset, numel, dtype code, layout, sizes, strides
    chunks_ptr,  # int64 [programs, 2]: meta row, first element of this program's chunk
    scale_addr: tl.int64,  # address of a one-element fp32 multiplier (read when scale_mode == 2)
    scale: tl.float32,  # multiplier (used when scale_mode == 1)
    scale_mode: tl.int32,  # 0 none, 1 scalar argument, 2 one-element tensor
    chunk: tl.int32,  # elements per program (a multiple of 16)
    TO_FLAT: tl.constexpr,  # True: tensors -> flat (flatten); False: flat -> tensors (unflatten)
    STRIDED: tl.constexpr,  # the chunks of strided tensors (True) or of contiguous ones (False)
    TILE: tl.constexpr,  # elements per loop iteration
):
    c = tl.program_id(0).to(tl.int64)
    row = meta_ptr + tl.load(chunks_ptr + 2 * c) * _META_COLS
    start = tl.load(chunks_ptr + 2 * c + 1)
    numel = tl.load(row + _NUMEL)
    code = tl.load(row + _DTYPE)
    n = tl.minimum(numel - start, chunk).to(tl.int32)
    flat_at = flat_addr + (tl.load(row + _FLAT_OFFSET) + start) * _element_size(flat_code)
    tensor_addr = base_addr + tl.load(row + _PTR)
    s = scale
    if scale_mode == 2:
        # Widened first: the interpreter types an address below 2**31 as int32, which cannot become a pointer.
        s = tl.load(scale_addr.to(tl.int64).to(tl.pointer_type(tl.float32)))
    scaled = scale_mode != 0
    if STRIDED:
        shape = (
            tl.load(row + _SIZES),
            tl.load(row + _SIZES + 1),
            tl.load(row + _SIZES + 2),
            tl.load(row + _STRIDES),
            tl.load(row + _STRIDES + 1),
            tl.load(row + _STRIDES + 2),
            tl.load(row + _STRIDES + 3),
        )
        _copy(tensor_addr, code, flat_at, flat_code, n, start, s, scaled, shape, TO_FLAT, True, False, TILE)
    else:
        shape = (0, 0, 0, 0, 0, 0, 0)
        tensor_at = tensor_addr + start * _element_size(code)
        if tl.load(row + _LAYOUT) == _ALIGNED:
            _copy(tensor_at, code, flat_at, flat_code, n, start, s, scaled, shape, TO_FLAT, False, True, TILE)
        else:
            _copy(tensor_at, code, flat_at, flat_code, n, start, s, scaled, shape, TO_FLAT, False, False, TILE)


@dataclass(frozen=True)
class _Table:
    meta: torch.Tensor  # int64 [tensors, _META_COLS] on the bucket's device
    contiguous: torch.Tensor  # int64 [programs, 2] on the bucket's device: chunks of contiguous tensors
    strided: torch.Tensor  # int64 [programs, 2]: chunks of strided tensors
    chunk: int  # elements per program
    fallback: tuple[int, ...]  # indices of tensors copied by the reference path
    layouts: tuple[int, ...]  # layout code of each meta row
    ready: Optional[torch.cuda.Event]  # recorded after the copy to the device (CUDA only)
    stream: Optional[int]  # the stream that copy was queued on


_LAYOUT_TABLES: OrderedDict[tuple, _Table] = OrderedDict()  # launches of one tensor: keyed on its layout only
_POINTER_TABLES: OrderedDict[tuple, _Table] = OrderedDict()  # several tensors: keyed on their addresses too
_STATS = {"hits": 0, "misses": 0, "host_copies": 0}


def cache_info() -> dict[str, int]:
    """Table counters: ``hits``, ``misses`` (tables built), ``host_copies`` (tables sent to their device:
    each is one asynchronous copy from pinned memory on CUDA, counted on the CPU too) and ``size``."""
    return {**_STATS, "size": len(_LAYOUT_TABLES) + len(_POINTER_TABLES)}


def cache_clear() -> None:
    """Drop every cached table and reset the counters."""
    _LAYOUT_TABLES.clear()
    _POINTER_TABLES.clear()
    _STATS.update(hits=0, misses=0, host_copies=0)


def bucket_layouts(tensors: Sequence[torch.Tensor], offsets: Sequence[int], flat: torch.Tensor) -> dict[str, int]:
    """How the kernel copies each tensor of a bucket: counts of ``aligned`` (vectorised),
    ``contiguous``, ``strided`` and ``fallback`` (reference path) tensors; empty ones are skipped."""
    check_flat_args("flatten", tensors, flat, offsets)
    table = _table("flatten", tensors, offsets, flat)
    names = {int(_ALIGNED): "aligned", int(_CONTIGUOUS): "contiguous", int(_STRIDED): "strided"}
    counts = {name: table.layouts.count(code) for code, name in names.items()}
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


def _layout(op: str, i: int, t: torch.Tensor, offset: int, flat: torch.Tensor) -> Optional[tuple[int, list, list]]:
    """(layout code, sizes, strides) of tensor ``i``, or None when the reference path must copy it."""
    collapsed = collapse_layout(t.shape, t.stride())
    if t.dtype not in DTYPE_CODES or collapsed is None:
        return None
    sizes, strides = collapsed
    if op == "unflatten" and any(step == 0 and size > 1 for size, step in zip(sizes, strides)):
        raise ValueError(f"unflatten: tensor {i} has a stride of 0 (an expanded view); it cannot be written")
    if strides[-1] != 1 or any(size != 1 for size in sizes[:-1]):
        return int(_STRIDED), sizes, strides
    flat_at = flat.data_ptr() + offset * flat.element_size()
    aligned = t.data_ptr() % 16 == 0 and flat_at % 16 == 0 and t.numel() % 16 == 0
    return int(_ALIGNED if aligned else _CONTIGUOUS), sizes, strides


def _upload(meta: list[list[int]], chunks: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two tables as int64 tensors on ``device``, in one copy; to a GPU through pinned memory, without
    blocking the host."""
    _STATS["host_copies"] += 1
    host = torch.tensor([v for row in meta + chunks for v in row], dtype=torch.int64)
    if device.type == "cuda":
        both = host.pin_memory().to(device, non_blocking=True)
    else:
        both = host.to(device)
    split = len(meta) * int(_META_COLS)  # a multiple of 16 bytes: chunks stays aligned
    return both[:split].view(-1, int(_META_COLS)), both[split:].view(-1, 2)


def _build_table(
    op: str, tensors: Sequence[torch.Tensor], offsets: Sequence[int], flat: torch.Tensor, relative: bool
) -> _Table:
    rows, fallback, numels, layouts = [], [], [], []
    for i, (t, offset) in enumerate(zip(tensors, offsets)):
        if t.numel() == 0:
            continue
        found = _layout(op, i, t, offset, flat)
        if found is None:
            fallback.append(i)
            continue
        layout, sizes, strides = found
        rows.append([0 if relative else t.data_ptr(), offset, t.numel(), DTYPE_CODES[t.dtype], layout, *sizes[1:]])
        rows[-1] += strides
        numels.append(t.numel())
        layouts.append(layout)
    if fallback:
        log.warning(
            "%s: %d tensor(s) (indices %s) are copied by the reference path: dtype outside float32/bfloat16/"
            "float16 or a layout needing more than %d strided dimensions",
            op,
            len(fallback),
            fallback[:10],
            MAX_STRIDED_DIMS,
        )
    chunk = tuning.pick(tuning.FLATTEN_CHUNK, max(numels, default=1))
    order = sorted(range(len(rows)), key=lambda r: layouts[r] == _STRIDED)  # contiguous tensors first
    chunks = [[r, first] for r in order for first in range(0, numels[r], chunk)]
    contiguous = sum(1 for r, _ in chunks if layouts[r] != _STRIDED)
    device = flat.device
    meta, table_chunks = _upload(rows, chunks, device)
    parts = (table_chunks[:contiguous], table_chunks[contiguous:])
    ready, stream = None, None
    if device.type == "cuda":
        current = torch.cuda.current_stream(device)
        ready, stream = torch.cuda.Event(), current.cuda_stream
        ready.record(current)
    return _Table(meta, *parts, chunk, tuple(fallback), tuple(layouts), ready, stream)


def _table(op: str, tensors: Sequence[torch.Tensor], offsets: Sequence[int], flat: torch.Tensor) -> _Table:
    one = len(tensors) == 1
    # Residues, not "aligned or not": which rows are aligned depends on the flat buffer's residue plus
    # each offset (a residue of 4 with an offset of 12 bytes is aligned, one of 8 is not).
    layout = tuple((t.shape, t.stride(), t.dtype, t.data_ptr() % 16) for t in tensors)
    pointers = None if one else tuple(t.data_ptr() for t in tensors)
    residue = flat.data_ptr() % 16
    key = (op, flat.device, flat.element_size(), residue, layout, tuple(int(o) for o in offsets), pointers)
    cache = _LAYOUT_TABLES if one else _POINTER_TABLES
    table = cache.get(key)
    if table is not None:
        _STATS["hits"] += 1
        cache.move_to_end(key)
        return table
    _STATS["misses"] += 1
    table = _build_table(op, tensors, offsets, flat, relative=one)
    cache[key] = table
    if len(cache) > (LAYOUT_TABLES if one else POINTER_TABLES):
        cache.popitem(last=False)  # the least recently used
    return table


def _launch(op: str, tensors, flat, offsets, scale: Scale) -> _Table:
    check_flat_args(op, tensors, flat, offsets)
    if flat.dtype not in DTYPE_CODES:
        raise ValueError(f"{op}: flat buffer dtype {flat.dtype}; allowed: float32, bfloat16, float16")
    mode = scale_kind(f"{op}: scale", scale, flat.device)
    base = tensors[0].data_ptr() if len(tensors) == 1 else 0
    with tuning.launch_device(flat):
        table = _table(op, tensors, offsets, flat)
        if table.ready is not None and torch.cuda.current_stream(flat.device).cuda_stream != table.stream:
            current = torch.cuda.current_stream(flat.device)  # not the stream that sent the table: wait for it,
            current.wait_event(table.ready)  # and keep its memory from being reused before this launch ran
            table.meta.record_stream(current)
        for strided, chunks in ((False, table.contiguous), (True, table.strided)):
            if chunks.shape[0] == 0:
                continue
            config = tuning.FLATTEN_STRIDED if strided else tuning.FLATTEN
            _flatten_kernel[(chunks.shape[0],)](
                flat.data_ptr(),
                DTYPE_CODES[flat.dtype],
                base,
                table.meta,
                chunks,
                scale.data_ptr() if mode == SCALE_TENSOR else 0,
                float(scale) if mode == SCALE_FLOAT else 1.0,
                mode,
                table.chunk,
                TO_FLAT=op == "flatten",
                STRIDED=strided,
                TILE=config.block,
                num_warps=config.num_warps,
                enable_fp_fusion=tuning.FP_FUSION,
            )
    return table


def flatten_triton(
    tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int], *, scale: Scale = None
) -> torch.Tensor:
    """``reference.flatten_ref`` in one Triton launch per bucket; same arguments, same results."""
    table = _launch("flatten", tensors, flat, offsets, scale)
    for i in table.fallback:
        flatten_ref([tensors[i]], flat, [offsets[i]], scale=scale)
    return flat


def unflatten_triton(
    flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int], *, scale: Scale = None
) -> None:
    """``reference.unflatten_ref`` in one Triton launch per bucket; same arguments, same results."""
    table = _launch("unflatten", tensors, flat, offsets, scale)
    for i in table.fallback:
        unflatten_ref(flat, [tensors[i]], [offsets[i]], scale=scale)
