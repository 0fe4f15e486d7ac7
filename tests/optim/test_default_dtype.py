"""A default dtype set by the user (``torch.set_default_dtype``: bf16 or fp16 before building an LLM, float64 in
scientific code) changes nothing in the state: the step counts read from ``opt.state`` and ``full_state_dict()`` are
``torch.optim.AdamW``'s dtype (float32, float64 under a float64 default) and ``zk.checkpoint.consolidate`` writes
them in float32, so a count past 256 is not rounded to a bf16 or fp16 value (a resume from it would take the next
steps' bias corrections at another step than AdamW)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import zero_kernels as zk
import zero_kernels.optim as zo


@pytest.fixture(params=[torch.bfloat16, torch.float16, torch.float64], ids=str)
def default_dtype(request: pytest.FixtureRequest) -> Iterator[torch.dtype]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(request.param)
    yield request.param
    torch.set_default_dtype(before)


def test_step_counts_keep_adamws_dtype(default_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2).float()
    ref = nn.Linear(3, 2).float()
    opt = zo.ShardedFusedAdam(model.parameters(), lr=1e-2, stage=1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for m, o in ((model, opt), (ref, ropt)):
        m(torch.ones(1, 3, dtype=torch.float32)).sum().backward()
        o.step()
    want = ropt.state[ref.weight]["step"].dtype  # AdamW's own: float32, float64 under a float64 default
    opt.state[model.weight]["step"] = torch.tensor(2049.0, dtype=torch.float64)  # beyond fp16's and bf16's integers
    got = {"opt.state": opt.state[model.weight]["step"], "full_state_dict()": opt.full_state_dict()["state"][0]["step"]}
    for what, step in got.items():
        assert (step.dtype, step.item()) == (want, 2049.0), what


def test_consolidate_writes_exact_step_counts(default_dtype: torch.dtype, tmp_path: Path) -> None:
    model = nn.Linear(3, 2).float()
    opt = zo.ShardedFusedAdam(model.parameters(), lr=1e-2, stage=1)
    model(torch.ones(1, 3, dtype=torch.float32)).sum().backward()
    opt.step()
    opt.state[model.weight]["step"] = torch.tensor(2049.0, dtype=torch.float64)
    zk.checkpoint.save(tmp_path / "ckpt", model, opt)
    zk.checkpoint.consolidate(tmp_path / "ckpt", tmp_path / "out.pt")
    step = torch.load(tmp_path / "out.pt")["optimizer"]["state"][0]["step"]
    assert (step.dtype, step.item()) == (torch.float32, 2049.0)
