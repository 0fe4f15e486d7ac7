"""``torch.distributed.checkpoint`` (DCP) with ``ShardedFusedAdam``: its ``get_state_dict`` / ``set_state_dict``
(which key the optimizer state by parameter FQN) and ``dcp.save`` / ``dcp.load``. Where a rank holds the whole
state (one rank, or stage 0), and where DCP's helpers get the whole state from ``state_dict()`` (stages 1-3 on
several ranks), a run resumed this way continues bit for bit as the uninterrupted one (at stage 3 inside
``gathered_params()``, where the model's state_dict holds its parameters).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import zero_kernels.optim as zo
from tests.helpers.dist import run_ranks_checked
from tests.helpers.lockstep import BUCKET, LR, ROWS, Net, batch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _train(model: Net, opt: zo.ShardedFusedAdam, steps: range) -> None:
    for step in steps:
        model(batch(step, ROWS), (0, ROWS)).backward()
        opt.step()
        opt.zero_grad()


def _fresh(stage: int) -> tuple[Net, zo.ShardedFusedAdam]:
    torch.manual_seed(1)
    model = Net()
    return model, zo.ShardedFusedAdam(model, lr=0.5, weight_decay=0.1, stage=stage, reduce_bucket_size=BUCKET)


def _whole(opt: zo.ShardedFusedAdam, stage: int) -> contextlib.AbstractContextManager:
    """Where the model's state_dict holds every parameter: inside ``gathered_params()`` at stage 3."""
    return opt.gathered_params() if stage == 3 else contextlib.nullcontext()


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_one_rank_resumes_bit_for_bit_through_dcp(stage: int, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = zo.ShardedFusedAdam(model, lr=LR, weight_decay=0.1, stage=stage, reduce_bucket_size=BUCKET)
    _train(model, opt, range(3))
    with _whole(opt, stage):
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path)
    _train(model, opt, range(3, 6))

    again, opt2 = _fresh(stage)
    with _whole(opt2, stage):
        model_sd, optim_sd = get_state_dict(again, opt2)
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=tmp_path)
        set_state_dict(again, opt2, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    assert opt2.param_groups[0]["lr"] == LR, "the saved param groups are loaded"
    _train(again, opt2, range(3, 6))
    with _whole(opt, stage), _whole(opt2, stage):
        for (name, p), q in zip(model.named_parameters(), again.parameters()):
            assert torch.equal(p, q), f"stage {stage}: {name} differs from the uninterrupted run"
    theirs = opt2.full_state_dict()["state"]
    for index, entry in opt.full_state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(theirs[index][key])), f"state[{index}] {key}"


def _named_shard_body(rank: int, world: int, stage: int) -> list[str]:
    """A sharded ``state_dict()`` keyed by names (as if DCP had keyed it) is refused, nothing changed."""
    torch.manual_seed(0)
    model = Net()
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=BUCKET)
    _train(model, opt, range(2))
    own = opt.state_dict()
    problems = []
    named = {**own, "state": {f"buffer{i}": v for i, v in own["state"].items()}}
    try:
        opt.load_state_dict(named)
        problems.append(f"stage {stage}: a sharded state keyed by names was accepted")
    except ValueError as err:
        if "keyed by flat-buffer index" not in str(err):
            problems.append(f"unclear refusal: {err}")
    after = opt.state_dict()["state"]
    problems += [
        f"state {i} changed" for i in own["state"] if not torch.equal(own["state"][i]["exp_avg"], after[i]["exp_avg"])
    ]
    return problems


@pytest.mark.distributed
def test_a_sharded_state_keyed_by_names_is_refused(tmp_path: Path) -> None:
    run_ranks_checked(_named_shard_body, 2, 2)


def _accumulate(model: Net, opt: zo.ShardedFusedAdam, steps: range, rank: int) -> None:
    for step in steps:
        for micro in range(opt.gradient_accumulation_steps):
            model(batch(10 * step + micro + 100 * rank, ROWS), (0, ROWS)).backward()
            opt.step()
            opt.zero_grad()


def _dcp_accumulation_body(rank: int, world: int, stage: int, folder: str, flatten: bool = False) -> list[str]:
    """Train, save through DCP, train on; a fresh optimizer loaded through DCP trains on to the same weights
    (``flatten``: with ``flatten_optimizer_state_dict``, torchtitan's setting)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)

    def build() -> tuple[Net, zo.ShardedFusedAdam]:
        torch.manual_seed(0)
        model = Net()
        opt = zo.ShardedFusedAdam(model, lr=LR, weight_decay=0.1, stage=stage, reduce_bucket_size=BUCKET,
                                  gradient_accumulation_steps=2)  # fmt: skip
        return model, opt

    model, opt = build()
    _accumulate(model, opt, range(3), rank)
    with _whole(opt, stage):
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    _accumulate(model, opt, range(3, 5), rank)
    again, opt2 = build()
    with _whole(opt2, stage):
        model_sd, optim_sd = get_state_dict(again, opt2, options=options)
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=folder)
        set_state_dict(again, opt2, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"], options=options)
    problems = [] if opt2.micro_step == 0 else [f"stage {stage}: the load left micro-step {opt2.micro_step}"]
    _accumulate(again, opt2, range(3, 5), rank)
    with _whole(opt, stage), _whole(opt2, stage):
        for (name, p), q in zip(model.named_parameters(), again.parameters()):
            if not torch.equal(p, q):
                problems.append(f"stage {stage} rank {rank}: {name} differs by {(p - q).abs().max().item():.3g}")
    return problems


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_dcp_resumes_bit_for_bit_with_gradient_accumulation(stage: int, tmp_path: Path) -> None:
    """DCP's ``get_state_dict`` on a fresh optimizer makes its state with one ``step()`` on zero gradients at lr 0
    (torch's ``_init_optim_state``). With ``gradient_accumulation_steps`` that call was a micro-step: no state was
    made, so the load brought none (the resumed run restarted Adam, 3e-2 off), and the window was one short."""
    assert _dcp_accumulation_body(0, 1, stage, str(tmp_path)) == []


@pytest.mark.distributed
@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dcp_resumes_bit_for_bit_with_gradient_accumulation_on_two_ranks(
    stage: int, flatten: bool, tmp_path: Path
) -> None:
    """Stages 1-3 on several ranks: DCP asks ``state_dict()`` for the whole state (``optim.dcp``); as this rank's
    shard, DCP saved one rank's copy and the load failed ("Missing optimizer state"). Flattened, DCP's loader takes
    the keys of ``opt.state[p]``, given for parameters another rank holds (one rank raised, the other hung)."""
    run_ranks_checked(_dcp_accumulation_body, 2, stage, str(tmp_path), flatten)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_first_micro_step_at_lr_0_after_a_backward_is_still_a_micro_step(stage: int) -> None:
    """A schedule starting at lr 0 (DeepSpeed's ``WarmupLR``) makes the first ``step()`` of a window look like DCP's
    state-making call but for the backward before it: it stays a micro-step."""
    torch.manual_seed(0)
    model = Net()
    opt = zo.ShardedFusedAdam(model, lr=0.0, stage=stage, reduce_bucket_size=BUCKET, gradient_accumulation_steps=2)
    model(batch(0, ROWS), (0, ROWS)).backward()
    opt.step()
    assert opt.micro_step == 1 and opt.applied_steps == 0


def _qwz_body(rank: int, world: int, stage: int, dtype: torch.dtype, folder: str) -> list[str]:
    """qwZ at stages 1-2: outside ``gathered_params()`` each rank holds the other ranks' parameters dequantized, and
    the model's state_dict with them: DCP's helpers are refused there; inside the block the run resumes bit for bit."""

    def build() -> tuple[Net, zo.ShardedFusedAdam]:
        torch.manual_seed(0)
        model = Net().to(dtype)
        opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=BUCKET, zero_quantized_weights=True)
        return model, opt

    def train(model: Net, opt: zo.ShardedFusedAdam, steps: range) -> None:
        for step in steps:
            model(batch(step + 100 * rank, ROWS).to(dtype), (0, ROWS)).backward()
            opt.step()
            opt.zero_grad()

    problems = []
    model, opt = build()
    train(model, opt, range(2))
    try:
        get_state_dict(model, opt)
        problems.append(f"stage {stage} {dtype}: get_state_dict outside gathered_params() was taken")
    except ValueError as err:
        if "gathered_params()" not in str(err):
            problems.append(f"unclear refusal: {err}")
    with opt.gathered_params():
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    train(model, opt, range(2, 4))
    again, opt2 = build()
    with opt2.gathered_params():
        model_sd, optim_sd = get_state_dict(again, opt2)
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=folder)
        set_state_dict(again, opt2, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    train(again, opt2, range(2, 4))
    with opt.gathered_params(), opt2.gathered_params():
        for (name, p), q in zip(model.named_parameters(), again.parameters()):
            if not torch.equal(p, q):
                problems.append(f"stage {stage} {dtype}: {name} differs by {(p - q).abs().max().item():.3g}")
    return problems


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stage", [1, 2])
def test_dcp_with_quantized_weights_below_stage_3_is_taken_inside_gathered_params(
    stage: int, dtype: torch.dtype, tmp_path: Path
) -> None:
    """DCP's ``get_state_dict`` outside the block took the model's parameters as rank 0 held them, the other ranks'
    parts dequantized, and the load wrote them into the weights (2e-3 apart at the load, fp32 and bf16)."""
    run_ranks_checked(_qwz_body, 2, stage, dtype, str(tmp_path))


def _stateless_rank_body(rank: int, world: int, stage: int, folder: str) -> list[str]:
    """A model too small for every rank to hold some of its state: DCP's ``get_state_dict`` asks ``opt.state``
    whether there is a state to make, and each rank must answer alike."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage)
    problems = [] if len(opt.state) == 0 else ["the model is not small enough"]

    def train(steps: range) -> None:
        for step in steps:
            model(torch.full((1, 2), float(step + rank))).square().sum().backward()
            opt.step()
            opt.zero_grad()

    train(range(2))
    if rank == world - 1 and len(opt.state):
        problems.append(f"rank {rank} holds state: nothing is tested")
    with _whole(opt, stage):
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    if opt.applied_steps != 2:
        problems.append(f"get_state_dict stepped: {opt.applied_steps} steps applied")
    train(range(2, 3))
    return problems


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 3])
def test_dcp_with_a_rank_that_holds_no_state(stage: int, tmp_path: Path) -> None:
    """A rank holding no parameter's state had an empty ``opt.state``: DCP's ``_init_optim_state`` stepped the
    optimizer there alone, and the ranks hung at the next collective."""
    run_ranks_checked(_stateless_rank_body, 3, stage, str(tmp_path), timeout_s=60)


def _after_consolidate_body(rank: int, world: int, stage: int) -> list[str]:
    """``consolidate_state_dict(to=0)`` keeps the whole state on rank 0 for its ``state_dict()``; DCP's helpers, asked
    before the next step, must still take the whole state on every rank alike (rank 0 took the kept one, the other
    ranks gathered it: a collective on one side only, and the ranks failed or hung in the next one)."""
    model, opt = _fresh(stage)
    _train(model, opt, range(2))
    opt.consolidate_state_dict(to=0)
    with _whole(opt, stage):
        _, optim_sd = get_state_dict(model, opt)
    full = opt.full_state_dict()
    problems = []
    names = [name for name, _ in model.named_parameters()]
    for index, entry in full["state"].items():
        got = optim_sd["state"][names[index]]
        for key in ("exp_avg", "exp_avg_sq"):
            if not torch.equal(got[key], entry[key]):
                problems.append(f"rank {rank}: {names[index]} {key} differs from full_state_dict()'s")
    if rank == 0 and len(opt.state_dict()["state"]) != len(full["state"]):
        problems.append("rank 0's state_dict() is no longer the consolidated state")
    return problems


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 3])
def test_dcp_after_consolidate_state_dict_takes_the_whole_state_on_every_rank(stage: int) -> None:
    run_ranks_checked(_after_consolidate_body, 2, stage, timeout_s=60)
