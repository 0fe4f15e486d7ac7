"""A checkpoint names tensors as the uncompiled model does: saved from ``torch.compile(model)`` (whose ``state_dict``
keys start with ``_orig_mod.``) it loads into the model uncompiled, and back; it was refused as 'saved from another
model' both ways."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import zero_kernels.checkpoint as ck
import zero_kernels.optim as zo


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Sequential(nn.Linear(6, 1)))


def _compiled(model: nn.Module, part: str) -> nn.Module:
    """The model, compiled whole, one module of it compiled, or not compiled."""
    if part == "whole":
        return torch.compile(model, backend="eager")
    if part == "inner":
        model[2] = torch.compile(model[2], backend="eager")
    return model


def _snapshot(model: nn.Module, opt: zo.ShardedFusedAdam) -> tuple[list[torch.Tensor], dict]:
    with opt.gathered_params():
        weights = [p.detach().clone() for p in model.parameters()]
    return weights, opt.full_state_dict()


@pytest.mark.slow  # Dynamo's tracing
@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize(("saved", "loading"), [("whole", "none"), ("none", "whole"), ("inner", "whole")])
def test_compiled_and_uncompiled_models_share_checkpoints(tmp_path: Path, stage: int, saved: str, loading: str) -> None:
    model = _compiled(_model(0), saved)
    opt = zo.ShardedFusedAdam(model, lr=1e-2, stage=stage)
    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    ck.save(tmp_path, model, opt)
    expected = _snapshot(model, opt)
    other = _compiled(_model(1), loading)
    other_opt = zo.ShardedFusedAdam(other, lr=1e-2, stage=stage)
    ck.load(tmp_path, other, other_opt)
    weights, state = _snapshot(other, other_opt)
    assert all(torch.equal(a, b) for a, b in zip(weights, expected[0]))
    assert all(torch.equal(state["state"][i][k], v) for i, s in expected[1]["state"].items() for k, v in s.items())


def _as_saved_before(version: Path) -> None:
    """The metadata as versions that kept ``_orig_mod.`` in a compiled model's names wrote it."""
    path = version / "metadata.json"
    meta = json.loads(path.read_text())

    def key(k: str) -> str:
        return "model/_orig_mod." + k[len("model/") :] if k.startswith("model/") else k

    meta["tensors"] = {key(k): v for k, v in meta["tensors"].items()}
    meta["model"] = {"_orig_mod." + name: key(k) for name, k in meta["model"].items()}
    for p in meta["params"]:
        p["name"] = "_orig_mod." + p["name"]
    path.write_text(json.dumps(meta))


@pytest.mark.slow  # Dynamo's tracing
@pytest.mark.parametrize("loading", ["whole", "none"])
def test_a_checkpoint_with_compiled_names_still_loads(tmp_path: Path, loading: str) -> None:
    model = _compiled(_model(0), "whole")
    opt = zo.ShardedFusedAdam(model, lr=1e-2, stage=3)
    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    version = ck.save(tmp_path, model, opt)
    _as_saved_before(version)
    expected = _snapshot(model, opt)
    other = _compiled(_model(1), loading)
    other_opt = zo.ShardedFusedAdam(other, lr=1e-2, stage=3)
    ck.load(tmp_path, other, other_opt)
    weights, state = _snapshot(other, other_opt)
    assert all(torch.equal(a, b) for a, b in zip(weights, expected[0]))
    assert all(torch.equal(state["state"][i][k], v) for i, s in expected[1]["state"].items() for k, v in s.items())
