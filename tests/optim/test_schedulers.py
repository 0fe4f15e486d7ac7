"""DeepSpeed's schedules: the lr at every step against tables from DeepSpeed's documented formulas.

Each table lists the learning rate the optimizer holds for optimizer steps 0, 1, 2, ...: step 0
runs at the value set at construction (DeepSpeed's iteration -1), step k at the value after k
``scheduler.step()`` calls (iteration k - 1). The tables are written out from the formulas of
``deepspeed/runtime/lr_schedules.py`` (warmup ``log(i + 1) / log(n)`` or ``i / n``; linear decay
``(T - i) / (T - n)``; cosine ``(1 + cos(pi * (i - n + 1) / (T - n))) / 2``; 1Cycle triangle), and
cover the boundaries: the first step, the last warmup step, the end of the decay, past the end.
Where deepspeed is importable, ``test_matches_deepspeed`` also runs DeepSpeed's own classes.
"""

from __future__ import annotations

import math

import pytest
import torch

import zero_kernels.optim as zo
from zero_kernels.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

L = math.log


def _opt(lrs: tuple[float, ...] = (1.0,)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return torch.optim.AdamW(groups, betas=(0.9, 0.999))


def _lrs(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int, group: int = 0) -> list[float]:
    """lr of ``group`` used by optimizer steps 0 .. steps - 1."""
    out = []
    for _ in range(steps):
        out.append(scheduler.optimizer.param_groups[group]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def _check(actual: list[float], expected: list[float]) -> None:
    assert len(actual) == len(expected)
    for k, (a, e) in enumerate(zip(actual, expected)):
        assert a == pytest.approx(e, rel=1e-12, abs=1e-15), f"step {k}: lr {a!r}, expected {e!r}"


TABLES = {
    "WarmupLR linear": (
        lambda o: WarmupLR(o, warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=4, warmup_type="linear"),
        [0.1, 0.1, 0.35, 0.6, 0.85, 1.1, 1.1, 1.1],
    ),
    "WarmupLR log, max from the optimizer": (
        lambda o: WarmupLR(o, warmup_num_steps=4),
        [0.0, 0.0, L(2) / L(4), L(3) / L(4), 1.0, 1.0],
    ),
    "WarmupLR one warmup step counts as two": (
        lambda o: WarmupLR(o, warmup_min_lr=0.0, warmup_max_lr=2.0, warmup_num_steps=1, warmup_type="linear"),
        [0.0, 0.0, 1.0, 2.0, 2.0],
    ),
    "WarmupDecayLR linear": (
        lambda o: WarmupDecayLR(o, total_num_steps=7, warmup_max_lr=1.0, warmup_num_steps=3, warmup_type="linear"),
        [0.0, 0.0, 1 / 3, 2 / 3, 1.0, 3 / 4, 2 / 4, 1 / 4, 0.0, 0.0, 0.0],
    ),
    "WarmupDecayLR log, default max 0.001": (
        lambda o: WarmupDecayLR(o, total_num_steps=4, warmup_num_steps=2),
        [0.0, 0.0, 1e-3 * L(2) / L(2), 1e-3 * 2 / 2, 1e-3 * 1 / 2, 0.0],
    ),
    "WarmupCosineLR linear": (
        lambda o: WarmupCosineLR(
            o, total_num_steps=7, warmup_min_ratio=0.2, warmup_num_steps=3, cos_min_ratio=0.1, warmup_type="linear"
        ),
        [0.0, 0.2 * 2, (0.2 + 0.8 / 3) * 2, (0.2 + 1.6 / 3) * 2]
        + [(0.1 + 0.9 * (1 + math.cos(math.pi * k / 4)) / 2) * 2 for k in (1, 2, 3, 4)]
        + [0.1 * 2, 0.1 * 2],
    ),
    "WarmupCosineLR log": (
        lambda o: WarmupCosineLR(o, total_num_steps=4, warmup_num_steps=2),
        [0.0, 0.0, 2.0, 2.0 * (1e-4 + (1 - 1e-4) * 0.5), 2.0 * 1e-4, 2.0 * 1e-4],
    ),
    "WarmupDecayLR ending with the warmup": (
        lambda o: WarmupDecayLR(o, total_num_steps=3, warmup_max_lr=1.0, warmup_num_steps=3, warmup_type="linear"),
        [0.0, 0.0, 1 / 3, 2 / 3, 0.0, 0.0],
    ),
    "WarmupCosineLR ending with the warmup": (
        lambda o: WarmupCosineLR(o, total_num_steps=3, warmup_num_steps=3, cos_min_ratio=0.1, warmup_type="linear"),
        [0.0, 0.0, 2 / 3, 4 / 3, 0.1 * 2, 0.1 * 2],
    ),
    "WarmupCosineLR below a negative floor": (
        lambda o: WarmupCosineLR(o, total_num_steps=4, warmup_num_steps=2, cos_min_ratio=-0.5, warmup_type="linear"),
        [0.0, 0.0, 1.0, 0.5, 0.0, 0.0],
    ),
    "OneCycle": (
        lambda o: OneCycle(o, cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=2, cycle_second_step_size=4),
        [0.1, 0.3, 0.5, 0.4, 0.3, 0.2, 0.1, 0.1, 0.1],
    ),
    "OneCycle decay": (
        lambda o: OneCycle(
            o, cycle_min_lr=0.1, cycle_max_lr=0.3, cycle_first_step_size=1, decay_lr_rate=0.5, decay_step_size=2
        ),
        [0.1, 0.3, 0.1, 0.1 / 1.25, 0.1 / 1.5, 0.1 / 1.75],
    ),
    "LRRangeTest": (
        lambda o: LRRangeTest(o, lr_range_test_min_lr=0.1, lr_range_test_step_size=2, lr_range_test_step_rate=3.0),
        [0.1, 0.25, 0.4, 0.55, 0.7],
    ),
    "LRRangeTest staircase": (
        lambda o: LRRangeTest(o, lr_range_test_min_lr=0.1, lr_range_test_step_size=2, lr_range_test_staircase=True),
        [0.1, 0.1, 0.2, 0.2, 0.3, 0.3],
    ),
    "OneCycle stairs": (
        lambda o: OneCycle(o, cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=4, cycle_first_stair_count=2),
        [0.0, 0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0],
    ),
}


@pytest.mark.parametrize("name", list(TABLES))
def test_lr_table(name: str) -> None:
    build, expected = TABLES[name]
    optimizer = _opt((2.0,) if "Cosine" in name else (1.0,))
    _check(_lrs(build(optimizer), len(expected)), expected)


def test_one_cycle_momentum_and_groups() -> None:
    optimizer = _opt((1.0, 1.0))
    scheduler = OneCycle(
        optimizer, cycle_min_lr=[0.1, 0.2], cycle_max_lr=[0.5, 0.4], cycle_first_step_size=2, cycle_min_mom=0.85
    )
    assert optimizer.param_groups[0]["betas"] == (0.85, 0.99)  # DeepSpeed sets beta2 to 0.99
    betas = []
    for _ in range(5):
        betas.append(optimizer.param_groups[1]["betas"][0])
        optimizer.step()
        scheduler.step()
    _check(betas, [0.85, 0.875, 0.85, 0.875, 0.9])
    _check([g["lr"] for g in optimizer.param_groups], [0.1, 0.2])


def test_one_cycle_momentum_reaching_one_is_refused_by_the_scheduler() -> None:
    """decay_mom_rate raises betas[0] after the cycle: the schedule's step that would make it 1 or more raises
    naming decay_mom_rate and changes nothing (it set the beta, and the optimizer was left to refuse it)."""
    optimizer = _opt()
    scheduler = OneCycle(
        optimizer, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=2, decay_step_size=4,
        cycle_max_mom=0.95, decay_mom_rate=0.1,
    )  # fmt: skip
    for _ in range(6):  # iterations 0-5: the cycle (0-3), then 0.95 * (1 + 0.1 * k / 4) for k = 1, 2
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["betas"][0] == pytest.approx(0.9975)
    lr, state = optimizer.param_groups[0]["lr"], scheduler.state_dict()
    optimizer.step()
    with pytest.raises(ValueError, match=r"OneCycle: iteration 6 would set betas\[0\] to 1\.02125.*decay_mom_rate"):
        scheduler.step()
    assert optimizer.param_groups[0]["betas"][0] == pytest.approx(0.9975)
    assert optimizer.param_groups[0]["lr"] == lr and scheduler.state_dict() == state


def test_state_dict_round_trip_and_deepspeed_state() -> None:
    build = TABLES["WarmupDecayLR linear"][0]
    first = build(_opt())
    _lrs(first, 5)
    second = build(_opt())
    second.load_state_dict(first.state_dict())
    _check(_lrs(second, 3), [3 / 4, 2 / 4, 1 / 4])
    third = build(_opt())
    third.load_state_dict({"last_batch_iteration": 3})  # DeepSpeed's own state after 4 steps
    assert third.last_batch_iteration == 3
    third.optimizer.step()
    third.step()
    _check([third.optimizer.param_groups[0]["lr"]], [3 / 4])


def test_works_with_sharded_fused_adam() -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = zo.ShardedFusedAdam(model, lr=1.0, stage=1)
    scheduler = WarmupLR(optimizer, warmup_max_lr=0.4, warmup_num_steps=2, warmup_type="linear")
    _check(_lrs(scheduler, 4), [0.0, 0.0, 0.2, 0.4])


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda o: WarmupLR(o, warmup_num_steps=0), "warmup_num_steps=0"),
        (lambda o: WarmupLR(o, warmup_type="cosine"), "warmup_type='cosine'"),
        (lambda o: WarmupLR(o, warmup_min_lr=[0.1, 0.2]), "warmup_min_lr has 2 values"),
        (lambda o: WarmupDecayLR(o, total_num_steps=-1), "total_num_steps=-1"),
        (lambda o: WarmupCosineLR(o, total_num_steps=5, cos_min_ratio="x"), "cos_min_ratio='x'"),
        (lambda o: OneCycle(o, 0.1, 0.2, cycle_first_step_size=0), "cycle_first_step_size=0"),
        (lambda o: WarmupLR(o, last_batch_iteration=-2), "last_batch_iteration=-2"),
        (lambda o: LRRangeTest(o, lr_range_test_step_size=0), "lr_range_test_step_size=0"),
        (lambda o: LRRangeTest(o, lr_range_test_staircase="yes"), "lr_range_test_staircase='yes'"),
    ],
)
def test_bad_arguments_name_themselves(build, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        build(_opt())


DEEPSPEED_CASES = {
    "WarmupLR": [
        dict(warmup_min_lr=0.01, warmup_max_lr=0.5, warmup_num_steps=7, warmup_type="log"),
        dict(warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.2], warmup_num_steps=5, warmup_type="linear"),
        dict(warmup_num_steps=3),
    ],
    "WarmupDecayLR": [
        dict(total_num_steps=20, warmup_num_steps=5, warmup_type="linear"),
        dict(total_num_steps=12, warmup_min_lr=0.1, warmup_max_lr=0.9, warmup_num_steps=4),
    ],
    "WarmupCosineLR": [
        dict(total_num_steps=15, warmup_min_ratio=0.1, warmup_num_steps=4, cos_min_ratio=0.05, warmup_type="linear"),
        dict(total_num_steps=9, warmup_num_steps=3),
    ],
    "OneCycle": [
        dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4, cycle_second_step_size=3),
        dict(
            cycle_min_lr=[0.01, 0.02], cycle_max_lr=0.1, cycle_first_step_size=3, decay_lr_rate=0.3,
            decay_step_size=2, decay_mom_rate=0.01, cycle_first_stair_count=3,
        ),
    ],
    "LRRangeTest": [
        dict(lr_range_test_min_lr=0.01, lr_range_test_step_size=3, lr_range_test_step_rate=2.5),
        dict(lr_range_test_min_lr=[0.01, 0.02], lr_range_test_step_size=4, lr_range_test_staircase=True),
    ],
}  # fmt: skip


@pytest.mark.parametrize("name", list(DEEPSPEED_CASES))
def test_matches_deepspeed(name: str) -> None:
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    from zero_kernels.schedulers import SCHEDULERS

    for params in DEEPSPEED_CASES[name]:
        theirs_opt, ours_opt = _opt((0.3, 0.6)), _opt((0.3, 0.6))
        theirs = getattr(lr_schedules, name)(theirs_opt, **params)
        ours = SCHEDULERS[name](ours_opt, **params)
        for step in range(25):
            for a, b in zip(ours_opt.param_groups, theirs_opt.param_groups):
                assert a["lr"] == pytest.approx(b["lr"], rel=1e-12, abs=1e-15), f"{name} {params} step {step}"
                assert tuple(a["betas"]) == pytest.approx(tuple(b["betas"]), rel=1e-12), f"{name} {params} step {step}"
            theirs.step()
            ours_opt.step()
            ours.step()
