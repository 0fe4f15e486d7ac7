"""Stage 1: the Adam state (fp32 master, m, v) is sharded; gradients are reduced at the step.

During backward ``p.grad`` is a view of the full ``grad_flat`` buffer holding this rank's local
gradient, and it stays so: the step never writes into it. ``step()`` copies each bucket of
``grad_flat`` into a scratch bucket, divided by the world size (as stages 0 and 2 divide before they
reduce, and DeepSpeed: a sum of fp16 gradients that are each finite must not overflow), and
reduce-scatters that (a collective's input is scratch, see ``comm``) into ``grad_shard``, this rank's
averaged gradients, updates the rank's shard and all-gathers the parameters. So a second ``step()``
without a new backward, or a loop that never clears gradients (each backward adds to ``p.grad``),
sees what ``torch.optim.AdamW`` with DDP-averaged gradients sees. One rank reduces nothing:
``grad_flat`` is its reduced gradient. With another ``communication_data_type`` (fp32 for bf16/fp16
gradients) the scratch buckets are of that dtype and ``grad_shard`` of the wider one, so the sum is
never rounded to the gradients' dtype. With a ``grad_accum_dtype`` wider than the gradients,
``grad_flat`` is of that dtype and holds them instead of ``p.grad`` (None after backward, as
DeepSpeed's BF16_Optimizer leaves it): every backward's gradients are added into it, the step
reduces the sum from there (``stages.grad_accum``) into a ``grad_shard`` of that dtype.

Memory. ``grad_shard`` (this rank's part of the gradients) and the idle scratch buckets (no more
bytes than ``grad_shard``, each of the largest bucket's size; where one of that size is larger than ``grad_shard``
none is kept and each is made at its own bucket's size) are kept from one step to the next and shown by
``memory_report()`` as ``buffers``: they hold nothing between steps. At the step up to ``STEP_INFLIGHT``
reductions are in flight. Allocating both afresh at every step, or two reductions in flight, made a 6.3M-parameter
step on 2 gloo ranks about 1.5x slower than reducing in place (medians of 20 steps, loaded machine);
kept and four in flight, about 1.1x (the copy of the gradients).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .base import FlatBuffer, Pipeline
from .layout import Bucket

STEP_INFLIGHT = Pipeline.max_inflight + 2  # reductions in flight at the step


class Stage1Pipeline(Pipeline):
    stage = 1
    accumulates_locally = True
    allgather_by_bucket = True

    def __init__(self, engine: Any, options: Any, **kwargs: Any):
        super().__init__(engine, options, **kwargs)
        self._idle: list[torch.Tensor] = []  # scratch buckets kept for the next reductions

    def grad_shard(self, buf: FlatBuffer, bucket: Bucket) -> torch.Tensor:
        if buf.grad_shard is None:  # one rank: the local gradient is the reduced one
            return super().grad_shard(buf, bucket)
        return buf.shard_slice(buf.grad_shard, bucket)

    def _before_step(self) -> None:
        if self.world_size == 1:
            return
        for buf in self.buffers:
            if buf.grad_shard is None:
                dtype = self.accumulate_dtype_of(buf)
                buf.grad_shard = torch.empty(buf.layout.shard_numel, dtype=dtype, device=buf.device)
            for bucket in buf.layout.buckets:
                self._reduce_bucket(buf, bucket)
                buf.written.add(bucket.index)
                self._complete_inflight(keep=STEP_INFLIGHT)
        self._complete_inflight()

    def _reduce_bucket(self, buf: FlatBuffer, bucket: Bucket) -> None:
        """Reduce-scatter a scratch copy of ``bucket``'s local gradients into ``grad_shard``: straight into
        it where the dtypes agree, else in place and then copied (a narrower communication dtype)."""
        scratch = self._scratch(buf, bucket)
        part = scratch.narrow(0, 0, bucket.numel)
        part.copy_(buf.bucket_slice(buf.grad_flat, bucket)).div_(self.world_size)  # averaged before the sum
        target = self.grad_shard(buf, bucket)
        out = (
            target if target.dtype == part.dtype else part.narrow(0, self.rank * bucket.shard_numel, bucket.shard_numel)
        )

        def finish() -> None:
            if out is not target:
                target.copy_(out)
            self._give_back(scratch)

        self._track(self.engine.reduce_scatter(out, part, name=f"grads.{bucket.index}"), finish, held=(scratch,))

    def _scratch(self, buf: FlatBuffer, bucket: Bucket) -> torch.Tensor:
        """An idle scratch bucket of ``buf``'s communication dtype, on its device, that fits every bucket
        reduced in that dtype, or a new one for ``bucket`` (``_new_bucket``)."""
        dtype = self.comm_dtype_of(buf)
        size = self._scratch_numel(dtype)
        for i, t in enumerate(self._idle):
            if t.dtype == dtype and t.device == buf.device and t.numel() >= size:
                return self._idle.pop(i)
        return self._new_bucket(dtype, buf.device, bucket.numel)

    def _new_bucket(self, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        """A new scratch bucket for a bucket of ``numel`` elements (``new_scratch``), sized to fit every bucket of
        ``dtype`` where the idle ones may keep it."""
        return self.new_scratch(self._scratch_numel(dtype), numel, dtype, device)

    def _scratch_numel(self, dtype: torch.dtype) -> int:
        """Elements of a scratch bucket that fits every bucket reduced in ``dtype``."""
        return max(other.layout.largest_bucket for other in self.buffers if self.comm_dtype_of(other) == dtype)

    def _give_back(self, scratch: torch.Tensor) -> None:
        """Keep a finished scratch bucket that fits every bucket, while the idle ones hold no more bytes than the
        gradient shard."""
        idle = sum(t.numel() * t.element_size() for t in [*self._idle, scratch])
        if scratch.numel() >= self._scratch_numel(scratch.dtype) and idle <= self.grad_shard_bytes():
            self._idle.append(scratch)

    def memory_tensors(self) -> dict[str, list[Optional[torch.Tensor]]]:
        """As the base, with the gradient shard and the idle scratch buckets as ``buffers``."""
        tensors = super().memory_tensors()
        shards = {id(buf.grad_shard) for buf in self.buffers}
        tensors["grads"] = [t for t in tensors["grads"] if id(t) not in shards]
        tensors["buffers"] = [buf.grad_shard for buf in self.buffers] + self._idle
        return tensors
