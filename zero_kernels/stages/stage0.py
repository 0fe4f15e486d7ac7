"""Stage 0: plain data parallelism with the fused Adam.

Everything is replicated (``num_shards`` is 1: the "shard" is the whole buffer). Each gradient
bucket is divided by the world size and all-reduced in place as soon as it fills during backward,
so after backward ``p.grad`` (a view of ``grad_flat``) holds the mean over ranks, as with
``DistributedDataParallel``. With a wider ``communication_data_type`` (fp32 for bf16/fp16 gradients)
the bucket is reduced in a copy of that dtype, and the mean written back into ``p.grad``'s dtype.
The step runs the kernel on the full buffer; nothing is gathered. With a ``grad_accum_dtype`` wider than the
gradients, ``grad_flat`` is of that dtype and holds them instead of ``p.grad`` (None after backward): every
backward adds into it, the synchronised one reduces the sum (``stages.grad_accum``).
"""

from __future__ import annotations

from typing import Iterator

import torch

from .base import FlatBuffer, Pipeline
from .layout import Bucket


class Stage0Pipeline(Pipeline):
    stage = 0
    reduces_in_backward = True
    accumulates_locally = True

    @property
    def num_shards(self) -> int:
        return 1

    def _launch_bucket(self, buf: FlatBuffer, bucket: Bucket) -> None:
        if self.world_size == 1:
            return
        grads = buf.bucket_slice(buf.grad_flat, bucket)
        comm = self.comm_dtype_of(buf)
        if comm == grads.dtype:
            grads.div_(self.world_size)
            self._track(self.engine.all_reduce(grads, op="sum", name=f"grads.{bucket.index}"))
            return
        wide = grads.to(comm).div_(self.world_size)
        handle = self.engine.all_reduce(wide, op="sum", name=f"grads.{bucket.index}")
        self._track(handle, lambda: grads.copy_(wide), held=(wide,))

    def norm_views(self) -> Iterator[torch.Tensor]:
        """Each rank sums the squares of its 1/world part of every (identical) reduced bucket."""
        for buf in self.buffers:
            for bucket in buf.layout.buckets:
                yield buf.bucket_slice(buf.grad_flat, bucket).tensor_split(self.world_size)[self.rank]
