"""Gradient buffers a reduction reads and writes when it completes on another stream than the backward's hooks.

On a GPU autograd runs the gradient hooks (which fill the buckets and issue their reductions) on the forward's
stream, and its end-of-backward callback (which completes the last reductions) on the stream of the caller of
``backward()``: with the forward under ``torch.cuda.stream(s)`` and ``backward()`` outside, they differ. What a
completion reads and writes there (a part added into ``grad_shard`` from a scratch bucket, a mean written back into
``p.grad`` from an fp32 copy) and then frees or gives back must come before what the hooks' stream queues next (the
next forward's allocations, which may take the freed blocks; a backward called from another stream): that stream
waits for the completions (``BackwardRound._follow_completions``). No GPU here: stand-in streams, and a tensor that
says it is on ``cuda:1``, record what the pipeline does.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import zero_kernels.optim as zo
from tests.helpers.streams import GPU1, OnGpu1, StandInStreams
from zero_kernels import comm

BUCKET = 1024  # elements per bucket (reduce_bucket_size)
BACKWARD, CALLBACK = "backward", "end-of-backward callback"


def _streams(monkeypatch: pytest.MonkeyPatch, pipeline: Any) -> StandInStreams:
    """Stand-in streams, ``BACKWARD`` current; ``pipeline`` on cuda:1 (its parameters' device), its round opened with
    the current stream as a gradient hook opens it."""
    streams = StandInStreams(monkeypatch, BACKWARD, CALLBACK)
    monkeypatch.setattr(pipeline, "device", GPU1)
    monkeypatch.setattr(pipeline, "_queue_round_end", lambda: None)  # no backward runs: the test ends it
    pipeline._first_report(0, 0, pipeline.buffers[0].params[0])
    return streams


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 160), nn.Tanh(), nn.Linear(160, 64), nn.Tanh(), nn.Linear(64, 160))


def test_stage2_completions_on_another_stream_come_before_the_next_fill(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 2 (and 3): a bucket's reduction completed on the callback's stream adds its part into ``grad_shard`` there
    from the bucket, then gives the bucket back to the pool (or frees it). What the hooks' stream queues next (a
    refill of the bucket, an allocation that takes its block, an add into ``grad_shard``) must wait for that add
    (else it reads other values: silently wrong gradients). Completions on the hooks' own stream add no wait."""
    pipeline = zo.ShardedFusedAdam(_model(), lr=1e-2, stage=2, reduce_bucket_size=BUCKET, impl="torch").pipeline
    buf = pipeline.buffers[0]
    largest = pipeline._largest()
    pipeline._new_bucket = lambda dtype, device, numel: torch.zeros(largest, dtype=dtype).as_subclass(OnGpu1)
    streams = _streams(monkeypatch, pipeline)
    first, second = buf.layout.buckets[:2]
    for bucket in (first, second):
        pipeline._scratch(buf, bucket)
        pipeline._launch_bucket(buf, bucket)
    pipeline._complete_inflight(keep=1)  # a hook completes the oldest on its own stream
    assert streams.made[BACKWARD].waited_for == []
    streams.use(CALLBACK)
    pipeline._complete_inflight()  # the end of backward completes the rest
    assert streams.made[BACKWARD].waited_for == [CALLBACK], "the next fill may run before the last completion"


def test_stage0_write_back_on_another_stream_comes_before_the_next_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 0 with a wider ``communication_data_type``: the completion writes the mean back into ``p.grad`` (views of
    ``grad_flat``) from the fp32 copy, here on the callback's stream, and frees the copy, whose block goes back to the
    hooks' stream: what that stream queues next (the next forward's allocations, a backward's gradients added into
    ``p.grad``) must wait for the write-back."""
    model = _model().to(torch.bfloat16)
    pipeline = zo.ShardedFusedAdam(model, lr=1e-2, stage=0, communication_data_type="fp32", impl="torch").pipeline
    buf = pipeline.buffers[0]
    bucket = buf.layout.buckets[0]
    buf.grad_flat = torch.ones(buf.layout.numel, dtype=torch.bfloat16).as_subclass(OnGpu1)
    engine = SimpleNamespace(world_size=2, rank=0, all_reduce=lambda tensor, op, name: comm.Handle(None, ()))
    monkeypatch.setattr(pipeline, "engine", engine)
    streams = _streams(monkeypatch, pipeline)
    pipeline._launch_bucket(buf, bucket)
    streams.use(CALLBACK)
    pipeline._complete_inflight()  # the mean written back into grad_flat on the callback's stream
    assert torch.equal(buf.bucket_slice(buf.grad_flat, bucket).float(), torch.full((bucket.numel,), 0.5))
    assert streams.made[BACKWARD].waited_for == [CALLBACK], "p.grad may be added to before the write-back"
