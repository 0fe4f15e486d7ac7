"""``deepspeed.initialize``'s call forms: the config from ``args``/``config_params`` with DeepSpeed's precedence and
conflicts, ``lr_scheduler=`` as a callable, and the arguments not taken refused naming what to do instead.
"""

from __future__ import annotations

import copy
import json
import os
import types
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import StepLR

import zero_kernels as zk
from tests.helpers.dist import free_port
from tests.helpers.lockstep import step_beside_adamw
from zero_kernels.config.call_forms import LAUNCHER_ENV


def _config(lr: float = 1e-2, **extra: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": lr}},
        "zero_optimization": {"stage": 2},
        **extra,
    }


def _lr(result: tuple) -> float:
    return result[1].param_groups[0]["lr"]


def test_the_config_comes_from_args_or_config_params(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_config(lr=0.25)))
    assert _lr(zk.initialize(model=nn.Linear(4, 2), args=types.SimpleNamespace(deepspeed_config=str(path)))) == 0.25
    old = types.SimpleNamespace(deepscale_config=str(path), deepspeed_config=None)
    assert _lr(zk.initialize(nn.Linear(4, 2), args=old)) == 0.25
    assert _lr(zk.initialize(nn.Linear(4, 2), config_params=_config(lr=0.5))) == 0.5
    unset = types.SimpleNamespace(deepspeed_config=None, local_rank=0)
    assert _lr(zk.initialize(nn.Linear(4, 2), _config(lr=0.75), args=unset)) == 0.75


@pytest.mark.parametrize(
    "call, match",
    [
        (dict(config=_config(), config_params=_config()), "both config= and config_params="),
        (dict(config=_config(), args=types.SimpleNamespace(deepspeed_config="a.json")), "both in args.deepspeed"),
        (dict(config_params=_config(), args=types.SimpleNamespace(deepspeed_config="a.json")), "both in args"),
        (dict(args=types.SimpleNamespace(deepspeed_config="a.json", deepscale_config="b.json")), "deepscale_config"),
        (dict(args=types.SimpleNamespace(local_rank=0)), "no config: pass config="),
        ({}, "no config: pass config="),
    ],
    ids=["config+config_params", "config+args", "config_params+args", "both-args-fields", "args-without", "none"],
)
def test_config_conflicts_are_refused_as_deepspeed_refuses_them(call: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        zk.initialize(nn.Linear(4, 2), **call)


def _lrs_per_micro_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: StepLR) -> list[float]:
    lrs = []
    for _ in range(6):
        model(torch.randn(2, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def test_a_scheduler_callable_steps_at_updates_as_the_config_section() -> None:
    model, optimizer, scheduler = zk.initialize(
        nn.Linear(4, 2), _config(), lr_scheduler=lambda opt: StepLR(opt, step_size=1, gamma=0.5)
    )
    assert isinstance(scheduler, StepLR) and scheduler.optimizer is optimizer
    section = {"scheduler": {"type": "StepLR", "params": {"step_size": 1, "gamma": 0.5}}}
    expected = _lrs_per_micro_step(*zk.initialize(nn.Linear(4, 2), _config(**section)))
    assert _lrs_per_micro_step(model, optimizer, scheduler) == expected == [1e-2, 5e-3, 5e-3, 2.5e-3, 2.5e-3, 1.25e-3]


def test_a_scheduler_object_or_a_second_scheduler_is_refused() -> None:
    opt = torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=1.0)
    with pytest.raises(ValueError, match=r"lr_scheduler= a scheduler object \(StepLR\) is not taken.*callable"):
        zk.initialize(nn.Linear(4, 2), _config(), lr_scheduler=StepLR(opt, 1))
    section = {"scheduler": {"type": "StepLR", "params": {"step_size": 1}}}
    with pytest.raises(ValueError, match='lr_scheduler= was given and the config has a "scheduler" section'):
        zk.initialize(nn.Linear(4, 2), _config(**section), lr_scheduler=lambda o: StepLR(o, 1))
    with pytest.raises(ValueError, match=r"lr_scheduler\(optimizer\) returned StepLR: expected .* built on the opt"):
        zk.initialize(nn.Linear(4, 2), _config(), lr_scheduler=lambda o: StepLR(opt, 1))


@pytest.mark.parametrize(
    "name, instead",
    [
        ("training_data", "DistributedSampler"),
        ("training_data", "ZeroConfig.from_deepspeed(config, world_size=torch.distributed.get_world_size())"),
        ("collate_fn", "DataLoader"),
        ("mpu", "process_group="),
        ("mesh_param", "process_group="),
        ("distributed_port", "init_process_group"),
    ],
)
def test_deepspeed_arguments_not_taken_say_what_to_do_instead(name: str, instead: str) -> None:
    with pytest.raises(ValueError, match=rf"^initialize: {name}= \(deepspeed.initialize's\) is not taken: ") as err:
        zk.initialize(nn.Linear(4, 2), _config(), **{name: object()})
    assert instead in str(err.value) and "allowed" not in str(err.value)


def test_distributed_port_names_the_environment_the_group_is_made_from() -> None:
    """initialize makes the process group from the launcher's environment where none exists (dist_init_required), so
    the port is MASTER_PORT's; the message said initialize does not create the process group."""
    with pytest.raises(ValueError, match="distributed_port=") as err:
        zk.initialize(nn.Linear(4, 2), _config(), distributed_port=29500)
    assert "MASTER_PORT" in str(err.value) and "does not create" not in str(err.value)


def test_deepspeed_arguments_given_as_none_are_taken() -> None:
    """None is their default in deepspeed.initialize, and scripts pass it explicitly (``mpu=... if ... else None``)."""
    none = {name: None for name in ("optimizer", "training_data", "collate_fn", "mpu", "mesh_param")}
    model, opt = zk.initialize(nn.Linear(4, 2), _config(), **none)
    assert isinstance(opt, zk.ShardedFusedAdam) and _lr((model, opt)) == 1e-2


def test_dist_init_required_without_a_launcher_creates_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    for required in (None, False):
        assert len(zk.initialize(nn.Linear(4, 2), _config(), dist_init_required=required)) == 2
        assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match=r"dist_init_required=True, no process group and no launcher's environment "):
        zk.initialize(nn.Linear(4, 2), _config(), dist_init_required=True)
    with pytest.raises(ValueError, match="dist_init_required='yes' is invalid: expected True, False or None"):
        zk.initialize(nn.Linear(4, 2), _config(), dist_init_required="yes")


def test_args_local_rank_is_the_launchers_as_deepspeed_sets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a script parsing --local_rank (default -1) under torchrun, which passes none, kept -1 after initialize on
    every rank, where deepspeed.initialize sets it to LOCAL_RANK (``if args.local_rank == 0: save`` saved nowhere)."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    args = types.SimpleNamespace(deepspeed_config=None, local_rank=-1)
    zk.initialize(nn.Linear(4, 2), _config(), args=args)
    assert args.local_rank == 1
    with pytest.raises(ValueError, match=r"args.local_rank is 0 but the launcher.s LOCAL_RANK is 1 \(DeepSpeed"):
        zk.initialize(nn.Linear(4, 2), _config(), args=types.SimpleNamespace(local_rank=0))
    monkeypatch.delenv("LOCAL_RANK")
    alone = types.SimpleNamespace(deepspeed_config=None, local_rank=-1)
    zk.initialize(nn.Linear(4, 2), _config(), args=alone)
    assert alone.local_rank == -1  # no launcher: left as the script has it


def test_args_local_rank_parsed_as_a_string_is_compared_as_its_number(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ``--local_rank`` parsed without ``type=int`` (a string, ``--local_rank=1`` from a launcher) failed
    initialize with 'TypeError: '>=' not supported between str and int'; it is compared as its number and keeps its
    type, as the script parsed it."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    for given in ("1", "-1"):
        args = types.SimpleNamespace(deepspeed_config=None, local_rank=given)
        zk.initialize(nn.Linear(4, 2), _config(), args=args)
        assert args.local_rank == "1", given
    with pytest.raises(ValueError, match=r"args.local_rank is '0' but the launcher.s LOCAL_RANK is 1"):
        zk.initialize(nn.Linear(4, 2), _config(), args=types.SimpleNamespace(local_rank="0"))


def _launched_without_a_group(rank: int, world: int, port: int, required) -> None:
    """A script written for deepspeed.initialize under torchrun: no init_process_group of its own."""
    torch.distributed.destroy_process_group()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_PORT=str(port))
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    reference = copy.deepcopy(model)
    model, opt = zk.initialize(model, _config(gradient_accumulation_steps=1), dist_init_required=required)
    assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == world
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    for _ in range(2):
        step_beside_adamw(model, opt, reference, adamw, xs, rank)
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize("required", [None, True])
def test_initialize_under_a_launcher_creates_the_process_group_as_deepspeed(spawn, required) -> None:
    """Each process alone (world size 1) before: the gradients were never averaged, the weights differed by rank."""
    spawn(_launched_without_a_group, 2, free_port(), required)


def _zero_config_built_before_the_group(rank: int, world: int, port: int) -> None:
    """A ZeroConfig built before initialize created the group was derived for world size 1 (accumulation 2 for
    train_batch_size 8 of micro-batches of 4, where DeepSpeed derives 1 at 2 ranks): refused, not trained on."""
    torch.distributed.destroy_process_group()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_PORT=str(port))
    ds = {key: value for key, value in _config().items() if key != "gradient_accumulation_steps"}
    ds.update(train_batch_size=8, train_micro_batch_size_per_gpu=4)
    config = zk.ZeroConfig.from_deepspeed(ds)
    assert config.world_size == 1 and config.gradient_accumulation_steps == 2
    with pytest.raises(ValueError, match=r"^initialize: this ZeroConfig was built for world_size=1 .* has 2 ranks"):
        zk.initialize(nn.Linear(4, 2), config)
    assert torch.distributed.get_world_size() == world
    _, opt = zk.initialize(nn.Linear(4, 2), zk.ZeroConfig.from_deepspeed(ds))  # built for the group: taken
    assert opt.gradient_accumulation_steps == 1


@pytest.mark.distributed
def test_a_zero_config_built_for_another_world_size_is_refused(spawn) -> None:
    """Before: trained with the world-size-1 accumulation under the 2-rank group initialize created, silently."""
    spawn(_zero_config_built_before_the_group, 2, free_port())


def test_world_size_is_refused_by_initialize_and_suggested_for_a_misspelling() -> None:
    with pytest.raises(ValueError, match=r"^initialize: world_size= is not taken: the data-parallel size is process_"):
        zk.initialize(nn.Linear(4, 2), _config(), world_size=1)
    with pytest.raises(ValueError, match=r"unknown keyword 'wrld_size'; did you mean 'world_size'\?") as err:
        zk.initialize(nn.Linear(4, 2), _config(), wrld_size=1)
    assert "allowed: world_size" not in str(err.value)
    assert zk.ZeroConfig.from_deepspeed(_config(), world_size=2).train_batch_size == 8


def _rank_dependent_init(rank: int, world: int) -> None:
    """DeepSpeed's ``TestZero3ParamPartitioningLargeParam`` / ``TestZero3InitForParentWeightInitialization``: a model
    initialised differently on each rank (its own seed; a weight filled on rank 0 only, one whose rows are in another
    order on rank 1) trains from rank 0's values,
    as ``deepspeed.initialize`` broadcasts them, at every stage (it was refused: "different values on some rank")."""
    from tests.helpers.lockstep import ROWS, Net, batch, compare, extra_rows, local

    for stage in (0, 1, 2, 3):
        torch.manual_seed(rank if stage % 2 else 0)
        model = Net()
        with torch.no_grad():
            if rank == 0:
                model.head.bias.fill_(0.5)
            elif stage % 2 == 0:  # rank 0's values in another order: a plain sum of them cannot tell
                model.mid.weight.copy_(model.mid.weight.flip(0))
        torch.manual_seed(0)
        ref = Net()
        with torch.no_grad():
            ref.head.bias.fill_(0.5)
        cfg = {
            "train_micro_batch_size_per_gpu": ROWS,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        model, opt = zk.initialize(model, cfg)
        ropt = torch.optim.AdamW(
            [p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0
        )  # DeepSpeed's
        for step in range(2):
            x, span = batch(step, world * ROWS), extra_rows(step, world)
            model(x[rank * ROWS : (rank + 1) * ROWS], local(span, rank, stage)).backward()
            ref(x, span).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
            for o in (opt, ropt):
                o.step()
                o.zero_grad()
        with opt.gathered_params():
            compare(model, ref, f"stage {stage}")


@pytest.mark.distributed
def test_parameters_that_differ_across_ranks_start_from_rank_0s_as_deepspeed_broadcasts_them() -> None:
    from tests.helpers.dist import run_ranks

    run_ranks(_rank_dependent_init, 2)


def _meta_model(rank: int, world: int) -> None:
    """A model on the meta device given to ``initialize`` on 2 ranks is refused as ``ShardedFusedAdam`` refuses it
    (naming the parameter and ``to_empty``), not by the broadcast of differing values reading its sizes ("Tensor.item()
    cannot be called on meta tensors")."""
    for stage in (0, 3):
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
        with pytest.raises(ValueError, match=r"parameter '0\.weight' is on the meta device.*to_empty"):
            zk.initialize(model, _config(zero_optimization={"stage": stage}))


@pytest.mark.distributed
def test_a_model_on_the_meta_device_is_refused_naming_its_parameter() -> None:
    from tests.helpers.dist import run_ranks

    run_ranks(_meta_model, 2)
