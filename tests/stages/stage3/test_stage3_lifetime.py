"""ZeRO stage 3: what the optimizer holds and when it lets go. Deleting the optimizer and the model frees both, the
parameters and the files under ``nvme_path``; a second optimizer on parameters a stage-3 optimizer holds, or emptied
before it was deleted, is refused before anything changes."""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch import nn

import zero_kernels as zk
import zero_kernels.optim as zo
from tests.helpers.check import assert_close

LR = 1e-2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))


def _offload(device: str, path: Path) -> dict:
    if device == "none":
        return {}
    where = {"device": device, "nvme_path": str(path)} if device == "nvme" else {"device": device}
    return {"offload_optimizer": where, "offload_param": dict(where, max_in_cpu=0) if device == "nvme" else where}


def _opt(model: nn.Module, device: str, path: Path, threshold: int = 0) -> zo.ShardedFusedAdam:
    return zo.ShardedFusedAdam(model, lr=LR, stage=3, reduce_bucket_size=256,
                               stage3_param_persistence_threshold=threshold, **_offload(device, path))  # fmt: skip


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
    return model(x).square().mean()


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    _loss(model, step).backward()
    opt.step()
    opt.zero_grad()


def _files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


@pytest.mark.parametrize("device", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("use", ["built", "trained", "forward kept"])
def test_optimizer_model_and_files_freed_when_deleted(tmp_path: Path, device: str, use: str) -> None:
    """The gradient hooks on the parameters, the model's hooks and those on a kept forward's graph hold the
    optimizer weakly: ``del model, opt`` frees both (a loss still referenced keeps only the model, through its
    graph), and the files under ``nvme_path`` go."""
    model = _model()
    opt = _opt(model, device, tmp_path)
    loss = None
    if use == "trained":
        for step in range(2):
            _step(model, opt, step)
    if use == "forward kept":
        loss = _loss(model, 0)
    assert bool(_files(tmp_path)) == (device == "nvme")
    freed = [weakref.ref(x) for x in (opt, model, next(model.parameters()))]
    del model, opt
    gc.collect()
    assert freed[0]() is None, "the optimizer outlived its deletion"
    del loss
    gc.collect()
    assert [ref() is None for ref in freed] == [True, True, True]
    assert _files(tmp_path) == []


@contextlib.contextmanager
def _collector_off() -> Iterator[None]:
    """Python's cycle collector off inside (after one run): what is freed there, reference counting freed."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_del_removes_the_files_at_once(tmp_path: Path) -> None:
    """``del opt`` frees the pipeline and removes the files under ``nvme_path`` at once, not when Python's
    collector runs: the parameter files' read-in (a closure on each unit) and the gradient files' write callbacks
    held them in reference cycles."""
    model = _model()
    opt = _opt(model, "nvme", tmp_path)
    _step(model, opt, 0)
    pipeline = weakref.ref(opt._pipeline)
    with _collector_off():
        del opt
        assert pipeline() is None, "the pipeline waits for the collector"
        assert _files(tmp_path) == []


def test_del_frees_a_pipeline_with_frozen_units_at_once(tmp_path: Path) -> None:
    """A frozen parameter partitioned in a unit of its own: ``del opt`` frees the pipeline at once too (the frozen
    units held its ``name_of`` method, a reference cycle that kept the pipeline until Python's collector ran)."""
    model = _model()
    model[2].weight.requires_grad_(False)
    opt = _opt(model, "none", tmp_path)
    _step(model, opt, 0)
    assert opt._pipeline._frozen, "no frozen unit"
    pipeline = weakref.ref(opt._pipeline)
    with _collector_off():
        del opt
        assert pipeline() is None, "the pipeline waits for the collector"


def test_model_of_a_deleted_optimizer_says_its_values_are_gone(tmp_path: Path) -> None:
    """The model outlives its stage-3 optimizer: the shards, the state and the files go with the optimizer, and
    the emptied parameters say so wherever they are used, and refuse a new optimizer."""
    model = _model()
    opt = _opt(model, "nvme", tmp_path)
    _step(model, opt, 0)
    read = model[0].weight.detach()  # taken while the parameter was freed: empty
    freed = weakref.ref(opt)
    del opt
    gc.collect()
    assert freed() is None and _files(tmp_path) == []
    gone = "the stage-3 optimizer that kept its shards was deleted"
    with pytest.raises(RuntimeError, match=gone):
        _loss(model, 1)
    with pytest.raises(RuntimeError, match=gone):
        read.sum()
    with pytest.raises(RuntimeError, match=f"empty tensor for '0.weight': {gone}"):
        model.state_dict()
    with pytest.raises(ValueError, match=f"parameter '0.weight' holds no values: {gone}"):
        zo.ShardedFusedAdam(model, stage=2)
    config = {"optimizer": {"type": "AdamW", "params": {"lr": LR}}, "zero_optimization": {"stage": 3}}
    with pytest.raises(ValueError, match=f"parameter '0.weight' holds no values: {gone}"):
        zk.initialize(model, config)


@pytest.mark.parametrize("collect", [False, True])
def test_backward_of_a_forward_kept_past_its_optimizer_says_so(tmp_path: Path, collect: bool) -> None:
    """A loss made before its stage-3 optimizer was deleted: its backward would read the gathered parameters the
    optimizer freed; it says so (torch's 'setStorage: ... out of bounds for storage of size 0' before), whether
    the collector has run or not."""
    model = _model()
    opt = _opt(model, "none", tmp_path)
    loss = _loss(model, 0)
    del opt
    if collect:
        gc.collect()
    with pytest.raises(RuntimeError, match="backward of a forward run before its stage-3 optimizer was deleted"):
        loss.backward()


def test_model_used_after_del_while_a_kept_error_holds_its_hooks_says_so(tmp_path: Path) -> None:
    """An error raised inside stage 3's hooks (a freed parameter read outside the forward) and kept, as IPython's
    sys.last_traceback keeps it, holds the hooks' scheduler past ``del opt``: the next forward raised
    "AttributeError: 'NoneType' object has no attribute 'disk_params'" instead of saying the optimizer is gone."""
    model = _model()
    opt = _opt(model, "none", tmp_path)
    _step(model, opt, 0)
    with pytest.raises(RuntimeError, match="outside the forward") as kept:
        model[0].weight.sum()
    del opt
    with pytest.raises(RuntimeError, match="the stage-3 optimizer that kept its shards was deleted"):
        _loss(model, 1)
    del kept


def _second(model: nn.Module, how: str) -> None:
    if how == "initialize bf16":  # would cast the model first
        config = {"optimizer": {"type": "AdamW", "params": {"lr": LR}}, "bf16": {"enabled": True},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # fmt: skip
        zk.initialize(model, config)
    else:
        zo.ShardedFusedAdam(model, lr=LR, stage=int(how[-1]))


@pytest.mark.parametrize("threshold", [0, 10**6])  # every parameter emptied between uses; every one kept whole
@pytest.mark.parametrize("how", ["initialize bf16", "stage 3", "stage 2"])
def test_second_optimizer_on_a_held_model_is_refused(tmp_path: Path, threshold: int, how: str) -> None:
    """Refused naming the parameter, before anything changed: the first optimizer trains on next to
    ``torch.optim.AdamW``."""
    model = _model()
    ref = copy.deepcopy(model)
    opt, ref_opt = _opt(model, "none", tmp_path, threshold), torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(3):
        if step == 1:
            with pytest.raises(ValueError, match="parameter '0.weight' is held \\(sharded\\) by another stage-3"):
                _second(model, how)
        _step(model, opt, step)
        _step(ref, ref_opt, step)
    with opt.gathered_params():
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            assert p.dtype == torch.float32, name
            assert_close(p, r, rtol=1e-5, atol=1e-6 * r.detach().abs().max().item(), what=name)


def _hooks(model: nn.Module) -> int:
    """Hooks on the model's modules and parameters, every kind a stage-3 optimizer puts there."""
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks")
    on_modules = sum(len(getattr(m, kind)) for m in model.modules() for kind in kinds)
    return on_modules + sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def test_hooks_of_deleted_optimizers_come_off_the_model(tmp_path: Path) -> None:
    """A model trained by one stage-3 optimizer after another (every parameter kept whole, so the model keeps its
    values): each deleted optimizer's hooks come off the model, as at stages 0-2, and the model trains on next to
    ``torch.optim.AdamW``. They stayed, doing nothing: 19 more hooks on this model per optimizer, each called at every
    forward and backward."""
    model = _model()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    step = 0
    for _ in range(3):
        opt = _opt(model, "none", tmp_path, threshold=10**6)  # a new optimizer starts its moments afresh
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        for _ in range(2):
            _step(model, opt, step)
            _step(ref, ref_opt, step)
            step += 1
        del opt
        gc.collect()
        assert _hooks(model) == 0
    for p, r in zip(model.parameters(), ref.parameters()):
        assert_close(p, r, rtol=1e-5, atol=1e-6 * r.detach().abs().max().item())


def test_emptied_model_keeps_only_the_guard_that_says_so(tmp_path: Path) -> None:
    """Of a deleted optimizer's hooks on a model it emptied, only the ``state_dict()`` guard (it says the values are
    gone) and the ``load_state_dict()`` pre-hook that lets a load fill the emptied parameters stay, and the tables
    of emptied parameters, keyed by ``id``, forget the parameters once they are collected (a search building a model
    and an optimizer after another left an entry per parameter)."""
    from zero_kernels.stages.stage3 import guard

    tables = (guard._on_use, guard._on_read_use, guard._epoch, guard._reads)
    before = [len(t) for t in tables]
    model = _model()
    opt = _opt(model, "none", tmp_path)
    _step(model, opt, 0)
    model[0].weight.detach()  # a read of an emptied parameter: an entry in ``_reads``
    del opt
    gc.collect()
    assert _hooks(model) == 2
    with pytest.raises(RuntimeError, match="the stage-3 optimizer that kept its shards was deleted"):
        model.state_dict()
    del model
    gc.collect()
    assert [len(t) for t in tables] == before


def _give_values(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = values[name].clone()


def _assert_trained_as(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert_close(p, r, rtol=1e-5, atol=1e-6 * r.detach().abs().max().item(), what=name)


@pytest.mark.parametrize("copy_how", ["deepcopy", "torch.save"])
def test_emptied_model_given_its_values_again_copies(tmp_path: Path, copy_how: str) -> None:
    """``copy.deepcopy(model)`` or ``torch.save(model)`` as the first use of a model whose deleted stage-3 optimizer
    emptied it and that was given its values again (``p.data = value``): the copy took the parameter for an ordinary
    one again, and then raised "AttributeError: 'Parameter' object has no attribute '_zk_original'"."""
    model = _model()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = _opt(model, "none", tmp_path)
    _step(model, opt, 0)
    del opt
    _give_values(model, start)
    if copy_how == "deepcopy":
        copied = copy.deepcopy(model)
    else:
        torch.save(model, tmp_path / "model.pt")
        copied = torch.load(tmp_path / "model.pt", weights_only=False)
    for name, value in copied.state_dict().items():
        assert torch.equal(value, start[name]), name


def _model_and_reference() -> tuple[nn.Module, dict[str, torch.Tensor], nn.Module]:
    """A model, its starting values, and a copy of it trained two steps by ``torch.optim.AdamW``."""
    model = _model()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(2):
        _step(ref, ref_opt, step)
    return model, start, ref


def test_emptied_model_given_its_values_again_trains_on(tmp_path: Path) -> None:
    """A model reused by one stage-3 optimizer after another (a search that builds the model once): once a deleted
    optimizer emptied it, ``p.data = value`` of every parameter makes it an ordinary model again, and the next
    optimizer trains it next to ``torch.optim.AdamW``. Each use still raised that the parameter holds no values, and
    each optimizer left its ``state_dict()`` guard on the model."""
    from zero_kernels.stages.stage3 import guard

    tables = (guard._on_use, guard._on_read_use, guard._epoch, guard._reads)
    before = [len(t) for t in tables]
    model, start, ref = _model_and_reference()
    _give_values(model, start)
    for collected_first in (True, False, True):  # the values given after or before the collector took the optimizer
        opt = _opt(model, "none", tmp_path)
        for step in range(2):
            _step(model, opt, step)
        with opt.gathered_params():
            _assert_trained_as(model, ref)
        gc.disable()
        try:
            del opt
            if collected_first:
                gc.collect()
            _give_values(model, start)
        finally:
            gc.enable()
        gc.collect()
        assert torch.equal(model.state_dict()["0.weight"], start["0.weight"])
        assert _loss(model, 0).isfinite()
        assert _hooks(model) <= 2, "a guard per deleted optimizer stayed on the model"
    del model
    gc.collect()
    assert [len(t) for t in tables] == before


def test_emptied_model_takes_a_state_dict_and_trains_on(tmp_path: Path) -> None:
    """A model reused by one stage-3 optimizer after another, reset with ``model.load_state_dict(start)`` (a search
    that builds its model once and loads its initial weights for each trial): once a deleted optimizer emptied it,
    the load fills it as it fills an ordinary model, and the next optimizer trains it next to AdamW. torch refused
    the load ('size mismatch ... torch.Size([0])')."""
    model, start, ref = _model_and_reference()
    for trial in range(2):
        opt = _opt(model, "none", tmp_path)
        for step in range(2):
            _step(model, opt, step)
        with opt.gathered_params():
            _assert_trained_as(model, ref)
        del opt
        gc.collect()
        model.load_state_dict(start)
        assert all(torch.equal(v, start[k]) for k, v in model.state_dict().items()), f"trial {trial}"
    assert _hooks(model) <= 2, "a guard per deleted optimizer stayed on the model"
