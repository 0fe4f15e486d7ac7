"""Stage 1: the Adam state (fp32 master, m, v) is sharded; gradients are reduced at the step.

During backward ``p.grad`` is a view of the full ``grad_flat`` buffer holding this rank's local
gradient, and it stays so: the step never writes into it. ``step()`` copies each bucket of
``grad_flat`` into a scratch bucket and reduce-scatters that (a collective's input is scratch,
see ``comm``) into ``grad_shard``, this rank's reduced gradients (the step divides by the world
size), updates the rank's shard and all-gathers the parameters. So a second ``step()`` without
a new backward, or a loop that never clears gradients (each backward adds to ``p.grad``), sees
what ``torch.optim.AdamW`` with DDP-averaged gradients sees. ``grad_shard`` and the scratch
buckets (at most ``max_inflight + 1`` at a time) live only from the reduction to the end of the
step (or ``zero_grad()``); between steps stage 1 holds what the ZeRO formula counts. One rank
reduces nothing: ``grad_flat`` is its reduced gradient.
"""

from __future__ import annotations

import torch

from ..layout import Bucket
from .base import FlatBuffer, Pipeline


class Stage1Pipeline(Pipeline):
    stage = 1
    grad_divisor_is_world = True
    allgather_by_bucket = True

    def _grad_shard(self, buf: FlatBuffer, bucket: Bucket) -> torch.Tensor:
        if buf.grad_shard is None:  # one rank: the local gradient is the reduced one
            return super()._grad_shard(buf, bucket)
        return buf.shard_slice(buf.grad_shard, bucket)

    def _before_step(self) -> None:
        if self.world_size == 1:
            return
        pool: list[torch.Tensor] = []
        for buf in self.buffers:
            buf.grad_shard = torch.empty(buf.layout.shard_numel, dtype=buf.dtype, device=buf.device)
            for bucket in buf.layout.buckets:
                scratch = pool.pop() if pool and pool[-1].dtype == buf.dtype else None
                if scratch is None or scratch.numel() < bucket.numel or scratch.device != buf.device:
                    scratch = torch.empty(bucket.numel, dtype=buf.dtype, device=buf.device)
                part = scratch.narrow(0, 0, bucket.numel)
                part.copy_(buf.bucket_slice(buf.grad_flat, bucket))
                handle = self.engine.reduce_scatter(self._grad_shard(buf, bucket), part, name=f"grads.{bucket.index}")
                self._track(handle, lambda scratch=scratch: pool.append(scratch), held=(scratch,))
                buf.written.add(bucket.index)
                self._complete_inflight(keep=self.max_inflight)
        self._complete_inflight()

    def reset_grad_sync(self) -> None:
        """As the base; the reduced gradients of the step are dropped (``p.grad`` keeps the local ones)."""
        for buf in self.buffers:
            buf.grad_shard = None
        super().reset_grad_sync()
