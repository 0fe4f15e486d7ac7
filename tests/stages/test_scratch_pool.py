"""The pool of scratch buckets keeps what one backward uses at once: in host memory, with a parameter that spans
more buckets than ``FILLING`` (its gradient is copied into all of them at once), the steps after the first make
no new bucket. Before, the pool kept ``max_inflight + 3`` and every backward made the rest anew (zero-filled, and
freed into the C heap between tensors that outlive them). A GPU's pool keeps ``max_inflight + 3``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_kernels.optim as zo
from zero_kernels.stages.stage2 import FILLING, Stage2Pipeline

BUCKET = 1024  # elements per bucket (reduce_bucket_size)


def _model() -> nn.Module:
    torch.manual_seed(0)
    # three weights of 10240 elements, each spanning 10 buckets or more; enough in all that the pool's other bound,
    # this rank's gradient shard, leaves room for what one of them needs
    return nn.Sequential(nn.Linear(64, 160), nn.Tanh(), nn.Linear(160, 64), nn.Tanh(), nn.Linear(64, 160))


def _steps(rank: int, world: int) -> None:
    for stage in (2, 3):
        model = _model()
        opt = zo.ShardedFusedAdam(model, lr=1e-2, stage=stage, reduce_bucket_size=BUCKET, impl="torch",
                                  stage3_param_persistence_threshold=0)  # fmt: skip
        pipeline = opt.pipeline
        spans = max(len(k) for buf in pipeline.buffers for k in buf.layout.slot_buckets)
        assert spans > FILLING + 2, f"stage {stage}: the weight spans {spans} buckets"
        cpu, gpu = torch.device("cpu"), torch.device("cuda")  # the limit of a GPU's pool: read, never allocated on
        assert pipeline.pool_limit(cpu) == pipeline.max_inflight + 1 + spans, stage
        assert pipeline.pool_limit(gpu) == pipeline.max_inflight + 1 + FILLING, stage
        made, new_bucket = [], pipeline._new_bucket
        pipeline._new_bucket = lambda *a: made.append(1) or new_bucket(*a)
        per_step = []
        torch.manual_seed(1 + rank)
        for _ in range(3):
            before = len(made)
            model(torch.randn(4, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            per_step.append(len(made) - before)
        assert per_step[0] > 0 and per_step[1:] == [0, 0], f"stage {stage}: new buckets per step {per_step}"
        pooled = sum(t.numel() for t in pipeline.memory_tensors()["buffers"])
        assert pooled <= pipeline.pool_limit(cpu) * max(b.numel for buf in pipeline.buffers for b in buf.layout.buckets)


@pytest.mark.distributed
def test_steps_after_the_first_make_no_new_bucket(spawn) -> None:
    spawn(_steps, 2)


@pytest.mark.parametrize("limit", [1, 2])
def test_the_pool_keeps_no_more_buckets_than_its_limit(limit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backward that fills more scratch buckets than ``pool_limit`` (here forced low, as a GPU's is beside a
    parameter spanning many buckets) gives back to the pool only up to the limit; the rest are freed."""
    monkeypatch.setattr(Stage2Pipeline, "pool_limit", lambda self, device: limit)
    model = _model()
    opt = zo.ShardedFusedAdam(model, lr=1e-2, stage=2, reduce_bucket_size=BUCKET, impl="torch")
    for _ in range(2):
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        assert len(opt.pipeline.memory_tensors()["buffers"]) == limit
