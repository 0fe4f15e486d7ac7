"""The scheduler ``zk.initialize`` builds from a config advances at applied updates only, as DeepSpeed's engine
steps it: the loop that calls ``lr_scheduler.step()`` after every ``optimizer.step()`` gives DeepSpeed's lr at
every update with gradient accumulation and across a skipped step.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

import zero_kernels as zk
from zero_kernels.schedulers import WarmupLR

GAS = 2


def _config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4, "warmup_type": "linear"},
        },
    }


def _lrs_per_update(updates: int, skip: frozenset = frozenset(), start: int = 0) -> tuple[list[float], object]:
    """The lr each update reads, stepping the scheduler after every micro-step; updates in ``skip`` have a NaN
    gradient (skipped). ``start``: updates run before a state dict of the scheduler is taken and reloaded."""
    torch.manual_seed(0)
    model, opt, sch = zk.initialize(nn.Linear(4, 2), _config())
    lrs = []
    for update in range(updates):
        if update == start and start:  # a resume: a new scheduler, both state dicts loaded
            saved, opt_saved = pickle.dumps(sch.state_dict()), opt.state_dict()
            sch = type(sch)(opt, **_config()["scheduler"]["params"])
            sch.load_state_dict(pickle.loads(saved))
            opt.load_state_dict(opt_saved)
        for micro in range(GAS):
            loss = model(torch.randn(2, 4)).square().mean()
            (loss * float("nan") if update in skip else loss).backward()
            if micro == GAS - 1:
                lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sch.step()
            opt.zero_grad()
    return lrs, sch


def test_accumulation_steps_the_schedule_once_per_update() -> None:
    lrs, sch = _lrs_per_update(4)
    assert lrs == pytest.approx([0.0, 0.0, 0.0025, 0.005], abs=0.0), "DeepSpeed's lr at each update"
    assert isinstance(sch, WarmupLR) and type(sch).__name__ == "WarmupLR"
    assert "_applied_steps_seen" not in sch.state_dict() and pickle.loads(pickle.dumps(sch.state_dict()))
    copied = pickle.loads(pickle.dumps(sch))
    assert type(copied) is type(sch) and copied.last_epoch == sch.last_epoch, "the scheduler pickles as itself"
    copied.step()
    assert copied.last_epoch == sch.last_epoch, "a copy steps after its optimizer's next update only"


def test_a_skipped_step_does_not_step_the_schedule() -> None:
    lrs, _ = _lrs_per_update(4, skip=frozenset({2}))
    assert lrs == pytest.approx([0.0, 0.0, 0.0025, 0.0025], abs=0.0)


def test_a_reloaded_schedule_continues_at_updates() -> None:
    lrs, _ = _lrs_per_update(5, start=2)
    assert lrs == pytest.approx([0.0, 0.0, 0.0025, 0.005, 0.0075], abs=0.0)
