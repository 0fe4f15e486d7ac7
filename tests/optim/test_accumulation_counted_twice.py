"""Accumulation counted in two places is said once: several backward passes reach each ``step()`` call while the
optimizer counts the calls as ``gradient_accumulation_steps`` micro-steps (PyTorch Lightning's
``accumulate_grad_batches`` beside the config's count: each update then takes k x N batches, and there are k times
fewer updates, with no error). One backward per call, or a count of 1, says nothing."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zero_kernels as zk

SAID = "several backward passes reached this step() call"


def _run(stage: int, count: int, backwards: int, calls: int = 4) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    extra = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=stage, gradient_accumulation_steps=count, **extra)
    for _ in range(calls):
        for _ in range(backwards):
            model(torch.randn(2, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_several_backward_passes_per_micro_step_are_said_once(stage: int, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        _run(stage, count=2, backwards=2)
    assert [r.getMessage().count(SAID) for r in caplog.records if SAID in r.getMessage()] == [1]
    assert "gradient_accumulation_steps=2" in caplog.text and "accumulate_grad_batches" in caplog.text


@pytest.mark.parametrize(("count", "backwards"), [(2, 1), (1, 2)])
def test_one_count_says_nothing(count: int, backwards: int, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        for stage in (0, 2, 3):
            _run(stage, count=count, backwards=backwards)
    assert SAID not in caplog.text


def test_a_backward_whose_gradients_are_dropped_counts_for_no_call(caplog: pytest.LogCaptureFixture) -> None:
    """A batch that failed and was dropped with ``zero_grad()`` (an out-of-memory retry) before the micro-step's
    backward: one backward reaches the call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=2, gradient_accumulation_steps=2)
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        for _ in range(2):  # windows of 2 micro-steps, a batch dropped before each
            model(torch.randn(2, 4)).square().mean().backward()
            opt.zero_grad()  # at micro-step 0 it drops the batch
            for _ in range(2):
                model(torch.randn(2, 4)).square().mean().backward()
                opt.step()
    assert SAID not in caplog.text
