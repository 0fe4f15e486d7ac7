"""What a checkpoint keeps besides tensors comes back exactly: the lr scheduler's state (a resumed run has
the uninterrupted run's learning rate at every step), the param groups, and ``extra``; all read with
``torch.load(weights_only=True)``. A checkpoint written before ``objects.pt`` (format version 1, the
scheduler's state in JSON) still loads, and its scheduler resumes right too.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections import Counter, OrderedDict, defaultdict
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as torch_lr

import zero_kernels.checkpoint as ck
import zero_kernels.optim as zo
from zero_kernels.schedulers import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

STEPS, SAVE_AT, LR = 10, 4, 0.1

Build = Callable[[torch.optim.Optimizer], Any]
SCHEDULERS: dict[str, Build] = {
    "MultiStepLR": lambda o: torch_lr.MultiStepLR(o, milestones=[2, 5, 7], gamma=0.1),
    "SequentialLR": lambda o: torch_lr.SequentialLR(
        o, [torch_lr.ConstantLR(o, factor=0.5, total_iters=2), torch_lr.MultiStepLR(o, milestones=[3, 5])], [3]
    ),
    "ChainedScheduler": lambda o: torch_lr.ChainedScheduler(
        [torch_lr.MultiStepLR(o, milestones=[5], gamma=0.5), torch_lr.ExponentialLR(o, gamma=0.9)]
    ),
    "OneCycleLR": lambda o: torch_lr.OneCycleLR(o, max_lr=LR, total_steps=STEPS + 1),
    "CosineAnnealingWarmRestarts": lambda o: torch_lr.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2),
    "CyclicLR": lambda o: torch_lr.CyclicLR(o, base_lr=0.01, max_lr=LR, step_size_up=3, cycle_momentum=False),
    "PolynomialLR": lambda o: torch_lr.PolynomialLR(o, total_iters=8, power=2.0),
    "ReduceLROnPlateau": lambda o: torch_lr.ReduceLROnPlateau(o, patience=1, factor=0.5),
    "WarmupLR": lambda o: WarmupLR(o, warmup_max_lr=LR, warmup_num_steps=5),
    "WarmupDecayLR": lambda o: WarmupDecayLR(o, total_num_steps=STEPS, warmup_max_lr=LR, warmup_num_steps=3),
    "WarmupCosineLR": lambda o: WarmupCosineLR(o, total_num_steps=STEPS, warmup_num_steps=3),
    "OneCycle": lambda o: OneCycle(o, cycle_min_lr=0.01, cycle_max_lr=LR, cycle_first_step_size=3),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))


def _opt(model: nn.Module, stage: int = 1) -> zo.ShardedFusedAdam:
    return zo.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=7)


def _train(model: nn.Module, opt: zo.ShardedFusedAdam, scheduler: Any, steps: range) -> list[float]:
    """One step per iteration; returns the lr each step ran at."""
    lrs = []
    for step in range(steps.start, steps.stop):
        lrs.append(opt.param_groups[0]["lr"])
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if isinstance(scheduler, torch_lr.ReduceLROnPlateau):
            scheduler.step(1.0)  # a metric that never improves: the lr halves every other step
        else:
            scheduler.step()
    return lrs


def _as_version_1(version: Path) -> None:
    """Rewrite a checkpoint as format version 1 wrote it: groups, loss scale and scheduler state in the JSON."""
    meta = json.loads((version / "metadata.json").read_text())
    book = ck.objects.read_file(version, "objects.pt", meta.pop("objects"))
    groups = [{k: v.item() if isinstance(v, torch.Tensor) else v for k, v in g.items()} for g in book["param_groups"]]
    meta.update(version=1, param_groups=json.loads(json.dumps(groups)), loss_scaler=book["loss_scaler"])
    meta["lr_scheduler"] = json.loads(json.dumps(book["lr_scheduler"]))  # what version 1 kept: string keys
    (version / "objects.pt").unlink()
    (version / "metadata.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("version", [2, 1], ids=["objects", "version1"])
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_resumed_scheduler_gives_the_uninterrupted_lr_at_every_step(name: str, version: int, tmp_path: Path) -> None:
    model = _model()
    opt = _opt(model)
    scheduler = SCHEDULERS[name](opt)
    expected = _train(model, opt, scheduler, range(STEPS))

    model = _model()
    opt = _opt(model)
    scheduler = SCHEDULERS[name](opt)
    before = _train(model, opt, scheduler, range(SAVE_AT))
    saved = ck.save(tmp_path, model, opt, scheduler=scheduler)
    if version == 1:
        _as_version_1(saved)
    model = _model()
    opt = _opt(model, stage=2)
    scheduler = SCHEDULERS[name](opt)
    ck.load(tmp_path, model, opt, scheduler=scheduler)
    after = _train(model, opt, scheduler, range(SAVE_AT, STEPS))
    resumed = before + after
    assert len(set(expected)) > 2, f"{name}: the schedule hardly changes the lr: {expected}"
    for step, (got, want) in enumerate(zip(resumed, expected)):
        assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-15), f"{name}: step {step}: lr {got} vs {want}"


def test_a_load_without_the_saved_scheduler_says_the_schedule_restarts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """DeepSpeed's load_checkpoint restores the engine's scheduler by itself: a load without ``scheduler=`` of a
    checkpoint that holds one warns, naming its class and ``scheduler=``; a checkpoint without one says nothing."""
    model = _model()
    opt = _opt(model)
    scheduler = SCHEDULERS[sorted(SCHEDULERS)[0]](opt)
    _train(model, opt, scheduler, range(SAVE_AT))
    ck.save(tmp_path / "with", model, opt, scheduler=scheduler)
    ck.save(tmp_path / "without", model, opt)
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        ck.load(tmp_path / "without", model, opt)
        assert not caplog.records
        ck.load(tmp_path / "with", model, opt)
    (record,) = caplog.records
    assert f"state of a {type(scheduler).__name__} scheduler" in record.getMessage()
    assert "pass scheduler=" in record.getMessage()


def test_param_groups_and_extra_come_back_with_their_types(tmp_path: Path) -> None:
    model = _model()
    groups = [
        {"params": list(model[0].named_parameters()), "lr": torch.tensor(0.05), "betas": (0.8, 0.9), "tag": ("a", 1)},
        {"params": list(model[2].named_parameters()), "weight_decay": 0.0},
    ]
    opt = zo.ShardedFusedAdam(groups, lr=LR, stage=1, module=model)
    extra = {
        "counts": Counter({30: 1, 80: 2}),
        3: OrderedDict(b=1, a=(2, 3.5)),
        "seen": {1, 2},
        "frozen": frozenset({"x"}),
        "by_key": defaultdict(list, {1: [2]}),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "tensor": torch.arange(4.0),
        "tagged": (ck.objects.TAG, "Counter", []),  # a tuple that looks like a tag stays a tuple
        "inf": math.inf,
        "none": None,
        "bytes": b"\x00\x01",
    }
    ck.save(tmp_path, model, opt, extra=extra)
    opt2 = zo.ShardedFusedAdam(
        [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}], lr=0.5, module=model
    )
    back = ck.load(tmp_path, model, opt2)
    for key, value in extra.items():
        got = back[key]
        assert type(got) is type(value), f"extra[{key!r}]: {type(got).__name__} instead of {type(value).__name__}"
        same = torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
        assert same, f"extra[{key!r}]: {got!r} != {value!r}"
    assert back["by_key"].default_factory is list
    lr = opt2.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and torch.equal(lr, torch.tensor(0.05)), f"a tensor lr comes back: {lr!r}"
    assert opt2.param_groups[0]["betas"] == (0.8, 0.9) and opt2.param_groups[0]["tag"] == ("a", 1)
    assert opt2.param_groups[1]["param_names"] == ["weight", "bias"]


def test_tensors_saved_on_a_gpu_come_back_where_the_loader_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``extra`` (and the objects) written by rank 0 from its GPU: a reader without one gets them on the CPU (it was
    refused, naming weights_only), a reader with one on its own current GPU, not on rank 0's."""
    import torch.serialization as serialization

    model = _model()
    extra = {"ema": torch.arange(3.0), "epoch": 3}
    real = serialization.location_tag
    monkeypatch.setattr(serialization, "location_tag", lambda storage: "cuda:0")  # as torch.save on cuda:0 writes
    ck.save(tmp_path, model, _opt(model), extra=extra)
    monkeypatch.setattr(serialization, "location_tag", real)
    back = ck.load(tmp_path, model, _opt(model))
    assert back["ema"].device.type == "cpu" and torch.equal(back["ema"], extra["ema"]) and back["epoch"] == 3
    moved: list[int] = []

    def cuda(storage: Any, device: int) -> Any:
        moved.append(device)
        return storage

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.UntypedStorage, "cuda", cuda, raising=False)
    (saved,) = tmp_path.glob("v*/extra.pt")
    assert torch.equal(ck.objects.loads(saved.read_bytes(), "extra.pt")["ema"], extra["ema"])
    assert moved == [1], moved


def test_objects_that_cannot_be_read_back_safely_are_refused_when_saved(tmp_path: Path) -> None:
    model = _model()
    opt = _opt(model)
    with pytest.raises(ck.CheckpointError, match=r"extra\['fn'\]\[0\] is of type builtins.function.*weights_only"):
        ck.save(tmp_path, model, opt, extra={"fn": [lambda: 0]})
    scheduler = torch_lr.LambdaLR(opt, lambda step: 1.0)

    class Holder:
        pass

    scheduler.custom = Holder()  # state_dict() holds every attribute
    with pytest.raises(ck.CheckpointError, match=r"scheduler's state_dict\(\)\['custom'\] is of type .*Holder"):
        ck.save(tmp_path, model, opt, scheduler=scheduler)
    assert not tmp_path.joinpath("latest").exists() and not list(tmp_path.glob("v*"))


@pytest.mark.parametrize("version", [2, 1], ids=["objects", "version1"])
def test_a_scheduler_the_state_does_not_fit_is_refused_before_anything_changes(version: int, tmp_path: Path) -> None:
    """Saved with StepLR, loaded with a LambdaLR: refused by class name (version 1, which does not keep it: by
    a trial load), with model, optimizer and scheduler as they were."""
    model = _model()
    opt = _opt(model)
    scheduler = torch_lr.StepLR(opt, step_size=1, gamma=0.5)
    _train(model, opt, scheduler, range(SAVE_AT))
    saved = ck.save(tmp_path, model, opt, scheduler=scheduler)
    if version == 1:
        _as_version_1(saved)
    fresh = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    fresh_opt = _opt(fresh, stage=2)
    fresh_scheduler = torch_lr.LambdaLR(fresh_opt, lambda step: 1.0)
    weights = {k: v.clone() for k, v in fresh.state_dict().items()}
    before = (fresh_opt.state_dict(), fresh_scheduler.state_dict())
    pattern = "StepLR scheduler, scheduler= is a LambdaLR" if version == 2 else "KeyError: 'lr_lambdas'"
    with pytest.raises(ck.CheckpointError, match=pattern):
        ck.load(tmp_path, fresh, fresh_opt, scheduler=fresh_scheduler)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, weights[key]), f"{key} changed"
    after = (fresh_opt.state_dict(), fresh_scheduler.state_dict())
    assert repr(after) == repr(before), "the optimizer or the scheduler changed"


class _LockedStepLR(torch_lr.StepLR):
    """A scheduler that cannot be deep-copied (it holds a lock)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        super().__init__(opt, step_size=1, gamma=0.5)
        self.lock = threading.Lock()

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in super().state_dict().items() if k != "lock"}


def test_a_scheduler_that_cannot_be_copied_still_loads(tmp_path: Path) -> None:
    """The trial load needs a copy of the scheduler; one that cannot be copied is loaded untried, as before."""
    model = _model()
    opt = _opt(model)
    scheduler = _LockedStepLR(opt)
    _train(model, opt, scheduler, range(SAVE_AT))
    ck.save(tmp_path, model, opt, scheduler=scheduler)
    fresh_model = _model()
    fresh_opt = _opt(fresh_model)
    fresh = _LockedStepLR(fresh_opt)
    ck.load(tmp_path, fresh_model, fresh_opt, scheduler=fresh)
    assert fresh.last_epoch == SAVE_AT and fresh_opt.param_groups[0]["lr"] == scheduler.get_last_lr()[0]
