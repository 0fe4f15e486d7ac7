"""hpZ's secondary partition after a write between steps: a forward that kept it, then parameters written inside
``gathered_params()``, loaded from a checkpoint, set by ``safe_set_full_fp32_param`` or given a value while freed
(``p.data = ...``); the next forward gathers the written values, as plain training does. A load writes nothing into a
shard that holds padding only (rank 3's of the first unit here), nor does a setter or an assigned value into a shard
without the parameter, so that rank's shard looked unchanged: it alone kept its secondary partition (other ranks'
values) and gathered from it, the others from every rank (gloo timed out, or the gathers paired up wrongly)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import zero_kernels as zk

HPZ = {"stage3_param_persistence_threshold": 0, "zero_hpz_partition_size": 2}


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 4))


def _same_forward(model: torch.nn.Module, reference: torch.nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        got, want = model(x), reference(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def _case(rank: int, world: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # one node: hpZ over pairs of it
    model, reference = _net(), _net()
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=3, **HPZ)
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
    _same_forward(model, reference, x)


@pytest.mark.distributed
def test_a_forward_after_a_write_in_gathered_params_reads_the_written_values(spawn) -> None:
    spawn(_case, 4, timeout_s=300)


def _load_case(rank: int, world: int, root: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    saved = _net(1)
    zk.checkpoint.save(root, saved, zk.ShardedFusedAdam(saved, lr=1e-2, stage=3, **HPZ))
    model = _net()
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=3, **HPZ)
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        model(x)  # keeps the secondary partition
    if rank == 3:
        assert not list(opt._pipeline.buffers[0].layout.segments(3)), "rank 3's shard of the first unit: padding only"
    zk.checkpoint.load(root, model, opt)
    _same_forward(model, _net(1), x)


@pytest.mark.distributed
def test_a_forward_after_a_checkpoint_load_reads_the_loaded_values(spawn, tmp_path: Path) -> None:
    spawn(_load_case, 4, str(tmp_path), timeout_s=60)


def _partitions_kept(
    rank: int,
) -> tuple[torch.nn.Module, torch.nn.Module, zk.ShardedFusedAdam, torch.Tensor, torch.Tensor]:
    """(model, reference, optimizer, x, value): stage 3 with hpZ after a forward that kept the secondary partitions;
    ``value``, a new bias of the last layer (4 elements: in one rank's shard), is already in ``reference``."""
    model, reference = _net(), _net()
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=3, **HPZ)
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        model(x)  # keeps the secondary partition
        assert all(buf.secondary is not None for buf in opt._pipeline.buffers)
        value = _net(1)[2].bias.detach().clone()
        reference[2].bias.copy_(value)
    return model, reference, opt, x, value


def _set_case(rank: int, world: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    model, reference, _, x, value = _partitions_kept(rank)
    zk.safe_set_full_fp32_param(model[2].bias, value)
    _same_forward(model, reference, x)


@pytest.mark.distributed
def test_a_forward_after_setting_one_parameter_reads_its_value(spawn) -> None:
    spawn(_set_case, 4, timeout_s=60)


def _assign_case(rank: int, world: int) -> None:
    os.environ.update(GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")  # 2 nodes of 2
    model, reference, opt, x, value = _partitions_kept(rank)
    model[2].bias.data = value.clone()  # freed: its shard takes it before the next gather
    if rank == 0:
        opt.state_dict()  # a read on one rank takes it there first, before the forward gathers the first unit
    _same_forward(model, reference, x)


@pytest.mark.distributed
def test_a_forward_after_assigning_a_freed_parameter_reads_its_value(spawn) -> None:
    spawn(_assign_case, 4, timeout_s=60)
