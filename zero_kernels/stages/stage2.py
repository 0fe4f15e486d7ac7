"""Stage 2: as stage 1, and each rank keeps only its shard of the reduced gradients.

During backward each parameter's gradient is copied, divided by the world size, into a bucket
of ``bucket_numel()`` elements (``buckets``), and ``p.grad`` is set to ``None`` (as DeepSpeed does): after
backward ``p.grad`` is ``None`` for every trainable parameter, except under ``no_sync()`` where
gradients accumulate in ``p.grad`` until the synchronised backward. A full bucket is
reduce-scattered while backward goes on; once it completes (at most ``max_inflight`` are in
flight, see ``base``) its rank part is written into ``grad_shard`` (copied by the first reduction
after a step, added by later ones, so several backward passes before a step accumulate) and the
bucket goes back to a pool, to be reused by the next bucket that fills. Buckets are of the
communication dtype (``communication_data_type``, else the gradients' own) and ``grad_shard`` of the
wider of the two: with ``"fp32"``, bf16/fp16 gradients are cast to fp32 as they are copied in,
reduced in fp32 and added up in fp32 until the step. Every ``gradient_accumulation_steps`` micro-step is reduced
and added into it, as DeepSpeed's ZeRO-2 does (``reduces_micro_steps``), so between micro-steps a rank holds its
shard, not the whole local gradient; a wider ``grad_accum_dtype`` widens ``grad_shard`` (``stages.grad_accum``).
The pool keeps what backward uses at once, ``pool_limit(device)`` buckets of the largest size:
``max_inflight + 1`` in flight, and two being filled or, in host memory where one parameter spans more
buckets, as many as it spans (its gradient is copied into all of them at once); never more bytes than this
rank's gradient shard. ``memory_report()`` shows it as ``buffers``. On a GPU the pool stays at two being
filled: the caching allocator gives a freed bucket's block to whatever asks next (the forward's activations
too), an idle pooled bucket only to a bucket. A fresh bucket per reduction (allocation, page
faults, zero-filling) made a 28M-parameter step on 2 gloo ranks 13 % slower (215 vs 187 ms, three
alternating runs each). On the CPU a bucket made anew and freed again between small tensors that outlive
it can leave its space in the C heap unused: at 403M parameters (stage 3, 4096 x 4096 weights, 2M-element
buckets, 4 new buckets per weight with the pool at ``max_inflight + 3``) the heap after the first backward
took 0.13 to 0.34 GB over five runs, and 0.11 GB in each of five with the pool at what backward uses. Only
the parts of a reused bucket that no gradient was copied into are
zeroed before it is reduced.

qgZ (``zero_quantized_gradients``, at stages 2 and 3, which share this path): each bucket's
reduce-scatter is ``comm.QuantizedReduceScatter`` (int4 blocks of ``kernels.tuning.QUANT_BLOCK[4]``, two
hops along the node boundary, optional ``zeropp_loco_param`` error feedback), made once per optimizer.
Only what crosses the wire is quantized: the scratch bucket is averaged as before, the reduced part
lands in ``grad_shard`` in the same dtype, and the fp32 master, the Adam state and checkpoints are
untouched.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from .. import kernels
from ..comm import ErrorFeedback, QuantizedReduceScatter
from ..kernels import flatten, tuning
from .base import FlatBuffer, Pipeline
from .layout import Bucket

FILLING = 2  # scratch buckets being filled at once, at least (more where one parameter spans more)


class Stage2Pipeline(Pipeline):
    stage = 2
    reduces_in_backward = True
    allgather_by_bucket = True

    quantizes_gradients = True
    reduces_micro_steps = True

    def __init__(self, engine: Any, options: Any, **kwargs: Any):
        super().__init__(engine, options, **kwargs)
        self._pool: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self.quantized_reducer = self._quantized_reducer(options)

    def _quantized_reducer(self, options: Any) -> Optional[QuantizedReduceScatter]:
        """qgZ's collective when ``zero_quantized_gradients`` is on (collective: every rank makes it here)."""
        if not getattr(options, "quantized_gradients", False):
            return None
        feedback = ErrorFeedback.from_loco(getattr(options, "loco_param", None))
        return QuantizedReduceScatter(
            self.engine, kernels, bits=4, block=tuning.QUANT_BLOCK[4], error_feedback=feedback
        )

    def _allocate_grads(self, buf: FlatBuffer) -> None:
        buf.grad_shard = torch.zeros(buf.layout.shard_numel, dtype=self.accumulate_dtype_of(buf), device=buf.device)

    def _scratch(self, buf: FlatBuffer, bucket: Bucket) -> torch.Tensor:
        """The bucket's scratch for this round: a pooled bucket, or a new one."""
        if bucket.index not in buf.scratch:
            dtype = self.comm_dtype_of(buf)
            pool = self._pool.setdefault((dtype, buf.device), [])
            while pool and pool[-1].numel() < bucket.numel:  # smaller than a group added since
                pool.pop()
            whole = pool.pop() if pool else self._new_bucket(dtype, buf.device, bucket.numel)
            buf.scratch[bucket.index] = whole.narrow(0, 0, bucket.numel)
            buf.filled[bucket.index] = set()
        return buf.scratch[bucket.index]

    def _new_bucket(self, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        """A scratch bucket for a bucket of ``numel`` elements, for when the pool has none (``new_scratch``): of the
        largest bucket's size where the pool may keep it for any bucket. Left unfilled, as a pooled one holds a past
        round's values (what no gradient is copied into is zeroed before the reduction, ``_zero_unfilled``)."""
        return self.new_scratch(self._largest(), numel, dtype, device)

    def _largest(self) -> int:
        """Elements of the largest bucket: the size of the scratch buckets the pool keeps."""
        return max((buf.layout.largest_bucket for buf in self.buffers), default=0)

    def _pieces(self, buf: FlatBuffer, slot: int, p: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, int, Tensor]]:
        """(bucket index, its scratch, offset there, the piece of ``p.grad``) for each bucket ``p`` lies in."""
        s = buf.layout.slots[slot]
        for k in buf.layout.slot_buckets[slot]:
            bucket = buf.layout.buckets[k]
            lo, hi = max(s.offset, bucket.start), min(s.offset + s.numel, bucket.start + bucket.numel)
            yield k, self._scratch(buf, bucket), lo - bucket.start, p.grad.reshape(-1).narrow(0, lo - s.offset, hi - lo)

    def _consume_grad(self, buf: FlatBuffer, slot: int, p: torch.Tensor) -> None:
        for k, scratch, offset, piece in self._pieces(buf, slot, p):
            flatten([piece], scratch, [offset], scale=1.0 / self.world_size, impl=self.impl)
            buf.filled[k].add(slot)
        p.grad = None

    def _add_grad(self, buf: FlatBuffer, slot: int, p: torch.Tensor) -> None:
        """A repeated gradient (``Pipeline._first_report``): added to what the scratch holds."""
        for _, scratch, offset, piece in self._pieces(buf, slot, p):
            scratch.narrow(0, offset, piece.numel()).add_(piece.to(scratch.dtype), alpha=1.0 / self.world_size)
        p.grad = None

    def _drop_grad(self, buf: FlatBuffer, slot: int, p: torch.Tensor) -> None:
        """A refused gradient (``Pipeline._first_report``): the step raises; it must not linger in a bucket."""
        p.grad = None

    def _drop_unreduced(self, buf: FlatBuffer) -> None:
        """The scratch buckets an abandoned round filled and did not reduce go back to the pool."""
        for scratch in buf.scratch.values():
            self._give_back(buf, scratch._base)
        buf.scratch.clear()
        buf.filled.clear()

    def _zero_unfilled(self, buf: FlatBuffer, bucket: Bucket, scratch: torch.Tensor, filled: set[int]) -> None:
        """Zero what no gradient was copied into: the pieces of parameters without one, and the padding
        (parameters lie back to back from the buffer's start; padding only follows the last one)."""
        for slot in bucket.slots:
            if slot not in filled:
                s = buf.layout.slots[slot]
                lo = max(s.offset, bucket.start) - bucket.start
                hi = min(s.offset + s.numel, bucket.start + bucket.numel) - bucket.start
                scratch[lo:hi].zero_()
        last = buf.layout.slots[-1]
        params_end = last.offset + last.numel - bucket.start
        if params_end < bucket.numel:
            scratch[params_end:].zero_()

    def _launch_bucket(self, buf: FlatBuffer, bucket: Bucket) -> None:
        scratch = self._scratch(buf, bucket)
        del buf.scratch[bucket.index]  # the collective owns it now; a later backward fills another
        self._zero_unfilled(buf, bucket, scratch, buf.filled.pop(bucket.index))
        mine = scratch.narrow(0, self.rank * bucket.shard_numel, bucket.shard_numel)

        def accumulate() -> None:
            self._accumulate(buf, bucket, mine, first=bucket.index not in buf.written)
            buf.written.add(bucket.index)
            self._give_back(buf, scratch._base)

        name = f"grads.{bucket.index}"
        if self.quantized_reducer is None:
            handle = self.engine.reduce_scatter(mine, scratch, name=name)
        else:
            handle = self.quantized_reducer.reduce_scatter(mine, scratch, name=name, key=(id(buf), bucket.index))
        self._track(handle, accumulate, held=(scratch,))

    def _accumulate(self, buf: FlatBuffer, bucket: Bucket, mine: torch.Tensor, first: bool) -> None:
        """Bring a completed reduction (``mine``: this rank's part of ``bucket``) into the gradient shard: the
        ``first`` since the step is copied (what the shard held there is spent: ``grad_state``), later ones added."""
        if first:
            self.grad_shard(buf, bucket).copy_(mine)
        else:
            self.grad_shard(buf, bucket).add_(mine)

    def pool_limit(self, device: torch.device) -> int:
        """Scratch buckets the pool keeps on ``device``: ``max_inflight + 1`` in flight and those being filled at once
        (``FILLING``; in host memory, the most buckets one parameter spans if more: its gradient is copied into all
        of them at once)."""
        if device.type != "cpu":
            return self.max_inflight + 1 + FILLING
        widest = max((buf.layout.widest_slot for buf in self.buffers), default=1)
        return self.max_inflight + 1 + max(FILLING, widest)

    def _give_back(self, buf: FlatBuffer, whole: torch.Tensor) -> None:
        """Keep a finished scratch bucket of the largest size for reuse, within the pool's limits."""
        pool = self._pool.setdefault((whole.dtype, buf.device), [])
        pooled = sum(t.numel() * t.element_size() for ts in self._pool.values() for t in ts)
        fits = pooled + whole.numel() * whole.element_size() <= self.grad_shard_bytes()
        if whole.numel() == self._largest() and len(pool) < self.pool_limit(buf.device) and fits:
            pool.append(whole)

    def memory_tensors(self) -> dict[str, list[Optional[torch.Tensor]]]:
        """As the base, with ``buffers`` the pooled scratch buckets."""
        tensors = super().memory_tensors()
        tensors["buffers"] = [t for pool in self._pool.values() for t in pool]
        return tensors
