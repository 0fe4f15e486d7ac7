"""One weight-decay mode per optimizer: ``adam_w_mode``, or torch's ``decoupled_weight_decay`` (``torch.optim.Adam``'s
name), and every group's ``decoupled_weight_decay`` key agreeing with it (a group saying otherwise was trained in the
optimizer's mode without a word).
"""

from __future__ import annotations

import pytest
import torch

import zero_kernels.optim as zo
from tests.helpers.lockstep import LR, ROWS, Net, batch, compare, make_models


@pytest.mark.parametrize("stage", [0, 2])
def test_decoupled_weight_decay_false_trains_as_torch_adam(stage: int) -> None:
    model, ref = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(model, lr=LR, weight_decay=0.1, decoupled_weight_decay=False, stage=stage)
    ropt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
    assert opt.adam_w_mode is False and opt.param_groups[0]["decoupled_weight_decay"] is False
    for step in range(3):
        for m, o in ((model, opt), (ref, ropt)):
            m(batch(step, ROWS)).backward()
            o.step()
            o.zero_grad()
        compare(model, ref, f"step {step}")


def test_the_groups_follow_the_mode_as_torch_adamw_groups_do() -> None:
    opt = zo.ShardedFusedAdam(Net())
    assert opt.param_groups[0]["decoupled_weight_decay"] is True
    assert opt.param_groups[0].keys() == torch.optim.AdamW(Net().parameters()).param_groups[0].keys()


def test_a_group_of_the_other_mode_is_refused_before_anything_changes() -> None:
    model = Net()
    groups = [{"params": [model.emb.weight]}, {"params": [model.head.weight], "decoupled_weight_decay": False}]
    with pytest.raises(ValueError, match=r"^param group 1: decoupled_weight_decay=False, but this ShardedFusedAdam"):
        zo.ShardedFusedAdam(groups, weight_decay=0.1)
    opt = zo.ShardedFusedAdam([model.emb.weight], weight_decay=0.1, adam_w_mode=False)
    with pytest.raises(ValueError, match=r"decoupled_weight_decay=True, but .* L2 .* adam_w_mode=True for the other"):
        opt.add_param_group({"params": [model.head.weight], "decoupled_weight_decay": True})
    assert len(opt.param_groups) == 1
    before = model.emb.weight.detach().clone()
    model(batch(0, ROWS)).backward()
    opt.param_groups[0]["decoupled_weight_decay"] = True  # edited between steps
    with pytest.raises(ValueError, match=r"param group 0: decoupled_weight_decay=True.*nothing was updated"):
        opt.step()
    assert torch.equal(model.emb.weight, before)


def test_the_two_names_of_the_mode_must_agree() -> None:
    with pytest.raises(ValueError, match="adam_w_mode=False and decoupled_weight_decay=True contradict"):
        zo.ShardedFusedAdam(Net(), adam_w_mode=False, decoupled_weight_decay=True)
    with pytest.raises(ValueError, match="decoupled_weight_decay must be True or False, got 'no'"):
        zo.ShardedFusedAdam(Net(), decoupled_weight_decay="no")
