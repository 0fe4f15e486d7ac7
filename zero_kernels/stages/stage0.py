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

    def _end_round(self) -> None:
        super()._end_round()
        self._give_reduced_grads()

    def _give_reduced_grads(self) -> None:
        """After the synchronised backward, as ``DistributedDataParallel`` leaves it: ``p.grad`` on every rank for a
        parameter some rank gave a gradient, also where this rank's data gave none (its reduced gradient is in
        ``grad_flat``, nonzero). Else torch's ``clip_grad_norm_`` and a GradScaler's ``unscale_`` over ``p.grad`` saw it
        on some ranks only: each rank clipped by another norm, or left it scaled, and the replicas drifted apart
        (1.8e-2 after 3 steps). A parameter no rank gave one keeps None (its slot was zeroed, ``zero_dropped_grads``),
        as does one whose reduced gradient is exactly zero (the step's exchange gives it the same flag everywhere)."""
        if self.world_size == 1 or self.wide_local:
            return
        for buf in self.buffers:
            for s in buf.layout.slots:
                p = buf.params[s.param]
                if p.grad is None and s.numel:
                    view = buf.grad_flat.narrow(0, s.offset, s.numel).view(s.shape)
                    if bool(view.any()):
                        p.grad = view

    def norm_views(self) -> Iterator[torch.Tensor]:
        """Each rank sums the squares of its 1/world part of every (identical) reduced bucket."""
        for buf in self.buffers:
            for bucket in buf.layout.buckets:
                yield buf.bucket_slice(buf.grad_flat, bucket).tensor_split(self.world_size)[self.rank]
