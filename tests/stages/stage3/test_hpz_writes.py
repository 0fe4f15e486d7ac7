"""hpZ's secondary partition after a write between steps: a forward that kept it, then parameters written inside
``gathered_params()`` (or loaded); the next forward gathers the written values, as plain training does."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import zero_kernels as zk


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 4))


def _case(rank: int, world: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # one node: hpZ over pairs of it
    model, reference = _net(), _net()
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=3, stage3_param_persistence_threshold=0, zero_hpz_partition_size=2)
    torch.manual_seed(rank)
    x = torch.randn(5, 12)
    with torch.no_grad():
        model(x)  # keeps the secondary partition
    assert any(buf.secondary is not None for buf in opt._pipeline.buffers)
    with opt.gathered_params():
        for p in model.parameters():
            p.data.mul_(-0.5).add_(0.25)
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(-0.5).add_(0.25)
        got, want = model(x), reference(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


@pytest.mark.distributed
def test_a_forward_after_a_write_in_gathered_params_reads_the_written_values(spawn) -> None:
    spawn(_case, 4, timeout_s=300)
