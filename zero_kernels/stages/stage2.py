"""Stage 2: as stage 1, and each rank keeps only its shard of the reduced gradients.

During backward each parameter's gradient is copied, divided by the world size, into a bucket
of ``reduce_bucket_size`` elements, and ``p.grad`` is set to ``None`` (as DeepSpeed does): after
backward ``p.grad`` is ``None`` for every trainable parameter, except under ``no_sync()`` where
gradients accumulate in ``p.grad`` until the synchronised backward. A full bucket is
reduce-scattered while backward goes on; once it completes (at most ``max_inflight`` are in
flight, see ``base``) its rank part is added to ``grad_shard`` (so several backward passes before
a step accumulate) and the bucket is freed.
"""

from __future__ import annotations

import torch

from ..kernels import flatten
from ..layout import Bucket
from .base import FlatBuffer, Pipeline


class Stage2Pipeline(Pipeline):
    stage = 2

    def _allocate_grads(self, buf: FlatBuffer) -> None:
        buf.grad_shard = torch.zeros(buf.layout.shard_numel, dtype=buf.dtype, device=buf.device)

    def _consume_grad(self, buf: FlatBuffer, slot: int, p: torch.Tensor) -> None:
        s = buf.layout.slots[slot]
        for k in buf.layout.slot_buckets[slot]:
            bucket = buf.layout.buckets[k]
            if k not in buf.scratch:
                buf.scratch[k] = torch.zeros(bucket.numel, dtype=buf.dtype, device=buf.device)
            lo, hi = max(s.offset, bucket.start), min(s.offset + s.numel, bucket.start + bucket.numel)
            piece = p.grad.reshape(-1).narrow(0, lo - s.offset, hi - lo)
            flatten([piece], buf.scratch[k], [lo - bucket.start], scale=1.0 / self.world_size, impl=self.impl)
        p.grad = None

    def _launch_bucket(self, buf: FlatBuffer, bucket: Bucket) -> None:
        scratch = buf.scratch.pop(bucket.index, None)  # the collective owns it; a later backward fills a new one
        if scratch is None:
            scratch = torch.zeros(bucket.numel, dtype=buf.dtype, device=buf.device)
        mine = scratch.narrow(0, self.rank * bucket.shard_numel, bucket.shard_numel)

        def accumulate() -> None:
            self._grad_shard(buf, bucket).add_(mine)

        handle = self.engine.reduce_scatter(mine, scratch, name=f"grads.{bucket.index}")
        self._track(handle, accumulate, held=(scratch,))
