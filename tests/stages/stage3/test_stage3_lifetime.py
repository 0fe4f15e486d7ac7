"""ZeRO stage 3: what the optimizer holds and when it lets go. Deleting the optimizer and the model frees both, the
parameters and the files under ``nvme_path``."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

import zero_kernels.optim as zo

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
