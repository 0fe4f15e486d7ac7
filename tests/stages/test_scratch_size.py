"""Where a scratch bucket of the largest size holds more bytes than this rank's gradient shard (so none is kept for
reuse: a model of fewer than two buckets per rank), a new scratch bucket is of its own bucket's size: one step makes
no more scratch than the gradients' elements. Before, every one was of the largest size: a 2.1M-parameter fp32 MLP
on 2 gloo ranks (buckets of 2M and 101K elements) held 16 MB of scratch during stage 2's backward and stage 1's
step, for 8.4 MB of gradients (stage 0 holds no more). Where the pool keeps buckets they stay of the largest size."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_kernels.optim as zo

BUCKET = 10240  # elements per bucket: the model's 12480 parameters make buckets of 10240 and 2240


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))


def _made_per_step(stage: int, rank: int, bucket: int) -> tuple[list[int], zo.ShardedFusedAdam]:
    """Elements of the scratch buckets each of three steps made (persistent parameters at stage 3: one unit)."""
    model = _model()
    options = {"stage3_param_persistence_threshold": 10**9} if stage == 3 else {}
    opt = zo.ShardedFusedAdam(model, lr=1e-2, stage=stage, reduce_bucket_size=bucket, impl="torch", **options)
    pipeline = opt.pipeline
    made, new_bucket = [], pipeline._new_bucket

    def record(*args: object) -> torch.Tensor:
        bucket = new_bucket(*args)
        made.append(bucket.numel())
        return bucket

    pipeline._new_bucket = record
    per_step = []
    torch.manual_seed(1 + rank)
    for _ in range(3):
        before = len(made)
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        per_step.append(sum(made[before:]))
    return per_step, opt


def _sizes(rank: int, world: int) -> None:
    params = sum(p.numel() for p in _model().parameters())
    for stage in (2, 3, 1):
        per_step, opt = _made_per_step(stage, rank, BUCKET)
        sizes = [b.numel for buf in opt.pipeline.buffers for b in buf.layout.buckets]
        assert sizes == [BUCKET, params - BUCKET], f"stage {stage}: buckets {sizes}"
        assert all(0 < made <= params for made in per_step), f"stage {stage}: scratch elements per step {per_step}"
        idle = opt.memory_report()["buffers"] - (4 * params // world if stage == 1 else 0)  # stage 1: the shard too
        assert idle == 0, f"stage {stage}: {idle} bytes of scratch kept"
        # buckets that fit the shard: of the largest size, kept for reuse
        per_step, opt = _made_per_step(stage, rank, 2048)
        largest = max(b.numel for buf in opt.pipeline.buffers for b in buf.layout.buckets)
        assert per_step[0] > 0 and all(made % largest == 0 for made in per_step), f"stage {stage}: {per_step}"


@pytest.mark.distributed
def test_scratch_of_its_own_size_where_none_is_kept(spawn) -> None:
    spawn(_sizes, 2)
