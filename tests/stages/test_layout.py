"""The flat-buffer layout (``zero_kernels.layout``) in one process, against a brute-force walk of the buffer.

Each case packs parameters of awkward sizes (one element, fewer elements than ranks, a parameter
longer than a bucket) into one buffer for 1-4 shards and several bucket sizes, writes each
parameter's elements (distinct values) at its slot, and checks, element by element:

- the slots: reversed order, contiguous from 0, padding only at the end and shorter than one unit;
- the buckets: they tile the buffer, each a multiple of ``num_shards x align`` long, every rank's
  part 64-byte aligned and a multiple of 16 elements, ``slots`` and ``slot_buckets`` exactly the
  overlapping ones;
- ``segments(rank)``: rebuilding each rank's shard buffer from the full buffer (its part of each
  bucket, in bucket order), every segment holds the parameter's elements it claims, and over all
  ranks every parameter element is held exactly once (``segments(rank, bucket)``: the same, per bucket).
"""

from __future__ import annotations

import pytest
import torch

from zero_kernels.layout import ALIGN_BYTES, MIN_ALIGN_ELEMENTS, BufferLayout, align_elements

SHAPES = {
    "awkward": [(7, 3), (1,), (2,), (40,), (5, 5), (3,)],  # 1 element, fewer than ranks, longer than a small bucket
    "on bucket ends": [(16,), (16,), (16,), (16,), (15,)],  # packed reversed: they start at 0, 15, 31, 47, 63
}


def _params(dtype: torch.dtype, shapes: str = "awkward") -> list[torch.Tensor]:
    return [torch.empty(shape, dtype=dtype) for shape in SHAPES[shapes]]


def _filled(layout: BufferLayout, params: list[torch.Tensor]) -> torch.Tensor:
    """The full buffer with parameter ``i``'s element ``j`` at its slot, as ``1000 * (i + 1) + j``; padding 0."""
    flat = torch.zeros(layout.numel, dtype=torch.float64)
    for slot in layout.slots:
        values = 1000.0 * (slot.param + 1) + torch.arange(params[slot.param].numel(), dtype=torch.float64)
        flat[slot.offset : slot.offset + slot.numel] = values
    return flat


def _shard(layout: BufferLayout, flat: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard buffer built from the full buffer: its part of every bucket, in bucket order."""
    return torch.cat([flat[b.rank_start(rank) : b.rank_start(rank) + b.shard_numel] for b in layout.buckets])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bucket_numel", [1, 50, 10_000])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
@pytest.mark.parametrize("shapes", list(SHAPES))
def test_slots_and_buckets_tile_the_buffer(shapes: str, num_shards: int, bucket_numel: int, dtype: torch.dtype) -> None:
    params = _params(dtype, shapes)
    layout = BufferLayout.build(params, bucket_numel=bucket_numel, num_shards=num_shards)
    align = align_elements(params[0].element_size())
    unit = num_shards * align
    assert [s.param for s in layout.slots] == list(reversed(range(len(params))))
    offset = 0
    for slot in layout.slots:
        assert slot.offset == offset and slot.numel == params[slot.param].numel()
        assert slot.shape == params[slot.param].shape
        offset += slot.numel
    assert layout.numel % unit == 0 and 0 <= layout.numel - offset < unit, (layout.numel, offset, unit)
    assert layout.shard_numel * num_shards == layout.numel
    start = 0
    for k, b in enumerate(layout.buckets):
        assert b.index == k and b.start == start and b.numel % unit == 0 and b.numel > 0
        assert b.numel <= max(bucket_numel, unit) + unit - 1, f"bucket {k} of {b.numel} for {bucket_numel} asked"
        assert b.shard_numel * num_shards == b.numel and b.shard_offset == start // num_shards
        for rank in range(num_shards):
            assert b.rank_start(rank) * params[0].element_size() % ALIGN_BYTES == 0
        assert b.shard_numel % MIN_ALIGN_ELEMENTS == 0
        overlapping = [
            i for i, s in enumerate(layout.slots) if s.offset < b.start + b.numel and s.offset + s.numel > b.start
        ]
        assert list(b.slots) == overlapping
        start += b.numel
    assert start == layout.numel
    for i in range(len(layout.slots)):
        assert layout.slot_buckets[i] == tuple(b.index for b in layout.buckets if i in b.slots)


@pytest.mark.parametrize("bucket_numel", [1, 50, 10_000])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
@pytest.mark.parametrize("shapes", list(SHAPES))
def test_segments_hold_every_element_once(shapes: str, num_shards: int, bucket_numel: int) -> None:
    params = _params(torch.float32, shapes)
    layout = BufferLayout.build(params, bucket_numel=bucket_numel, num_shards=num_shards)
    flat = _filled(layout, params)
    held = [torch.zeros(p.numel(), dtype=torch.int64) for p in params]
    for rank in range(num_shards):
        shard = _shard(layout, flat, rank)
        assert shard.numel() == layout.shard_numel
        covered = torch.zeros(layout.shard_numel, dtype=torch.bool)
        segments = list(layout.segments(rank))
        assert segments == [seg for b in layout.buckets for seg in layout.segments(rank, b.index)]
        for seg in segments:
            slot = layout.slots[seg.slot]
            b = layout.buckets[seg.bucket]
            assert seg.slot in b.slots and b.shard_offset <= seg.shard_offset
            assert seg.shard_offset + seg.numel <= b.shard_offset + b.shard_numel, f"segment {seg} leaves its bucket"
            piece = shard[seg.shard_offset : seg.shard_offset + seg.numel]
            expected = 1000.0 * (slot.param + 1) + torch.arange(seg.param_offset, seg.param_offset + seg.numel)
            torch.testing.assert_close(piece, expected.double(), rtol=0, atol=0, msg=f"rank {rank} {seg}")
            assert not covered[seg.shard_offset : seg.shard_offset + seg.numel].any(), f"rank {rank}: {seg} overlaps"
            covered[seg.shard_offset : seg.shard_offset + seg.numel] = True
            held[slot.param][seg.param_offset : seg.param_offset + seg.numel] += 1
        assert not shard[~covered].any(), f"rank {rank}: an element no segment claims is not padding"
    for i, count in enumerate(held):
        assert bool((count == 1).all()), f"parameter {i}: elements held {count.tolist()} times over the ranks"


def test_bad_arguments_are_refused() -> None:
    params = _params(torch.float32)
    with pytest.raises(ValueError, match="num_shards must be >= 1"):
        BufferLayout.build(params, bucket_numel=10, num_shards=0)
    with pytest.raises(ValueError, match="bucket_numel must be >= 1"):
        BufferLayout.build(params, bucket_numel=0, num_shards=2)
    layout = BufferLayout.build(params, bucket_numel=10, num_shards=2)
    with pytest.raises(ValueError, match="rank 2 out of range for 2 shards"):
        list(layout.segments(2))
