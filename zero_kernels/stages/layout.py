"""Flat-buffer layout: parameters -> padded contiguous buffer -> buckets -> per-rank shards.

Pure bookkeeping on integers: no tensors are allocated here and nothing here knows about ranks'
communication or about stages. A pipeline builds one ``BufferLayout`` per (param group, dtype) and
allocates the tensors it needs against it.

Layout of one buffer (the pattern of Megatron-LM's ``param_and_grad_buffer``, with parameters
allowed to straddle bucket and shard boundaries so every rank holds exactly the same number of
elements)::

    params (reversed)   [ p_{n-1} ][ p_{n-2} ]....[ p_0 ][pad]
    buffer elements     0 ............................... numel        (numel % (num_shards * align) == 0)
    buckets             [ bucket 0   ][ bucket 1   ][ bucket 2 ]       (bucket_numel each, last shorter)
    shards of bucket k  [ r0 | r1 | ... | r_{N-1} ]                    (bucket.numel // N each)

- Parameters are packed in *reverse* order of the list given, because autograd produces gradients
  roughly in reverse order of registration: bucket 0 fills first during backward.
- ``bucket_numel`` and the buffer are rounded up to a multiple of ``num_shards * align``, where
  ``align`` (``align_elements``) is 64 bytes' worth of elements and at least 16: every rank's part
  of every bucket then starts on a 64-byte boundary of the buffer and of the shard buffers (fp32
  master, m and v included) and its length is a multiple of 16, which is what the kernels need
  for 16-byte vector loads and stores. Only the end of the buffer is padded, so padding is at most
  ``num_shards * align - 1`` elements, zero-filled, never a parameter and never saved.
- Rank ``r``'s shard of bucket ``k`` is ``buffer[k.start + r*k.shard_numel : ... + k.shard_numel]``.
  The rank's *shard buffer* (fp32 master, Adam m and v, reduced gradients) is the concatenation of
  its bucket shards: bucket ``k``'s part sits at ``k.shard_offset`` and is ``k.shard_numel`` long.
  A reduce-scatter of bucket ``k`` therefore lands in one contiguous slice of the shard buffer,
  and an all-gather of that slice rebuilds bucket ``k`` in the full buffer.
- ``segments(rank)`` lists, bucket by bucket, which piece of which parameter each part of the
  rank's shard buffer holds; a pipeline uses it to split a kernel launch where hyper-parameters or
  per-parameter step counts change and to move state between the full and the sharded forms.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, Sequence

import torch

ALIGN_BYTES = 64  # every rank's part of every bucket starts on such a boundary
MIN_ALIGN_ELEMENTS = 16  # ... and its length is a multiple of at least this many elements


def align_elements(element_size: int) -> int:
    """Elements per alignment unit of a buffer of ``element_size``-byte elements."""
    return max(MIN_ALIGN_ELEMENTS, ALIGN_BYTES // element_size)


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in its buffer."""

    param: int  # index of the parameter in the list given to ``BufferLayout.build``
    offset: int  # first element in the buffer
    numel: int
    shape: torch.Size


@dataclass(frozen=True)
class Bucket:
    """A contiguous range of the buffer that is reduced and gathered as one collective."""

    index: int
    start: int  # first element in the buffer
    numel: int  # a multiple of num_shards * align_elements
    shard_numel: int  # numel // num_shards: each rank's part
    shard_offset: int  # where this bucket's part starts in a rank's shard buffer
    slots: tuple[int, ...]  # indices into ``BufferLayout.slots`` of the parameters overlapping it

    def rank_start(self, rank: int) -> int:
        """First buffer element of ``rank``'s part of this bucket."""
        return self.start + rank * self.shard_numel


@dataclass(frozen=True)
class Segment:
    """A piece of one parameter inside a rank's shard buffer."""

    slot: int  # index into ``BufferLayout.slots``
    bucket: int  # index of the bucket it belongs to
    param_offset: int  # first element of the piece inside the flattened parameter
    shard_offset: int  # where the piece starts in the rank's shard buffer
    numel: int


@dataclass(frozen=True)
class BufferLayout:
    """Slots, buckets and shards of one flat buffer; build it with ``BufferLayout.build``."""

    slots: tuple[Slot, ...]
    buckets: tuple[Bucket, ...]
    numel: int  # padded total, a multiple of ``num_shards * align_elements``
    num_shards: int
    slot_buckets: tuple[tuple[int, ...], ...]  # per slot: indices of the buckets holding part of it

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's shard buffer (the same on every rank)."""
        return self.numel // self.num_shards

    @cached_property
    def largest_bucket(self) -> int:
        """Elements of the largest bucket (0 when there is none)."""
        return max((b.numel for b in self.buckets), default=0)

    @cached_property
    def widest_slot(self) -> int:
        """The most buckets one slot spans (1 when there is no slot)."""
        return max((len(k) for k in self.slot_buckets), default=1)

    @classmethod
    def build(cls, params: Sequence[torch.Tensor], *, bucket_numel: int, num_shards: int) -> "BufferLayout":
        """Pack ``params`` (reversed) into one buffer cut into buckets of ``bucket_numel`` elements.

        Args:
            params: the parameters of this buffer (one dtype); only their shapes and element size are read.
            bucket_numel: target elements per bucket (rounded up to a multiple of ``num_shards *
                align_elements``).
            num_shards: ranks the buffer is sharded over (1 = not sharded).
        """
        if num_shards < 1:
            raise ValueError(f"layout: num_shards must be >= 1, got {num_shards}")
        if bucket_numel < 1:
            raise ValueError(f"layout: bucket_numel must be >= 1, got {bucket_numel}")
        slots, offset = [], 0
        for index in reversed(range(len(params))):
            p = params[index]
            slots.append(Slot(param=index, offset=offset, numel=p.numel(), shape=p.shape))
            offset += p.numel()
        unit = num_shards * align_elements(params[0].element_size() if len(params) else 4)
        numel = -(-offset // unit) * unit
        step = -(-bucket_numel // unit) * unit
        buckets, start = [], 0
        while start < numel:
            size = min(step, numel - start)
            end = start + size
            overlapping = tuple(i for i, s in enumerate(slots) if s.offset < end and s.offset + s.numel > start)
            shard = size // num_shards
            buckets.append(Bucket(len(buckets), start, size, shard, start // num_shards, overlapping))
            start += size
        slot_buckets = tuple(tuple(b.index for b in buckets if i in b.slots) for i in range(len(slots)))
        return cls(tuple(slots), tuple(buckets), numel, num_shards, slot_buckets)

    def segments(self, rank: int, bucket: int | None = None) -> Iterator[Segment]:
        """Pieces of parameters in ``rank``'s shard buffer, in shard order (padding is skipped).

        Args:
            rank: the shard (0 <= rank < num_shards).
            bucket: only this bucket's part; all buckets when None.
        """
        if not 0 <= rank < self.num_shards:
            raise ValueError(f"layout: rank {rank} out of range for {self.num_shards} shards")
        for b in self.buckets if bucket is None else (self.buckets[bucket],):
            lo = b.rank_start(rank)
            hi = lo + b.shard_numel
            for i in b.slots:
                s = self.slots[i]
                start, end = max(lo, s.offset), min(hi, s.offset + s.numel)
                if start < end:
                    yield Segment(i, b.index, start - s.offset, b.shard_offset + start - lo, end - start)
