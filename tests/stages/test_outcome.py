"""The step's decision and its outcome (``zero_kernels.stages.outcome``) in one process, against float64 references.

- ``decide``: the global norm ``sqrt(sq) x grad_scale``, the gradient multiplier after clipping
  ``min(1, max_norm / (norm + 1e-6)) x grad_scale`` (a NaN norm does not clip), the skip flag where
  ``sq`` is not finite, with float and tensor gradient scales, clipping on and off;
- ``StepResult``: the values it carries back, ``ready``, pickling (values, not tensors), its repr;
- ``StepCounts``: a step counts for the parameters that had a gradient unless it was skipped,
  once, settled when read or at the next step, and handed to ``on_settle`` in order.
"""

from __future__ import annotations

import math
import pickle
from typing import Optional

import pytest
import torch

from zero_kernels.stages.outcome import Decision, StepCounts, StepResult, clip_coef, decide

SQS = [0.0, 1e-14, 0.04, 2.25, 1e6, math.inf, math.nan]


def _ref(sq: float, grad_scale: float, max_norm: Optional[float]) -> tuple[Optional[float], float]:
    """(norm, multiplier) in float64 as the host once decided them."""
    if max_norm is None:
        return None, grad_scale
    norm = math.sqrt(sq) * grad_scale
    coef = max_norm / (norm + 1e-6)
    return norm, (coef if coef < 1.0 else 1.0) * grad_scale  # NaN < 1 is False: a NaN norm gives 1


@pytest.mark.parametrize("tensor_scale", [False, True], ids=["float scale", "tensor scale"])
@pytest.mark.parametrize("max_norm", [None, 0.5, 1e3])
@pytest.mark.parametrize("sq", SQS)
def test_decide_matches_float64(sq: float, max_norm: Optional[float], tensor_scale: bool) -> None:
    grad_scale = 0.125
    scale = torch.tensor(grad_scale, dtype=torch.float64) if tensor_scale else grad_scale
    d = decide(torch.tensor(sq, dtype=torch.float64), scale, max_norm, check_finite=True)
    norm, multiplier = _ref(sq, grad_scale, max_norm)
    if norm is None:
        assert d.norm is None
    else:
        assert d.norm is not None and d.norm.dtype == torch.float64
        assert d.norm.item() == pytest.approx(norm, rel=1e-15, nan_ok=True)
    assert d.skip is not None and d.skip.dtype == torch.float32 and d.skip.shape == (1,)
    assert d.skip.item() == (0.0 if math.isfinite(sq) else 1.0)
    if isinstance(d.grad_scale, torch.Tensor):
        assert d.grad_scale.dtype == torch.float32 and d.grad_scale.shape == (1,)
        got = d.grad_scale.item()
        assert got == pytest.approx(float(torch.tensor(multiplier, dtype=torch.float32)), rel=0, nan_ok=True)
    else:
        assert not tensor_scale and max_norm is None and d.grad_scale == multiplier


def test_decide_without_statistics() -> None:
    assert decide(None, 0.5, None, check_finite=True) == Decision(None, None, 0.5)
    d = decide(torch.tensor(4.0, dtype=torch.float64), 0.5, None, check_finite=False)
    assert d.norm is None and d.skip is None and d.grad_scale == 0.5
    d = decide(torch.tensor(4.0, dtype=torch.float64), 0.5, 0.1, check_finite=False)
    assert d.skip is None and d.norm.item() == 1.0
    assert d.grad_scale.item() == pytest.approx(0.1 / (1.0 + 1e-6) * 0.5, rel=1e-7)


def test_clip_coef() -> None:
    norms = torch.tensor([0.0, 0.5, 1.0, 4.0, math.inf, math.nan], dtype=torch.float64)
    got = clip_coef(norms, 1.0)
    expected = [min(1.0, 1.0 / (n + 1e-6)) if not math.isnan(n) else 1.0 for n in norms.tolist()]
    assert got.dtype == torch.float64 and got.tolist() == expected


def test_step_result_carries_the_values() -> None:
    r = StepResult(torch.tensor(2.5, dtype=torch.float64), torch.ones(1))
    assert r.ready() and r.grad_norm == 2.5 and r.skipped
    r = StepResult(None, torch.zeros(1))
    assert r.grad_norm is None and not r.skipped and repr(r) == "StepResult(grad_norm=None, skipped=False)"
    r = StepResult(torch.tensor(0.75, dtype=torch.float64))
    assert r.grad_norm == 0.75 and not r.skipped
    assert StepResult().grad_norm is None and not StepResult().skipped
    again = pickle.loads(pickle.dumps(StepResult(torch.tensor(3.0, dtype=torch.float64), torch.ones(1))))
    assert (again.grad_norm, again.skipped, again.skip_flag) == (3.0, True, None)


class _Late(StepResult):
    """A result whose values are not there yet (a GPU's queued copy): ready() says no until released."""

    def __init__(self, skip: bool) -> None:
        super().__init__(None, torch.tensor([float(skip)]))
        self.released = False
        self.reads = 0

    def ready(self) -> bool:
        return self.released

    @property
    def skipped(self) -> bool:
        self.reads += 1
        return super().skipped


def test_step_counts_advance_unless_skipped_settled_once() -> None:
    counts = StepCounts()
    counts.counts = {0: 0, 1: 0, 2: 5}
    seen: list[bool] = []
    counts.on_settle = lambda result: seen.append(result.skipped)
    counts.pending(StepResult(None, torch.zeros(1)), {0, 2})  # ready: settled at once
    assert counts.counts == {0: 1, 1: 0, 2: 6} and counts.unsettled is None and seen == [False]
    late = _Late(skip=True)
    counts.pending(late, {0, 1})
    assert counts.unsettled is not None and late.reads == 0, "a result not ready was read"
    assert counts.settled() == {0: 1, 1: 0, 2: 6} and seen == [False, True]
    assert counts.settled() == {0: 1, 1: 0, 2: 6} and seen == [False, True], "a step settled twice"
    first, second = _Late(skip=False), _Late(skip=False)
    counts.pending(first, {1})
    counts.pending(second, {1, 2})  # the next step settles the one before
    assert counts.counts == {0: 1, 1: 1, 2: 6} and seen == [False, True, False]
    assert repr(second) == "StepResult(pending)"
    second.released = True
    assert counts.settled() == {0: 1, 1: 2, 2: 7} and seen == [False, True, False, False]
