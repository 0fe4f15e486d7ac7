"""``ZeroTrainer`` given a ``ShardedFusedAdam`` on a process group of some of the ranks (a device mesh's
data-parallel group, each group training its own model) refuses it: the Trainer saves on global rank 0 only, so
``save_model`` on the other groups returned having written nothing (an empty directory, no error)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_kernels as zk
from tests.helpers.dist import run_ranks_checked

pytest.importorskip("transformers")


def _trainer_on_a_group_of_one(rank: int, world: int) -> list[str]:
    from zero_kernels.integrations.hf import ZeroTrainer

    mine, _ = dist.new_subgroups(group_size=1)
    torch.manual_seed(rank)
    model = nn.Linear(4, 1)
    opt = zk.ShardedFusedAdam(model.parameters(), lr=1e-3, process_group=mine)
    found = [f"rank {rank}: an optimizer on a group of one of 2 ranks was taken"]
    try:
        ZeroTrainer(model=model, optimizers=(opt, None))
    except ValueError as err:
        found = [] if f"global ranks [{rank}] of 2" in str(err) and "zk.checkpoint.save" in str(err) else [str(err)]
    dist.barrier()  # rank 0 holds the store: it waits until rank 1 has made its group
    return found


@pytest.mark.distributed
def test_zero_trainer_refuses_an_optimizer_on_a_group_of_some_ranks() -> None:
    run_ranks_checked(_trainer_on_a_group_of_one, 2)
