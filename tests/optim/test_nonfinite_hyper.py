"""A non-finite ``lr``, ``eps``, ``weight_decay`` or beta, or a beta outside [0, 1), set between steps (a
scheduler bug, ``lr=inf`` given at construction, which torch accepts): the step raises ``ValueError`` on every
rank, naming the group, the key and the value, before anything is updated, at every stage, on 1 and 2 gloo
ranks, with every Adam backend.

Untouched means params, ``exp_avg``, ``exp_avg_sq`` and step counts equal to what they were, bit for bit; once
the value is finite again, the same ``step()`` gives what a run that never saw the bad value gives, bit for
bit. An lr that is NaN on one rank only is a disagreement: ``RanksDisagree`` on every rank (no hang).
"""

from __future__ import annotations

import math

import pytest
import torch

import zero_kernels as zk
from tests.helpers.dist import run_ranks_checked
from zero_kernels import _ext
from zero_kernels.agreement import RanksDisagree

STAGES = (0, 1, 2, 3)
BAD = [("lr", math.nan), ("lr", math.inf), ("weight_decay", math.inf), ("eps", math.nan)]


def _impls() -> list[str]:
    return ["torch", "triton"] + (["cpu"] if _ext.available("ops") else [])


def _setup(stage: int, impl: str, lr: float = 1e-2) -> tuple[list[torch.nn.Parameter], zk.ShardedFusedAdam]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (40, 50, 60)]
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": lr}]
    module = torch.nn.ParameterList(params) if stage == 3 else None  # stage 3 gathers with the module's hooks
    return params, zk.ShardedFusedAdam(groups, lr=1e-2, stage=stage, impl=impl, sub_group_size=30, module=module)


def _grads(params: list[torch.nn.Parameter], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _snapshot(params: list[torch.nn.Parameter], opt: zk.ShardedFusedAdam) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in params]
    for p in params:  # a rank holding none of p's state has none of these keys
        state = opt.state[p]
        out += [torch.as_tensor(state[k]).clone() for k in ("exp_avg", "exp_avg_sq", "step") if k in state]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _refused_case(rank: int, world: int, stage: int, impl: str) -> None:
    clean_params, clean = _setup(stage, impl)
    params, opt = _setup(stage, impl)
    for seed in (1, 2):
        _grads(clean_params, seed)
        clean.step()
    _grads(params, 1)
    opt.step()
    for key, bad in BAD:
        _refused(params, opt, key, bad, rf"param_groups\[1\]\['{key}'\] is {bad}")
    for i, betas in ((1, (0.9, 1.0)), (0, (-0.1, 0.999))):  # torch refuses them at construction only
        _refused(params, opt, "betas", betas, rf"param_groups\[1\]\['betas'\]\[{i}\] is {betas[i]}: betas must be")
    opt.step()
    assert _same(_snapshot(params, opt), _snapshot(clean_params, clean)), "the step after a refusal differs"


def _refused(params: list[torch.nn.Parameter], opt: zk.ShardedFusedAdam, key: str, bad: object, match: str) -> None:
    """Group 1's ``key`` set to ``bad``: the step raises ``match`` and changes nothing; the good value is put back."""
    before = _snapshot(params, opt)
    good = opt.param_groups[1][key]
    opt.param_groups[1][key] = bad
    _grads(params, 2)
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert _same(_snapshot(params, opt), before), f"{key}={bad}: the refused step changed something"
    opt.param_groups[1][key] = good


def _inf_at_construction_case(rank: int, world: int, stage: int, impl: str) -> None:
    params, opt = _setup(stage, impl, lr=math.inf)
    before = [p.detach().clone() for p in params]
    _grads(params, 1)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['lr'\] is inf"):
        opt.step()
    assert _same([p.detach() for p in params], before), "the refused first step changed a param"


def _one_rank_case(rank: int, world: int, stage: int, impl: str) -> None:
    params, opt = _setup(stage, impl)
    _grads(params, 1)
    opt.step()
    before = _snapshot(params, opt)
    opt.param_groups[1]["lr"] = math.nan if rank == 1 else 1e-2
    _grads(params, 2)
    with pytest.raises(RanksDisagree, match=r"param_groups\[1\]\['lr'\]"):
        opt.step()
    assert _same(_snapshot(params, opt), before), "the refused step changed something"


def _body(rank: int, world: int) -> list[str]:
    cases = [(_refused_case, stage, impl) for stage in STAGES for impl in _impls()]
    cases += [(_inf_at_construction_case, stage, "torch") for stage in STAGES]
    if world > 1:
        cases += [(_one_rank_case, stage, "torch") for stage in STAGES]
    problems = []
    for case, stage, impl in cases:
        try:
            case(rank, world, stage, impl)
        except Exception as err:  # every case runs; each rank reports what it found wrong
            problems.append(f"{case.__name__} stage {stage} {impl}: {type(err).__name__}: {err}")
    return problems


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2], ids=lambda w: f"world{w}")
def test_nonfinite_hyper_parameter_refuses_the_step(world: int) -> None:
    run_ranks_checked(_body, world)
