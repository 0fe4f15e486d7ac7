"""The step's update of one bucket: this rank's shard through the fused Adam kernel.

A launch updates a run of parameters with the same step count (the count after this update); runs
are split where counts differ (a parameter that had no gradient on any rank is skipped) and merged
where they agree, and the padding after the last parameter joins the last run so that it stays
aligned. A run split at a parameter boundary starts or ends anywhere, so each launch covers the
16-element-aligned span around its run and updates the run only (``adam_step``'s ``window``): every
launch has aligned tensors whose length is a multiple of 16, and runs the kernel's one compiled
vector variant (an unaligned launch would compile a scalar variant mid-training, and run it).
Neighbouring spans share at most one 16-element group; their launches run one after the other on
the stream. The gradient multiplier and the skip flag come from the step's decision (``outcome``).
Low-precision parameters: the kernel writes them (``out=``) from the fp32 master, and first adopts
what was written into them since the last step (``adopt_out``, see ``master``).

Epilogue (ZeRO++'s qwZ): when the updated shard will be all-gathered as int8 blocks
(``pipeline.epilogue_quantizer``) and one launch updates the whole shard (one run from its first element
to its last), that launch also writes the shard's payload (``adam_step``'s ``quantized``: the int8 blocks of
the parameters it just wrote, in ``quantized_gather.Payload``'s layout) and hands it to the quantizer, which
the gathers then read. A bucket split into several runs, or partly not updated, is quantized by the first
gather instead: a block may straddle two launches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from ..kernels import QuantizedBlocks, adam_step
from .buffers import FlatBuffer, GroupHyper
from .layout import MIN_ALIGN_ELEMENTS, Bucket
from .outcome import Decision
from .quantized_gather import Payload

if TYPE_CHECKING:
    from .base import Pipeline


def runs(pipeline: "Pipeline", buf: FlatBuffer, bucket: Bucket, with_grad: set[int]) -> Iterator[tuple[int, int, int]]:
    """(start, numel, step) of the pieces of ``bucket``'s shard to update, merged where possible.

    Args:
        pipeline: the optimizer's pipeline (this rank's shard, the step counts).
        buf: the buffer ``bucket`` belongs to.
        bucket: the bucket.
        with_grad: parameter indices with a gradient on some rank this step.
    """
    start = numel = step = None
    for seg in buf.layout.segments(pipeline.shard_rank, bucket.index):
        index = buf.index_of(seg.slot)
        local = seg.shard_offset - bucket.shard_offset
        key = pipeline.step_counts.counts[index] + 1 if index in with_grad else None
        if key is not None and key == step and start + numel == local:
            numel += seg.numel
            continue
        if step is not None:
            yield start, numel, step
        start, numel, step = local, seg.numel, key
    if step is not None:  # only padding follows (zero gradients): update it too, so the run stays aligned
        yield start, bucket.shard_numel - start, step


def aligned_span(start: int, end: int, limit: int) -> tuple[int, int]:
    """The 16-element-aligned span around elements ``[start, end)`` of a shard of ``limit`` elements.

    A bucket's shard starts 64-byte aligned and holds a multiple of 16 elements (``layout``), so the
    span's tensors are 16-byte aligned and its length a multiple of 16.
    """
    unit = MIN_ALIGN_ELEMENTS  # 16: what the Adam kernel's vector variant needs of a launch's start and length
    return start // unit * unit, min(limit, -(-end // unit) * unit)


@dataclass(frozen=True)
class BucketTensors:
    """What one bucket's update reads and writes, each over this rank's shard of the bucket: the fp32
    ``master``, the reduced ``grad``, Adam's ``m`` and ``v``, the low-precision parameters ``out`` (None for
    fp32 parameters, their own master) and AMSGrad's ``v_max`` (None unless the group uses it)."""

    master: torch.Tensor
    grad: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    out: Optional[torch.Tensor]
    v_max: Optional[torch.Tensor]


def update_bucket(
    pipeline: "Pipeline", buf: FlatBuffer, bucket: Bucket, h: GroupHyper, decision: Decision, with_grad: set[int]
) -> None:
    """Run the fused Adam kernel over this rank's shard of ``bucket``, where the shards live on the device.

    Args:
        pipeline: the optimizer's pipeline.
        buf: the buffer ``bucket`` belongs to.
        bucket: the bucket.
        h: the hyper-parameters of ``buf``'s param group.
        decision: the step's gradient multiplier and skip flag (``outcome.decide``).
        with_grad: parameter indices with a gradient on some rank this step.
    """
    with pipeline.device_params(buf, bucket) as params:
        low = buf.master is not None
        tensors = BucketTensors(
            pipeline.master_shard(buf, bucket) if low else params,
            pipeline.grad_shard(buf, bucket),
            buf.shard_slice(buf.exp_avg, bucket),
            buf.shard_slice(buf.exp_avg_sq, bucket),
            params if low else None,
            buf.shard_slice(buf.max_exp_avg_sq, bucket) if h.amsgrad else None,
        )
        quantizer = pipeline.epilogue_quantizer(buf)
        if quantizer is None or not whole(pipeline, buf, bucket, with_grad):
            launch(pipeline, buf, bucket, h, decision, with_grad, tensors, pipeline.impl)
            return
        layout = Payload(params.numel())
        payload = layout.empty(params.device)
        launch(pipeline, buf, bucket, h, decision, with_grad, tensors, pipeline.impl, quantized=layout.view(payload))
    quantizer.hold(quantizer.key(buf, bucket), pipeline.param_shard(buf, bucket), payload)


def whole(pipeline: "Pipeline", buf: FlatBuffer, bucket: Bucket, with_grad: set[int]) -> bool:
    """True when one launch updates every element of this rank's shard of ``bucket`` (one run, all of it)."""
    pieces = list(runs(pipeline, buf, bucket, with_grad))
    return len(pieces) == 1 and pieces[0][:2] == (0, bucket.shard_numel)


def launch(
    pipeline: "Pipeline",
    buf: FlatBuffer,
    bucket: Bucket,
    h: GroupHyper,
    decision: Decision,
    with_grad: set[int],
    tensors: BucketTensors,
    impl: Optional[str],
    quantized: Optional[QuantizedBlocks] = None,
    adopt: bool = True,
) -> None:
    """The kernel launches of one bucket's update over ``tensors`` (on the device, or a state tier's host copies)
    with kernel backend ``impl`` (``kernels.adam_step``'s); ``quantized``: the epilogue's blocks, written by the
    one launch of a bucket that ``whole`` found updated whole (no window: it covers the shard); ``adopt``: read
    ``tensors.out`` for edits first (``adam_step``'s ``adopt_out``; False: it holds nothing to adopt)."""
    device = tensors.master.device
    scale, skip = decision.grad_scale, decision.skip
    if isinstance(scale, torch.Tensor):
        scale = scale.to(device)  # the same tensor unless the model spans devices or the state is offloaded
    if skip is not None:
        skip = skip.to(device)
    t = tensors
    every = (t.master, t.grad, t.m, t.v, t.out, t.v_max)
    for start, numel, step in runs(pipeline, buf, bucket, with_grad):
        first, last = aligned_span(start, start + numel, bucket.shard_numel)
        window = None if quantized is not None else (start - first, start + numel - first)
        master_p, grad_p, m_p, v_p, out_p, v_max_p = (
            None if x is None else x.narrow(0, first, last - first) for x in every
        )
        adam_step(
            master_p, grad_p, m_p, v_p,
            lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay, step=step,
            adamw=h.adamw, grad_scale=scale, out=out_p, max_exp_avg_sq=v_max_p, maximize=h.maximize,
            skip_if=skip, window=window, adopt_out=adopt, quantized=quantized, impl=impl,
        )  # fmt: skip
