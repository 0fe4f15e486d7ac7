"""Process groups: a rank outside the one it passes is told so (zk.initialize and ShardedFusedAdam), zk.initialize on
a group names the global rank whose values its members take, and an optimizer built before init_process_group warns
when several ranks run."""

from __future__ import annotations

import logging

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


def _steps_logged(opt: zk.ShardedFusedAdam, model: torch.nn.Module, caplog, steps: int) -> None:
    """``steps`` steps of ``opt`` on ``model`` (its gradients zeroed first), the warnings they log in ``caplog``."""
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        with caplog.at_level("WARNING", logger="zero_kernels"):
            opt.step()


def test_an_optimizer_built_before_the_process_group_warns_once_when_ranks_run(monkeypatch, caplog) -> None:
    """Built before ``init_process_group`` (world size 1), it trains each process alone: the first step says so."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    said = "built before torch.distributed was initialised"
    _steps_logged(zk.ShardedFusedAdam(model, lr=1e-2, stage=2), model, caplog, 1)
    assert said not in caplog.text, "warned without a process group"
    late = zk.ShardedFusedAdam(model, lr=1e-2, stage=2)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    _steps_logged(late, model, caplog, 2)
    assert caplog.text.count(said) == 1 and "while 4 ranks run" in caplog.text, caplog.text


def test_an_optimizer_launched_on_several_ranks_without_a_process_group_warns_once(monkeypatch, caplog) -> None:
    """The README's quick start under ``torchrun`` with no ``init_process_group``: ``WORLD_SIZE`` says several
    processes run, torch.distributed was never initialised, each process trains alone: the first step says so."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    said = "torch.distributed was never initialised"
    monkeypatch.setenv("WORLD_SIZE", "1")
    _steps_logged(zk.ShardedFusedAdam(model, lr=1e-2, stage=2), model, caplog, 1)
    assert said not in caplog.text, "warned with WORLD_SIZE=1"
    monkeypatch.setenv("WORLD_SIZE", "2")
    _steps_logged(zk.ShardedFusedAdam(model, lr=1e-2, stage=2), model, caplog, 2)
    assert caplog.text.count(said) == 1 and "WORLD_SIZE=2" in caplog.text, caplog.text


def _differing_values(rank: int, world: int) -> None:
    group = dist.new_group([1, 2])
    if rank == 0:
        dist.barrier()
        return
    torch.manual_seed(rank)  # the members start from different values
    model = torch.nn.Linear(3, 2)
    torch.manual_seed(1)
    expected = torch.nn.Linear(3, 2)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zero_kernels").addHandler(handler)
    try:
        zk.initialize(model, CONFIG, process_group=group)
    finally:
        logging.getLogger("zero_kernels").removeHandler(handler)
    assert torch.equal(model.weight.detach(), expected.weight.detach()), "not global rank 1's values"
    assert any("process_group's rank 0's (global rank 1) values" in m for m in said), said
    dist.barrier()


@pytest.mark.distributed
def test_initialize_on_a_group_names_the_global_rank_whose_values_every_member_takes(spawn) -> None:
    spawn(_differing_values, 3)
