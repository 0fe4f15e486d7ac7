"""``opt.param_groups`` edited by hand (a group popped, appended, or parameters added to one) where
``torch.optim.AdamW`` would follow the edit: the flat buffers cannot, so the next step raises a ``ValueError``
saying what to call instead, before it changes anything, at every stage. So do the state dicts and checkpoints,
which number the parameters through the groups: after an edit they keyed the state as built and the groups' params
as edited, every entry after the edit on another parameter (no error), and ``checkpoint.save`` wrote tensors
under other parameters' names (a checkpoint whose load failed)."""

from __future__ import annotations

import contextlib
from typing import Callable

import pytest
import torch
from torch import nn

import zero_kernels as zk

STAGES = (0, 1, 2, 3)


def _pop(opt: zk.ShardedFusedAdam, model: nn.Module) -> None:
    opt.param_groups.pop()


def _append_group(opt: zk.ShardedFusedAdam, model: nn.Module) -> None:
    extra = nn.Parameter(torch.ones(3))
    opt.param_groups.append({**{k: v for k, v in opt.param_groups[0].items() if k != "params"}, "params": [extra]})


def _extend_group(opt: zk.ShardedFusedAdam, model: nn.Module) -> None:
    opt.param_groups[0]["params"].append(nn.Parameter(torch.ones(3)))


EDITS: dict[str, tuple[Callable[[zk.ShardedFusedAdam, nn.Module], None], str]] = {
    "popped": (_pop, "a param group cannot be removed"),
    "appended": (_append_group, "opt.add_param_group"),
    "extended": (_extend_group, "param group 0 holds 3 parameters where it was given 2"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("stage", STAGES)
def test_an_edit_of_param_groups_is_refused_before_the_step_changes_anything(stage: int, edit: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "lr": 0.5}]
    opt = zk.ShardedFusedAdam(groups, lr=1e-2, stage=stage, module=model)
    holding = opt.gathered_params if stage == 3 else contextlib.nullcontext
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    model(torch.randn(4, 6)).square().mean().backward()
    with holding():
        before = [p.detach().clone() for p in model.parameters()]
    state = opt.full_state_dict()["state"]
    change, says = EDITS[edit]
    groups = list(opt.param_groups)
    params = [list(g["params"]) for g in groups]
    change(opt, model)
    with pytest.raises(ValueError, match=says) as caught:
        opt.step()
    assert "nothing was updated" in str(caught.value)
    opt.param_groups[:] = groups  # undone, to read the state
    for g, ps in zip(groups, params):
        g["params"] = ps
    with holding():
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    after = opt.full_state_dict()["state"]
    assert all(torch.equal(after[i][k], state[i][k]) for i in state for k in state[i])


@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("stage", STAGES)
def test_state_dicts_and_checkpoints_refuse_an_edit_of_param_groups(stage: int, edit: str, tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "lr": 0.5}]
    opt = zk.ShardedFusedAdam(groups, lr=1e-2, stage=stage, module=model)
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    zk.checkpoint.save(tmp_path / "before", model, opt)
    sharded, full = opt.state_dict(), opt.full_state_dict()
    change, says = EDITS[edit]
    change(opt, model)
    for name, call in (
        ("state_dict", opt.state_dict),
        ("full_state_dict", opt.full_state_dict),
        ("consolidate_state_dict", opt.consolidate_state_dict),
        ("load_state_dict (sharded)", lambda: opt.load_state_dict(sharded)),
        ("load_state_dict (full)", lambda: opt.load_state_dict(full)),
        ("checkpoint.save", lambda: zk.checkpoint.save(tmp_path / "after", model, opt)),
        ("checkpoint.load", lambda: zk.checkpoint.load(tmp_path / "before", model, opt)),
    ):
        with pytest.raises(ValueError, match=says):
            call()
        assert not (tmp_path / "after").exists(), name
