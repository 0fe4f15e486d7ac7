"""Errors that name other ranks name their global ranks too, where the process group numbers its ranks apart from
the job's: a data-parallel group of a device mesh (``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp",
"tp"))``: ``mesh["dp"]`` is the group of global ranks 0 and 2, or 1 and 3), whose rank 1 is global rank 2 or 3.
The options' agreement, the step's agreement, the offload start-up, stage 3's gather checks and a checkpoint's
failures named the group's rank
only, which points at another process's log."""

from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch
from torch import nn

import zero_kernels as zk
from tests.helpers.dist import run_ranks_checked, watchdog
from zero_kernels import comm
from zero_kernels.comm.agreement import RanksDisagree, ranks_text
from zero_kernels.stages import offloaded
from zero_kernels.stages.stage3.check import describe_mismatch


def test_ranks_text_names_the_global_ranks_of_a_group() -> None:
    assert ranks_text([1]) == "rank 1"
    assert ranks_text([1], (0, 2)) == "rank 1 (global rank 2)"
    assert ranks_text([1, 0], (3, 1)) == "ranks 0-1 (global ranks 3, 1)"


def test_stage3_gather_mismatch_names_the_global_ranks() -> None:
    everyone = [[("a", "Linear", 4)], [("b", "Linear", 4)]]
    message = describe_mismatch(everyone, "forward", lambda names: "", (1, 3))
    assert "rank 0 (global rank 1) gathers the parameters of 'a'" in message, message
    assert "rank 1 (global rank 3) gathers the parameters of 'b'" in message, message


def _mesh_group_errors(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    with watchdog(60):
        group = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["dp"].get_group()
        failures = []
        second = f"rank 1 (global rank {2 + rank % 2})"
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        try:
            zk.ShardedFusedAdam(model.parameters(), lr=1e-3 if rank < 2 else 2e-3, process_group=group)
            failures.append(f"rank {rank}: different lrs were accepted")
        except RanksDisagree as err:
            if f"0.002 on {second}" not in str(err):
                failures.append(f"rank {rank}: {err}")
        opt = zk.ShardedFusedAdam(model.parameters(), lr=1e-3, process_group=group)
        opt.param_groups[0]["lr"] = 1e-3 if rank < 2 else 2e-3
        model(torch.ones(2, 4)).sum().backward()
        try:
            opt.step()
            failures.append(f"rank {rank}: different lrs were stepped")
        except RanksDisagree as err:
            if f"0.002 on {second}" not in str(err):
                failures.append(f"rank {rank}: {err}")
        engine = comm.TorchCommEngine(group)
        problem: Optional[str] = "disk full" if rank >= 2 else None
        try:
            offloaded.agree(engine, problem, "offload.start")
            failures.append(f"rank {rank}: the offload problem was not raised")
        except OSError as err:
            if f"{second}: disk full" not in str(err):
                failures.append(f"rank {rank}: {err}")
        return failures


@pytest.mark.distributed
def test_errors_on_a_device_meshs_data_parallel_group_name_the_global_ranks() -> None:
    run_ranks_checked(_mesh_group_errors, 4)


def _mesh_checkpoint_error(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    from zero_kernels.checkpoint import sharded

    with watchdog(60):
        group = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["dp"].get_group()
        torch.manual_seed(0)
        opt = zk.ShardedFusedAdam(nn.Linear(4, 4).parameters(), lr=1e-3, process_group=group)

        def read() -> None:
            if rank >= 2:  # the group's rank 1
                raise zk.checkpoint.CheckpointError("shard file rank00001.bin is corrupted")

        try:
            sharded._collect(opt.pipeline, read, share=False)
            return [f"rank {rank}: the failure was not raised"]
        except zk.checkpoint.CheckpointError as err:
            second = f"rank 1 (global rank {2 + rank % 2}): shard file"
            return [] if str(err).startswith(second) else [f"rank {rank}: {err}"]


@pytest.mark.distributed
def test_a_checkpoint_failure_on_a_device_meshs_data_parallel_group_names_the_global_rank() -> None:
    run_ranks_checked(_mesh_checkpoint_error, 4)


def _refused_on_the_second_rank(rank: int, opt: zk.ShardedFusedAdam, step: Callable[[], None]) -> list[str]:
    try:
        step()
        opt.step()
        return [f"rank {rank}: the step took what rank 1 of the group did"]
    except RuntimeError as err:
        where = f"(found on rank 1 (global rank {2 + rank % 2}) of 2; every rank raises)"
        return [] if where in str(err) else [f"rank {rank}: {err}"]


def _mesh_step_refusals(rank: int, world: int) -> list[str]:
    """What a backward found on the group's rank 1 only, raised by the step on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    with watchdog(60):
        group = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["dp"].get_group()
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        opt = zk.ShardedFusedAdam(model, lr=1e-3, stage=2, process_group=group)

        def after_clip() -> None:
            model(torch.ones(2, 4)).sum().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            with opt.no_sync():
                if rank >= 2:
                    model(torch.ones(2, 4)).sum().backward()

        failures = _refused_on_the_second_rank(rank, opt, after_clip)
        embedding = nn.Embedding(10, 4)
        opt = zk.ShardedFusedAdam(
            embedding, lr=1e-3, stage=3, process_group=group, stage3_param_persistence_threshold=0
        )

        def written_in_forward() -> None:
            embedding.max_norm = 1.0 if rank >= 2 else None  # renormalises the rows it looks up, in place
            embedding(torch.arange(6)).square().sum().backward()

        return failures + _refused_on_the_second_rank(rank, opt, written_in_forward)


@pytest.mark.distributed
def test_a_step_refusal_on_a_device_meshs_data_parallel_group_names_the_global_rank() -> None:
    run_ranks_checked(_mesh_step_refusals, 4)
