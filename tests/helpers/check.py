"""Element-wise comparisons that name the first mismatching elements."""

from __future__ import annotations

import torch


def first_mismatches(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float, k: int = 5) -> str:
    """The first ``k`` elements outside ``|a - e| <= atol + rtol * |e|``, for assertion messages."""
    a, e = actual.detach().double().flatten(), expected.detach().double().flatten()
    bad = ((a - e).abs() > atol + rtol * e.abs()) | (a.isnan() != e.isnan())
    idx = bad.nonzero().flatten()[:k].tolist()
    rows = ", ".join(f"[{i}] {a[i].item():.9g} vs {e[i].item():.9g}" for i in idx)
    return f"{int(bad.sum())} of {a.numel()} elements differ; first: {rows}"


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float = 0.0, what: str = ""
) -> None:
    """Element-wise check that names the first mismatching elements."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().double(), expected.detach().double()
    ok = ((a - e).abs() <= atol + rtol * e.abs()) | (a.isnan() & e.isnan())
    assert bool(ok.all()), f"{what}: {first_mismatches(actual, expected, rtol, atol)}"
