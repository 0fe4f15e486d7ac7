"""Resetting Adam state the torch way, at every stage on 1-3 gloo ranks, against ``torch.optim.AdamW``
given the same resets: ``opt.state[p] = {}``, ``del opt.state[p]``, ``opt.state.clear()``,
``opt.state = defaultdict(dict)``, ``opt.state[p] = {...}`` with whole-parameter tensors, and
``opt.state[p]["step"]`` set and ``opt.state[p].update({...})`` where a rank holds the state.

Every rank runs the same statements, as any optimizer call; a rank that holds none of a parameter's
state (``tiny`` has one element: at world sizes 2-3 one rank holds it) resets nothing there and
raises nothing. Parameters are compared after every step (``tests.helpers.lockstep.compare``), the state at
the end (``full_state_dict()`` against AdamW's ``state_dict()``). A reset made on one rank only
raises ``RanksDisagree`` on every rank at the next step, naming the parameter; so does a state loaded on one
rank only, and the error names that cause too. A reset or write after
``consolidate_state_dict()`` drops the whole state it gathered (``state_dict()`` warns and gives the shard).
"""

from __future__ import annotations

import unittest
from collections import defaultdict
from typing import Any, Callable

import pytest
import torch

import zero_kernels.optim as zo
from tests.helpers.check import assert_close
from tests.helpers.dist import run_ranks_checked
from tests.helpers.lockstep import (
    BUCKET,
    LR,
    ROWS,
    STAGES,
    WORLD_SIZES,
    Net,
    batch,
    compare,
    extra_rows,
    local,
    make_models,
)
from zero_kernels.agreement import RanksDisagree
from zero_kernels.optim.state_dicts import FORMAT


def groups(m: Net) -> list[dict[str, Any]]:
    """AMSGrad where a reset must also zero the running maximum."""
    return [
        {"params": [m.emb.weight, m.tiny, m.mid.bias], "amsgrad": True},
        {"params": [m.emb.bias, m.mid.weight, m.frozen, m.extra.weight, m.extra.bias, m.head.weight, m.head.bias]},
    ]


def _replacement(p: torch.Tensor, ropt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """A state unlike the current one, with whole-parameter tensors (as AdamW's)."""
    entry = ropt.state[p]
    return {"step": torch.tensor(7.0), "exp_avg": entry["exp_avg"] * 0.5, "exp_avg_sq": entry["exp_avg_sq"] * 2}


def _resets(model: Net, ref: Net) -> dict[int, Callable[[Any, Net, torch.optim.Optimizer], None]]:
    """After step k: the same reset on an optimizer and its model (ours, then AdamW's)."""

    def replace(opt: Any, m: Net, ropt: torch.optim.Optimizer) -> None:
        opt.state[m.head.weight] = _replacement(ref.head.weight, ropt)

    def update(opt: Any, m: Net, ropt: torch.optim.Optimizer) -> None:
        if m.head.weight in opt.state:  # as set_steps: where this rank holds the state
            opt.state[m.head.weight].update(_replacement(ref.head.weight, ropt))

    def set_steps(opt: Any, m: Net, _: torch.optim.Optimizer) -> None:
        for p in m.parameters():
            if p in opt.state:  # only where this rank holds the state: the step carries it to the others
                opt.state[p]["step"] = torch.tensor(10.0)

    return {
        0: lambda opt, m, _: opt.state.__setitem__(m.emb.weight, {}),
        1: lambda opt, m, _: (opt.state.__delitem__(m.tiny), opt.state.__delitem__(m.mid.bias)),
        2: lambda opt, m, _: opt.state.clear(),
        3: lambda opt, m, _: setattr(opt, "state", defaultdict(dict)),
        4: replace,
        5: set_steps,
        6: update,
    }


def _reset_case(rank: int, world: int, stage: int) -> None:
    model, ref = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(groups(model), lr=LR, stage=stage, reduce_bucket_size=BUCKET, module=model)
    ropt = torch.optim.AdamW(groups(ref), lr=LR)
    with pytest.raises(KeyError):
        del opt.state[model.emb.weight]  # no state yet: as a dict (and AdamW's state)
    opt.state[model.frozen] = {}  # nothing to reset: no error
    resets = _resets(model, ref)
    for step in range(8):
        x, span = batch(step, world * ROWS), extra_rows(step, world)
        model(x[rank * ROWS : (rank + 1) * ROWS], local(span, rank, stage)).backward()
        ref(x, span).backward()
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
        if step in resets:
            resets[step](opt, model, ropt)
            resets[step](ropt, ref, ropt)
            for p, r in zip(model.parameters(), ref.parameters()):
                assert (p in opt.state) == (len(ropt.state.get(r, {})) > 0 and opt._state._piece(p) is not None), (
                    f"stage {stage} step {step}: `p in opt.state` after the reset"
                )
        with opt.gathered_params():
            compare(model, ref, f"stage {stage} step {step}")
    ours, theirs = opt.full_state_dict()["state"], ropt.state_dict()["state"]
    assert sorted(ours) == sorted(theirs), f"stage {stage}: state of parameters {sorted(ours)} vs {sorted(theirs)}"
    for index, entry in theirs.items():
        assert float(ours[index]["step"]) == float(entry["step"]), f"stage {stage}: state[{index}] step"
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in entry:
                scale = entry[key].abs().max().item()
                assert_close(ours[index][key], entry[key], rtol=1e-5, atol=1e-6 * scale, what=f"state[{index}] {key}")


def _trained(rank: int, world: int, stage: int) -> tuple[torch.nn.Module, zo.ShardedFusedAdam, dict]:
    """A model and its optimizer after two steps on this rank's rows, and the optimizer's state dict after the first."""
    model, _ = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=BUCKET)
    for step in range(2):
        model(batch(step, world * ROWS)[rank * ROWS : (rank + 1) * ROWS]).backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            saved = opt.state_dict()
    return model, opt, saved


def _one_rank_reset_case(rank: int, world: int, stage: int) -> None:
    """A reset on rank 0 only: the next step raises on every rank and updates nothing."""
    model, opt, _ = _trained(rank, world, stage)
    if rank == 0:
        opt.state[model.emb.weight] = {}
    model(batch(2, world * ROWS)[rank * ROWS : (rank + 1) * ROWS]).backward()
    with opt.gathered_params():
        before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RanksDisagree, match=r"step count of parameter 'emb.weight'.*0 on rank 0.*on every rank"):
        opt.step()
    with opt.gathered_params():
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), f"stage {stage}: updated"


def _one_rank_load_case(rank: int, world: int, stage: int) -> None:
    """A state loaded on rank 0 only (the other ranks' load raised and was caught, as libraries that load a file one
    rank wrote do): the next step raises on every rank, naming the load as a cause."""
    model, opt, saved = _trained(rank, world, stage)
    if rank == 0:
        opt.load_state_dict(saved)
    model(batch(2, world * ROWS)[rank * ROWS : (rank + 1) * ROWS]).backward()
    with pytest.raises(RanksDisagree, match=r"step count of parameter .*loaded \(load_state_dict\)"):
        opt.step()


def _master_case(rank: int, world: int) -> None:
    """bf16: a reset keeps the fp32 master and the weights (they are not Adam state)."""
    model, _ = make_models(torch.bfloat16)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=1, reduce_bucket_size=BUCKET)
    model(batch(0, world * ROWS, torch.bfloat16)[rank * ROWS : (rank + 1) * ROWS]).backward()
    opt.step()
    masters = [buf.master.clone() for buf in opt.pipeline.buffers]
    weights = [p.detach().clone() for p in model.parameters()]
    opt.state.clear()
    assert all(torch.equal(buf.master, m) for buf, m in zip(opt.pipeline.buffers, masters)), "the master changed"
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights)), "the weights changed"
    assert not any(buf.exp_avg.any() or buf.exp_avg_sq.any() for buf in opt.pipeline.buffers), "moments kept"


def _consolidated_case(rank: int, world: int) -> None:
    """After ``consolidate_state_dict(to=...)`` each reset or write through ``opt.state`` on that rank makes
    its ``state_dict()`` its shard again, with a warning, instead of the whole state from before the change:
    the resets every rank runs, and writes into an entry that rank holds (``[key] =``, ``update``)."""
    to = world - 1

    def write(opt: Any, m: Net, _: torch.optim.Optimizer) -> None:
        held = next(p for p in m.parameters() if p in opt.state)
        opt.state[held]["step"] = opt.state[held]["step"]

    def update(opt: Any, m: Net, _: torch.optim.Optimizer) -> None:
        held = next(p for p in m.parameters() if p in opt.state)
        opt.state[held].update({k: v.clone() for k, v in opt.state[held].items()})

    for step in range(7):
        model, ref = make_models(torch.float32)
        reset = {**_resets(model, ref), 5: write, 6: update}[step]
        opt = zo.ShardedFusedAdam(groups(model), lr=LR, stage=1, reduce_bucket_size=BUCKET, module=model)
        ropt = torch.optim.AdamW(groups(ref), lr=LR)
        for k in range(2):
            model(batch(k, world * ROWS)[rank * ROWS : (rank + 1) * ROWS]).backward()
            ref(batch(k, world * ROWS)).backward()
            opt.step(), ropt.step(), opt.zero_grad(), ropt.zero_grad()
        opt.consolidate_state_dict(to=to)
        _ = [opt.state[p] for p in model.parameters()], [p in opt.state for p in model.parameters()]  # reads
        if rank == to:
            assert opt.state_dict()[FORMAT].get("whole"), "reads keep the consolidated state"
        reset(opt, model, ropt)
        if rank == to:
            with unittest.TestCase().assertLogs("zero_kernels", "WARNING") as logs:
                sd = opt.state_dict()
            assert not sd[FORMAT].get("whole"), f"reset {step}: the consolidated state outlived it"
            assert "consolidate_state_dict() again" in logs.output[0], logs.output


def _body(rank: int, world: int) -> list[str]:
    problems = []
    cases = [(f"stage {stage} resets", _reset_case, (stage,)) for stage in STAGES]
    if world > 1:
        cases += [(f"stage {stage} one rank", _one_rank_reset_case, (stage,)) for stage in STAGES]
        cases += [(f"stage {stage} loaded on one rank", _one_rank_load_case, (stage,)) for stage in STAGES]
    cases.append(("bf16 master", _master_case, ()))
    if world > 1:
        cases.append(("consolidated, then reset", _consolidated_case, ()))
    for what, case, args in cases:
        try:
            case(rank, world, *args)
        except Exception as err:  # every case runs; each rank reports what it found wrong
            problems.append(f"{what}: {type(err).__name__}: {err}")
    return problems


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"world{w}")
def test_state_resets_match_adamw(world: int) -> None:
    run_ranks_checked(_body, world)


def test_a_key_of_its_own_is_refused_naming_the_way_out() -> None:
    """timm's ``Lookahead`` keeps its slow weights in the wrapped optimizer's state (``'lookahead_slow_buff'``): the
    key cannot be added to a state that lives in the shards, and the error says where such values go instead."""
    model = torch.nn.Linear(3, 2)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=0)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with pytest.raises(KeyError, match="in a dict of your own keyed by the parameter"):
        opt.state[model.weight]["lookahead_slow_buff"] = model.weight.detach().clone()
    assert sorted(opt.state[model.weight]) == ["exp_avg", "exp_avg_sq", "step"]
