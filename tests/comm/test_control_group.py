"""The control group (host data off the device's queue): one per process group, made at the first host exchange,
shared by every optimizer and copy on that group, destroyed with the process group.

On NCCL the step's host data goes over a gloo group of the same ranks (``zero_kernels.control``).
Here the data groups are gloo, so the tests clear ``control.HOST_BACKENDS``: gloo engines then get a
control group of their own, as NCCL ones do. ``dist.new_group`` and ``dist.destroy_process_group``
are spied on; a copy made by one rank alone must not communicate at all (every collective raises
while it is made: the other rank is not there to answer).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import pickle
import sys
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_kernels as zk
from tests.helpers.dist import run_ranks_checked, watchdog
from zero_kernels import comm, control


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _optimizer(model: nn.Module, stage: int = 2, group: Any = None) -> zk.ShardedFusedAdam:
    return zk.ShardedFusedAdam(model, lr=1e-2, stage=stage, reduce_bucket_size=64, process_group=group)


def _step(model: nn.Module, opt: zk.ShardedFusedAdam, rank: int) -> None:
    model(torch.full((3, 6), float(rank + 1))).square().mean().backward()
    opt.step()
    opt.zero_grad()


@contextlib.contextmanager
def _no_communication() -> Iterator[None]:
    """Every collective (and making a group) raises inside."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("communicated")

    saved: list[tuple[Any, str, Callable]] = [(dist, "new_group", dist.new_group)]
    for engine in (comm.TorchCommEngine, comm.CppCommEngine):
        saved += [(engine, name, getattr(engine, name)) for name in ("all_reduce", "all_gather", "reduce_scatter")]
    for owner, name, _ in saved:
        setattr(owner, name, refuse)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _body(rank: int, world: int) -> list[str]:
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            failures.append(f"rank {rank}: {what}")

    made: list[Any] = []  # control groups made (groups the test makes itself are not counted)
    destroyed: list[Any] = []  # control groups destroyed
    new_group, destroy = dist.new_group, dist.destroy_process_group

    def spy_new_group(*args: Any, **kwargs: Any) -> Any:
        group = new_group(*args, **kwargs)
        if sys._getframe(1).f_globals["__name__"] == control.__name__:
            made.append(group)
        return group

    def spy_destroy(group: Any = None) -> None:
        destroyed.extend(g for g in made if g is group)  # holding the data group would keep it alive
        destroy(group)

    dist.new_group, dist.destroy_process_group = spy_new_group, spy_destroy
    host_backends, control.HOST_BACKENDS = control.HOST_BACKENDS, frozenset()
    try:
        data = dist.new_group([0, 1])  # the optimizers' process group
        model = _model()
        opt = _optimizer(model, group=data)
        check(not made, "building the optimizer made a group")
        _step(model, opt, rank)
        check(len(made) == 1, f"{len(made)} groups after the first step (one expected)")
        shared = opt.pipeline._control
        check(shared.group is made[0] and shared is not opt.pipeline.engine, "the step's host data is not on it")

        other = _model()
        second = _optimizer(other, stage=1, group=data)
        _step(other, second, rank)
        check(len(made) == 1 and second.pipeline._control is shared, "a second optimizer made its own group")

        if rank == 0:  # rank 1 is not there to answer: a copy that communicated would raise
            with _no_communication():
                alone = copy.deepcopy(opt)
                alone_model, alone_opt = copy.deepcopy((model, second))
            check(len(made) == 1, "a copy made a group")
            del alone, alone_model, alone_opt
        dist.barrier()
        twin_model, twin = copy.deepcopy((model, opt))
        _step(twin_model, twin, rank)
        check(len(made) == 1 and twin.pipeline._control is shared, "a copy that steps made its own group")

        del opt, second, twin, twin_model
        if rank == 0:  # the optimizers go at different moments on different ranks (garbage collection)
            gc.collect()
        check(not destroyed, f"destroyed before its process group: {destroyed}")
        later = _optimizer(_model(), group=data)
        _step(later.pipeline.module, later, rank)
        check(len(made) == 1 and later.pipeline._control is shared, "a later optimizer made another group")
        mine = dist.new_group([0, 1], use_local_synchronization=True)  # the ranks still name new groups alike
        dist.all_reduce(torch.ones(1), group=mine)

        world_model = _model()
        on_world = _optimizer(world_model)  # the default group: a control group of its own
        _step(world_model, on_world, rank)
        check(len(made) == 2 and on_world.pipeline._control is not shared, "the default group shared another's")
        if rank == 0:
            with _no_communication():
                loaded_model, loaded = pickle.loads(pickle.dumps((world_model, on_world)))
            check(len(made) == 2, "unpickling made a group")
            del loaded_model, loaded
        dist.barrier()

        del later, shared
        dist.destroy_process_group(data)
        del data
        gc.collect()
        check(made[0] in destroyed, "the control group outlived its process group")
    finally:
        dist.new_group, dist.destroy_process_group = new_group, destroy
        control.HOST_BACKENDS = host_backends
    return failures


@pytest.mark.distributed
def test_one_control_group_per_process_group_made_lazily_shared_and_destroyed_with_it() -> None:
    run_ranks_checked(_body, 2, timeout_s=120)


def _host_data_at_construction(rank: int, world: int) -> list[str]:
    """An NCCL engine bound to no device (Accelerate's ``init_process_group`` binds none): the offload tiers'
    start-up agreement and qgZ's node grid are host data and go over the control group, needing no device."""
    import zero_kernels.kernels as codec
    from zero_kernels.comm.quantized import QuantizedReduceScatter
    from zero_kernels.stages import offloaded

    engine = comm.TorchCommEngine()
    engine.backend = "nccl"  # what routes host data off the device; every collective below runs on gloo
    failures = []
    try:
        offloaded.agree(engine, None, "offload.start")
        QuantizedReduceScatter(engine, codec)
    except ValueError as err:
        failures.append(f"rank {rank}: {err}")
    try:
        offloaded.agree(engine, "disk full" if rank == 1 else None, "offload.start")
        failures.append(f"rank {rank}: a rank's problem was not raised")
    except OSError as err:
        if "rank 1: disk full" not in str(err):
            failures.append(f"rank {rank}: {err}")
    return failures


@pytest.mark.distributed
def test_host_data_of_construction_needs_no_device_on_nccl() -> None:
    run_ranks_checked(_host_data_at_construction, 2)


def _world_after_a_group_of_some_ranks(rank: int, world: int) -> list[str]:
    """Rank 0 is no member of a group made before (torch registers it on ranks 1 and 2 only, and names a group made
    with ``use_local_synchronization`` by the count of groups this rank registered): the default group's control
    group, made by every rank, must get one name on every rank (it got two, and building the optimizer hung in
    gloo's rendezvous). A watchdog ends a rank that waits 60 s."""
    host_backends, control.HOST_BACKENDS = control.HOST_BACKENDS, frozenset()
    try:
        with watchdog(60):
            dist.new_group([1, 2])
            model = _model()
            opt = _optimizer(model)
            _step(model, opt, rank)
        made = opt.pipeline._control
        return [] if made.group is not None else [f"rank {rank}: no control group"]
    finally:
        control.HOST_BACKENDS = host_backends


@pytest.mark.distributed
def test_the_default_groups_control_group_is_made_after_a_group_of_some_ranks() -> None:
    run_ranks_checked(_world_after_a_group_of_some_ranks, 3)


def _group_out_of_order(rank: int, world: int) -> list[str]:
    """A process group whose ranks are not in the world's order (``new_group([2, 0], sort_ranks=False)``: its rank 0
    is global rank 2): its control group must number the ranks as it does. Sorted, it made global rank 0 its rank 0,
    so host data came back in another order than the data group's ranks (an offload failure on the group's rank 1
    was said to be rank 0's)."""
    from zero_kernels.stages import offloaded

    group = dist.new_group([2, 0], sort_ranks=False)
    if rank == 1:
        return []
    host_backends, control.HOST_BACKENDS = control.HOST_BACKENDS, frozenset()
    try:
        engine = comm.TorchCommEngine(group)
        failures = []
        if control.ControlLink(engine).get().rank != engine.rank:
            failures.append(f"rank {rank}: the control group numbers it {control.ControlLink(engine).get().rank}")
        try:
            offloaded.agree(engine, "disk full" if engine.rank == 1 else None, "offload.start")
            failures.append(f"rank {rank}: the problem was not raised")
        except OSError as err:
            if "rank 1 (global rank 0): disk full" not in str(err):
                failures.append(f"rank {rank}: {err}")
        return failures
    finally:
        control.HOST_BACKENDS = host_backends


@pytest.mark.distributed
def test_the_control_group_numbers_the_ranks_as_its_process_group_does() -> None:
    run_ranks_checked(_group_out_of_order, 3)
