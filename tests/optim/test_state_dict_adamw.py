"""``opt.state_dict()`` where a rank holds the whole state (one rank at any stage, stage 0 on any number
of ranks) is ``torch.optim.AdamW``'s layout: AdamW loads it and continues element by element as the
optimizer that saved it, and it loads back into ``ShardedFusedAdam`` at any stage (with the fp32
master of bf16 parameters, so a bf16 run resumes bit for bit). A state saved in the other weight-decay
mode (``torch.optim.Adam``'s L2 decay) with a non-zero ``weight_decay`` loads with one WARNING naming both.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import zero_kernels.optim as zo
from tests.helpers.check import assert_close
from tests.helpers.dist import run_ranks_checked
from tests.helpers.lockstep import BUCKET, LR, ROWS, STAGES, WORLD_SIZES, Net, batch, compare, make_models


def groups(m: Net) -> list[dict]:
    return [
        {"params": [m.emb.weight, m.tiny, m.mid.bias], "amsgrad": True},
        {"params": [m.emb.bias, m.mid.weight, m.frozen, m.extra.weight, m.extra.bias, m.head.weight, m.head.bias]},
    ]


def _step(model: Net, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x, (0, x.shape[0])).backward()
    opt.step()
    opt.zero_grad()


def _continue_with_adamw(rank: int, world: int, stage: int) -> None:
    """Ours trains on this rank's rows; AdamW loads our state_dict() and continues on the whole batch."""
    model, _ = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(groups(model), lr=LR, stage=stage, reduce_bucket_size=BUCKET, module=model)
    for step in range(3):
        _step(model, opt, batch(step, world * ROWS)[rank * ROWS : (rank + 1) * ROWS])
    with opt.gathered_params():
        ref = copy.deepcopy(model)
    ropt = torch.optim.AdamW(groups(ref), lr=0.5)
    ropt.load_state_dict(opt.state_dict())
    assert ropt.param_groups[1]["lr"] == LR and ropt.param_groups[0]["amsgrad"], f"stage {stage}: groups"
    for step in range(3, 6):
        x = batch(step, world * ROWS)
        _step(model, opt, x[rank * ROWS : (rank + 1) * ROWS])
        _step(ref, ropt, x)
        with opt.gathered_params():
            compare(model, ref, f"stage {stage} world {world}: AdamW from state_dict(), step {step}")
    theirs = ropt.state_dict()["state"]
    for index, entry in opt.full_state_dict()["state"].items():
        assert float(entry["step"]) == float(theirs[index]["step"]), f"stage {stage}: state[{index}] step"
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in entry:
                scale = entry[key].abs().max().item()
                assert_close(theirs[index][key], entry[key], rtol=1e-5, atol=1e-6 * scale, what=f"[{index}] {key}")


@pytest.mark.parametrize("stage", STAGES)
def test_one_rank_state_dict_continues_in_adamw(stage: int) -> None:
    _continue_with_adamw(0, 1, stage)


def test_one_rank_bf16_state_dict_resumes_bit_for_bit_at_any_stage() -> None:
    model, _ = make_models(torch.bfloat16)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=1, reduce_bucket_size=BUCKET)
    for step in range(3):
        _step(model, opt, batch(step, ROWS, torch.bfloat16))
    saved, weights = opt.state_dict(), copy.deepcopy(model.state_dict())
    assert all("master" in entry for entry in saved["state"].values()), "the fp32 master is in each entry"
    for step in range(3, 5):
        _step(model, opt, batch(step, ROWS, torch.bfloat16))
    for stage in STAGES:
        again = Net().to(torch.bfloat16)
        again.load_state_dict(weights)
        opt2 = zo.ShardedFusedAdam(again, lr=0.5, stage=stage, reduce_bucket_size=BUCKET + 4)
        opt2.load_state_dict(saved)
        for step in range(3, 5):
            _step(again, opt2, batch(step, ROWS, torch.bfloat16))
        with opt2.gathered_params():
            for (name, got), want in zip(again.named_parameters(), model.parameters()):
                assert torch.equal(got, want), f"bf16 state_dict() loaded at stage {stage}: {name} differs"


def _by_name(state_dict: dict, names: list[str]) -> dict:
    """``state_dict`` with each parameter index replaced by a name, as torch.distributed.checkpoint's
    set_state_dict hands it to ``load_state_dict`` (FQNs in the groups' params and as state keys)."""
    return {
        "state": {names[i]: v for i, v in state_dict["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state_dict["param_groups"]],
    }


@pytest.mark.parametrize("stage", [0, 1])
def test_a_state_dict_with_named_parameters_loads_as_in_adamw(stage: int) -> None:
    """Parameter ids that are not ints map through the saved groups' params, as AdamW maps them: both load the
    same renamed state and continue element by element alike (the names here run in another order than the
    parameters, so a key read as a position would load the wrong entry)."""
    model, ref = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(groups(model), lr=LR, stage=stage, reduce_bucket_size=BUCKET, module=model)
    for step in range(3):
        _step(model, opt, batch(step, ROWS))
    count = sum(len(g["params"]) for g in opt.param_groups)
    named = _by_name(opt.state_dict(), [f"p{count - i}" for i in range(count)])
    ref.load_state_dict(model.state_dict())
    again, _ = make_models(torch.float32)
    again.load_state_dict(model.state_dict())
    opt2 = zo.ShardedFusedAdam(groups(again), lr=0.5, stage=stage, reduce_bucket_size=BUCKET, module=again)
    opt2.load_state_dict(copy.deepcopy(named))
    ropt = torch.optim.AdamW(groups(ref), lr=0.5)
    ropt.load_state_dict(copy.deepcopy(named))
    assert all(isinstance(k, torch.Tensor) for k in opt2.state), "every entry is a parameter's"
    for step in range(3, 6):
        _step(again, opt2, batch(step, ROWS))
        _step(ref, ropt, batch(step, ROWS))
        compare(again, ref, f"stage {stage}: named state, step {step}")
    mine, theirs = opt2.state_dict()["state"], ropt.state_dict()["state"]
    for index, entry in theirs.items():
        assert float(mine[index]["step"]) == float(entry["step"]), f"stage {stage}: state[{index}] step"


def test_an_int_key_in_no_param_group_is_refused() -> None:
    model, _ = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=1)
    _step(model, opt, batch(0, ROWS))
    saved = opt.state_dict()
    saved["state"][99] = saved["state"][0]
    with pytest.raises(ValueError, match=r"state\[99\] is in no param group's 'params'"):
        opt.load_state_dict(saved)


def _decay_warnings(caplog: pytest.LogCaptureFixture, saved: dict, adam_w_mode: bool) -> list[str]:
    model, _ = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(groups(model), lr=LR, stage=1, adam_w_mode=adam_w_mode)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        opt.load_state_dict(copy.deepcopy(saved))
    return [r.getMessage() for r in caplog.records if "load_state_dict" in r.getMessage()]


def test_a_state_of_the_other_decay_mode_is_loaded_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """torch.optim.Adam's state (L2 decay) into AdamW mode, and DeepSpeed's adam_w_mode key: one WARNING naming
    both modes where weight_decay is non-zero; none where the modes agree or the decay is 0."""
    model, _ = make_models(torch.float32)
    adam = torch.optim.Adam(groups(model), lr=LR, weight_decay=0.1)
    _step(model, adam, batch(0, ROWS))
    saved = adam.state_dict()
    assert [g["decoupled_weight_decay"] for g in saved["param_groups"]] == [False, False]
    (message,) = _decay_warnings(caplog, saved, adam_w_mode=True)
    assert "param group 0 was saved with L2 weight decay added to the gradient (Adam" in message, message
    assert "weight_decay=0.1; this optimizer keeps its own mode, decoupled weight decay (AdamW" in message, message
    assert "adam_w_mode=False" in message, message
    assert _decay_warnings(caplog, saved, adam_w_mode=False) == []
    deepspeed = copy.deepcopy(saved)
    for group in deepspeed["param_groups"]:
        group["adam_w_mode"] = group.pop("decoupled_weight_decay")
    assert len(_decay_warnings(caplog, deepspeed, adam_w_mode=True)) == 1
    for group in saved["param_groups"]:
        group["weight_decay"] = 0.0
    assert _decay_warnings(caplog, saved, adam_w_mode=True) == []


def _stage0_body(rank: int, world: int) -> list[str]:
    try:
        _continue_with_adamw(rank, world, 0)
    except AssertionError as err:
        return [str(err)]
    return []


@pytest.mark.distributed
@pytest.mark.parametrize("world", [w for w in WORLD_SIZES if w > 1], ids=lambda w: f"world{w}")
def test_stage0_state_dict_continues_in_adamw_on_every_rank(world: int) -> None:
    run_ranks_checked(_stage0_body, world)


def _foreign_shard_body(rank: int, world: int, stage: int) -> list[str]:
    """Rank 0's sharded state dict, sent to every rank (as a file one rank writes for all): refused on the other
    ranks, naming both ranks and how to save from one rank, with the state left as it was; each rank's own loads."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Net()
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=BUCKET)
    _step(model, opt, batch(0, ROWS))
    own = opt.state_dict()
    box = [own]
    dist.broadcast_object_list(box, src=0)
    problems = []
    if rank == 0:
        opt.load_state_dict(box[0])
        return problems
    try:
        opt.load_state_dict(box[0])
        problems.append(f"rank {rank} loaded rank 0's shard")
    except ValueError as err:
        said = ("rank 0's shard, and this is rank 1", "consolidate_state_dict(to=0) on every rank")
        if rank == 1 and not all(part in str(err) for part in said):
            problems.append(f"unclear refusal: {err}")
    after = opt.state_dict()["state"]
    for key, entry in own["state"].items():
        for name, t in entry.items() if isinstance(entry, dict) else ():
            if isinstance(t, torch.Tensor) and not torch.equal(t, after[key][name]):
                problems.append(f"state {key}/{name} changed by the refused load")
    opt.load_state_dict(own)
    return problems


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_sharded_state_dict_loads_only_on_the_rank_that_saved_it(stage: int) -> None:
    run_ranks_checked(_foreign_shard_body, 2, stage)


@pytest.mark.parametrize("stage", STAGES)
def test_the_state_of_a_parameter_frozen_since_is_left_out_with_a_warning(
    stage: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A run resumed with a layer frozen since the state was saved: AdamW loads the state and never uses the frozen
    layer's; so does this optimizer, which leaves it out (one WARNING), and both continue alike."""
    model, ref = make_models(torch.float32)
    saved_by = torch.optim.AdamW(ref.parameters(), lr=LR)
    _step(ref, saved_by, batch(0, ROWS))
    saved = saved_by.state_dict()
    with torch.no_grad():
        for p, r in zip(model.parameters(), ref.parameters()):
            p.copy_(r)
    for m in (model, ref):
        m.emb.requires_grad_(False)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    ropt.load_state_dict(saved)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=BUCKET)
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        opt.load_state_dict(saved)
    said = [r.getMessage() for r in caplog.records if "frozen here" in r.getMessage()]
    assert len(said) == 1 and "the state of 2 parameter(s)" in said[0] and "emb.weight" in said[0], said
    for step in range(1, 3):
        _step(model, opt, batch(step, ROWS))
        _step(ref, ropt, batch(step, ROWS))
        with opt.gathered_params():
            compare(model, ref, f"stage {stage} step {step}")


def _tensors(opt: zo.ShardedFusedAdam) -> list[torch.Tensor]:
    state = opt.state_dict()
    values = [float(g["lr"]) for g in state["param_groups"]]
    return [torch.tensor(values)] + [t for e in state["state"].values() for t in e.values() if torch.is_tensor(t)]


@pytest.mark.parametrize("step", [float("nan"), float("inf"), -3.0, 2.5])
def test_a_step_that_is_no_count_is_refused_before_anything_loads(step: float) -> None:
    """A saved step that is not a whole number >= 0 is refused naming the parameter, before the groups' values or
    any moment change (it used to fail inside the load, half the state loaded, or to be truncated)."""
    model, ref = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(groups(model), lr=LR, stage=1)
    _step(model, opt, batch(0, ROWS))
    ropt = torch.optim.AdamW(groups(ref), lr=5 * LR)
    for _ in range(2):
        _step(ref, ropt, batch(1, ROWS))
    saved = ropt.state_dict()
    last = max(saved["state"])
    saved["state"][last]["step"] = torch.tensor(step)
    before = _tensors(opt)
    message = rf"state\[{last}\]\[.step.\] \(.*{last}.*\) is {step}: a step count is a whole"
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(saved)
    for a, b in zip(before, _tensors(opt), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("stage", STAGES)
def test_the_state_is_listed_in_parameter_order_as_in_adamw(stage: int) -> None:
    """``state_dict()["state"]`` lists the parameters in their order, as ``torch.optim.AdamW`` does (code reading
    ``list(sd["state"].values())`` pairs them with the parameters)."""
    model, ref = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(groups(model), lr=LR, stage=stage, reduce_bucket_size=BUCKET, module=model)
    ropt = torch.optim.AdamW(groups(ref), lr=LR)
    for m, o in ((model, opt), (ref, ropt)):
        _step(m, o, batch(0, ROWS))
    assert list(opt.state_dict()["state"]) == list(ropt.state_dict()["state"])
    assert list(opt.full_state_dict()["state"]) == list(ropt.state_dict()["state"])


def _bad_sharded_steps_body(rank: int, world: int) -> list[str]:
    """Each rank's own sharded state dict with one step count edited to something that is no count: refused naming
    the entry, the groups unchanged (the load applied the groups first, then failed or truncated)."""
    model, _ = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(groups(model), lr=LR, stage=2, reduce_bucket_size=BUCKET)
    _step(model, opt, batch(rank, ROWS))
    problems = []
    for bad in (float("nan"), -1, 2.5, "x"):
        saved = copy.deepcopy(opt.state_dict())
        steps = saved[zo.optimizer.optim_state.FORMAT]["steps"]
        steps[next(iter(steps))] = bad
        saved["param_groups"][0]["lr"] = 0.5
        try:
            opt.load_state_dict(saved)
            problems.append(f"step {bad!r} was loaded")
        except ValueError as err:
            if "['steps']" not in str(err) or "must be an integer >= 0" not in str(err):
                problems.append(f"step {bad!r}: unclear refusal: {err}")
        if opt.param_groups[0]["lr"] != LR:
            problems.append(f"step {bad!r}: the groups were loaded before the refusal")
    return problems


@pytest.mark.distributed
def test_a_sharded_step_that_is_no_count_is_refused_before_anything_loads() -> None:
    run_ranks_checked(_bad_sharded_steps_body, 2)
