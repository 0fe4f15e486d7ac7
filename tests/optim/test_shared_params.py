"""Two optimizers on one parameter (a shared trunk under an actor's and a critic's optimizer).

Two ``torch.optim.AdamW`` each step a shared parameter with its own state. Two ``ShardedFusedAdam`` do the same
where both leave the gradient in ``p.grad`` (stages 0-1): the weights match two AdamW. Where either takes it away
(stages 2-3, or a wider ``grad_accum_dtype``), the one built last gets it and the first one's step raises, naming
the parameter, before anything changes; an optimizer built again on the same model (the old one still bound)
trains as AdamW, without a word; a deleted one does not stand in the way.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import zero_kernels as zk
from tests.helpers.check import assert_close
from tests.helpers.dist import run_ranks

LR = 1e-2


def _nets() -> tuple[nn.Linear, nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    return nn.Linear(6, 12), nn.Linear(12, 3), nn.Linear(12, 1)


def _loop(trunk: nn.Module, actor: nn.Module, critic: nn.Module, optimizers: list, steps: range) -> None:
    for step in steps:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        h = torch.tanh(trunk(x))
        for opt in optimizers:
            opt.zero_grad()
        (actor(h).square().mean() + critic(h).square().mean()).backward()
        for opt in optimizers:
            opt.step()


def _compare(ours: nn.Module, ref: nn.Module, what: str) -> None:
    """fp32 tolerance, with elements near zero judged against the model's largest magnitude (a bias of one element
    near zero has no scale of its own)."""
    scale = max(p.abs().max().item() for p in ref.parameters())
    for got, want in zip(ours.parameters(), ref.parameters()):
        assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6 * scale, what=what)


def _two(make, trunk: nn.Module, actor: nn.Module, critic: nn.Module) -> list:
    return [make([*trunk.parameters(), *actor.parameters()]), make([*trunk.parameters(), *critic.parameters()])]


@pytest.mark.parametrize("stage", [0, 1])
def test_two_optimizers_sharing_a_trunk_step_it_as_two_adamw_do(stage: int) -> None:
    ours = _nets()
    ref = copy.deepcopy(ours)
    _loop(*ref, _two(lambda ps: torch.optim.AdamW(ps, lr=LR), *ref), range(3))
    _loop(*ours, _two(lambda ps: zk.ShardedFusedAdam(ps, lr=LR, stage=stage), *ours), range(3))
    _compare(nn.ModuleList(ours), nn.ModuleList(ref), "vs AdamW")


@pytest.mark.parametrize(
    "first, second, extra",
    [(2, 2, {}), (0, 2, {}), (2, 0, {}), (1, 3, {}), (0, 0, {"grad_accum_dtype": "fp32"})],
    ids=["2-2", "0-2", "2-0", "1-3", "0-0 wide accumulation"],
)
def test_the_first_optimizer_refuses_to_step_without_the_gradient_the_second_takes(first, second, extra) -> None:
    trunk, actor, critic = _nets()
    model = nn.ModuleList([trunk, actor, critic])
    if extra:
        model.to(torch.bfloat16)
    oa = zk.ShardedFusedAdam([*trunk.parameters(), *actor.parameters()], lr=LR, stage=first, **extra)
    module = {"module": model} if second == 3 else {}
    oc = zk.ShardedFusedAdam([*trunk.parameters(), *critic.parameters()], lr=LR, stage=second, **module, **extra)
    x = torch.randn(4, 6, dtype=next(trunk.parameters()).dtype)
    h = torch.tanh(trunk(x))
    (actor(h).float().square().mean() + critic(h).float().square().mean()).backward()
    oc.step()
    holding = oc.gathered_params() if second == 3 else contextlib.nullcontext()
    with holding:
        before = [p.detach().clone() for p in model.parameters()]
    later = rf"parameter .* is also held by a ShardedFusedAdam built after this one \(stage {second}\), which gets"
    with pytest.raises(ValueError, match=later + r".*nothing was"):  # a stage 0-1 one takes no gradient away
        oa.step()
    with oc.gathered_params() if second == 3 else contextlib.nullcontext():
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "nothing was updated"


def test_an_optimizer_built_again_on_the_same_model_replaces_the_old_one_quietly(recwarn) -> None:
    ours = _nets()
    ref = copy.deepcopy(ours)
    opt = zk.ShardedFusedAdam(nn.ModuleList(ours).parameters(), lr=LR, stage=2)
    opt = zk.ShardedFusedAdam(nn.ModuleList(ours).parameters(), lr=LR, stage=2)  # the old one still bound here
    _loop(*ours, [opt], range(3))
    _loop(*ref, [torch.optim.AdamW(nn.ModuleList(ref).parameters(), lr=LR)], range(3))
    _compare(nn.ModuleList(ours), nn.ModuleList(ref), "vs AdamW")
    assert not [w for w in recwarn if "ShardedFusedAdam" in str(w.message)]


def test_a_deleted_optimizer_gives_its_parameters_up_without_gc_collect() -> None:
    ours = _nets()
    ref = copy.deepcopy(ours)
    warmup = zk.ShardedFusedAdam(ours[1].parameters(), lr=LR, stage=2)  # a head warm-up, then deleted
    del warmup  # still alive in its reference cycle until the collector runs
    main = zk.ShardedFusedAdam(nn.ModuleList(ours).parameters(), lr=LR, stage=2)
    _loop(*ours, [main], range(3))
    _loop(*ref, [torch.optim.AdamW(nn.ModuleList(ref).parameters(), lr=LR)], range(3))
    _compare(nn.ModuleList(ours), nn.ModuleList(ref), "vs AdamW")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_del_frees_the_optimizer_at_once_on_every_rank_alike(stage: int) -> None:
    """No reference cycle holds a ShardedFusedAdam: ``del`` frees it then, not when each rank's collector runs (a
    rank that collected it and one that did not would pair different collectives). Its pipeline, which holds the
    parameters and the Adam state, goes with it (at stage 3 its units and its scheduler's callbacks held it in a
    reference cycle: a search building optimizer after optimizer kept each dead one's state until the collector ran,
    64 MiB for a model of 4.2M parameters)."""
    trunk, actor, critic = _nets()
    model = nn.ModuleList([trunk, actor])
    gc.disable()
    try:
        opt = zk.ShardedFusedAdam(model if stage == 3 else model.parameters(), lr=LR, stage=stage)
        _loop(trunk, actor, critic, [opt], range(1))
        freed, pipeline = weakref.ref(opt), weakref.ref(opt.pipeline)
        del opt
        assert freed() is None
        assert pipeline() is None
    finally:
        gc.enable()


def _older_steps_beside_stage3(rank: int, world: int, first: int) -> None:
    trunk, actor, critic = _nets()
    model = nn.ModuleList([trunk, actor])
    old = zk.ShardedFusedAdam(model.parameters(), lr=LR, stage=first)
    new = zk.ShardedFusedAdam(model, lr=LR, stage=3, stage3_param_persistence_threshold=0)  # `old` still bound
    _loop(trunk, actor, critic, [new], range(1))
    with pytest.raises(ValueError, match=r"is also held by a ShardedFusedAdam built after this one \(stage 3\)"):
        old.step()


@pytest.mark.distributed
@pytest.mark.parametrize("first", [0, 1, 2])
def test_an_older_optimizer_beside_a_stage3_one_on_its_parameters_says_so_at_its_step(first: int) -> None:
    """A stage-3 optimizer built on the parameters of a live stage 0-2 one empties them between uses (on several
    ranks): the older one's step names the optimizer built after it, as for stages 0-2; it said that the parameter
    was replaced by one of shape (0,) and to resize the model before building the optimizer."""
    run_ranks(_older_steps_beside_stage3, 2, first)
