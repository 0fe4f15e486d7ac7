"""The super_offload benchmark at a tiny size: both cases and providers timed, every update run during backward
kept (nothing between backward and the step changes what it read), the speedup taken over the rounds; and the
emulated device's wait in backward only."""

from __future__ import annotations

import pytest
import torch

from benchmarks import super_offload


@pytest.mark.distributed
@pytest.mark.ext
def test_subject_at_a_tiny_size() -> None:
    rows = super_offload.run(quick=True, shape=(32, 2, 4, 1), rounds=2)
    assert len(rows) == 4 and all("step_ms" in r for r in rows), [r.get("error") for r in rows]
    off, on = rows[0::2], rows[1::2]
    assert all(r["kept"] is None for r in off) and all(r["kept"] == 1.0 for r in on)
    assert all("speedup" in r and r["low"] <= r["speedup"] <= r["high"] for r in on)
    assert [r["case"].split(", ")[1] for r in on] == list(super_offload.CASES)
    assert [line["case"] for line in super_offload.summary(rows)] == [r["case"] for r in on]


def test_the_emulated_device_waits_in_backward_only(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    monkeypatch.setattr(super_offload.time, "sleep", waits.append)
    layer = super_offload.Layer(4, wait=True)
    x = torch.randn(2, 4, requires_grad=True)
    y = layer(x)
    assert waits == [] and torch.equal(y, torch.tanh(layer.linear(x)))
    y.sum().backward()
    assert waits == [super_offload.DEVICE_MS / 1e3] and x.grad is not None
