"""A rank that passes a process group it is not a member of is told so, by zk.initialize and ShardedFusedAdam."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zero_kernels as zk

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 2},
}


def _outside(rank: int, world: int) -> None:
    group = dist.new_group([1, 2])  # torch gives rank 0 GroupMember.NON_GROUP_MEMBER
    if rank == 0:
        said = "rank 0 is not a member of process_group: build the optimizer only on its member ranks"
        with pytest.raises(ValueError, match=said):
            zk.initialize(torch.nn.Linear(3, 2), CONFIG, process_group=group)
        with pytest.raises(ValueError, match=said):
            zk.ShardedFusedAdam(torch.nn.Linear(3, 2), stage=2, process_group=group)
    else:
        _, opt = zk.initialize(torch.nn.Linear(3, 2), CONFIG, process_group=group)
        assert opt.pipeline.engine.world_size == 2
    dist.barrier()


@pytest.mark.distributed
def test_a_rank_outside_its_process_group_is_told_so(spawn) -> None:
    spawn(_outside, 3)
