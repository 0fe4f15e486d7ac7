"""Stand-ins for CUDA streams on a machine without a GPU: what the package does with streams, recorded.

``StandInStream`` records the streams it was made to wait for; ``OnGpu1`` is a CPU tensor that says it lives on
``cuda:1`` (its views and results too) and records the streams the allocator is told of (``record_stream``);
``StandInStreams`` puts a current stream in place of ``torch.cuda.current_stream`` for a test.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

GPU1 = torch.device("cuda", 1)


class StandInStream:
    """A CUDA stream on cuda:1 that records the streams it was made to wait for."""

    def __init__(self, name: str):
        self.name, self.device = name, GPU1
        self.waited_for: list[str] = []

    def wait_stream(self, other: "StandInStream") -> None:
        self.waited_for.append(other.name)


class OnGpu1(torch.Tensor):
    """A CPU tensor that says it lives on cuda:1 (its views and results too); records in ``recorded`` the streams the
    allocator is told of."""

    recorded: list[str] = []

    @property
    def device(self) -> torch.device:
        return GPU1

    @property
    def is_cuda(self) -> bool:
        return True

    @property
    def _base(self) -> Optional[torch.Tensor]:  # torch's gives a plain tensor
        base = super()._base
        return None if base is None else base.as_subclass(OnGpu1)

    def record_stream(self, stream: StandInStream) -> None:
        OnGpu1.recorded.append(stream.name)


class StandInStreams:
    """``torch.cuda.current_stream`` replaced by ``current`` (``first`` at the start), ``OnGpu1.recorded`` emptied."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, first: str, *others: str):
        self.made = {name: StandInStream(name) for name in (first, *others)}
        self.current = self.made[first]
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(OnGpu1, "recorded", [])

    def use(self, name: str) -> StandInStream:
        """Make stream ``name`` current; returns it."""
        self.current = self.made[name]
        return self.current
