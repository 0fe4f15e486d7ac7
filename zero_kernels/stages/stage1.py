"""Stage 1: the Adam state (fp32 master, m, v) is sharded; gradients are reduced at the step.

During backward ``p.grad`` is a view of the full ``grad_flat`` buffer holding this rank's local
gradient. ``step()`` reduce-scatters each bucket in place (this rank's part of ``grad_flat``
receives the sum over ranks; the step divides by the world size), updates the rank's shard and
all-gathers the parameters. After ``step()`` the values ``p.grad`` shows are unspecified until
``zero_grad()``. With another ``communication_data_type`` (fp32 for bf16/fp16 gradients) each bucket
is reduced in a copy of that dtype and the sum written back in the gradients' dtype.
"""

from __future__ import annotations

from .base import Pipeline


class Stage1Pipeline(Pipeline):
    stage = 1
    grad_divisor_is_world = True
    allgather_by_bucket = True

    def _before_step(self) -> None:
        for buf in self.buffers:
            for bucket in buf.layout.buckets:
                full = buf.bucket_slice(buf.grad_flat, bucket).to(self.comm_dtype_of(buf))
                mine = self._grad_shard(buf, bucket)
                self._track(self.engine.reduce_scatter(mine, full, name=f"grads.{bucket.index}"))
        self._complete_inflight()
