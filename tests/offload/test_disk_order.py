"""The disk tier under an I/O engine whose requests finish in a random order (``reordering``): random sequences of
its calls (steps, some cut short; spills, state reads, AMSGrad's maximum added) read back, at every load and at
the end, the values last stored, spilled or written, also where requests fail and the calls go on as training
would (a step that raised is followed by the next, a state read or spill is made again); and training with the
state on disk (and stage 3's gradient and parameter files) stays bit for bit the same run without offload."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import pytest
import torch

from tests.offload.exactness import pair_case
from tests.offload.reordering import Reordering, reorder
from zero_kernels.config.offload import AioConfig, OffloadOptimizerConfig
from zero_kernels.offload import DiskTier

KINDS = ("exp_avg", "exp_avg_sq")


def _again(call: Callable[[], None]) -> None:
    """``call`` until it does not raise ``OSError`` (the disk failing now and then)."""
    while True:
        try:
            return call()
        except OSError:
            pass


class _Sequence:
    """Random calls of a disk tier of 2 buffers next to what its files must hold (``expected``: kind -> values)."""

    def __init__(self, tier: DiskTier, rnd: random.Random):
        self.tier, self.rnd, self.made = tier, rnd, 0
        self.groups = {key: [rnd.randint(1, 16) for _ in range(rnd.randint(1, 4))] for key in (0, 1)}
        self.expected = {key: {kind: torch.zeros(sum(n)) for kind in KINDS} for key, n in self.groups.items()}
        for key, numels in self.groups.items():
            tier.add_buffer(key, numels, KINDS)
        self.wrong: list[str] = []

    def fresh(self, numel: int) -> torch.Tensor:
        self.made += 1
        return torch.arange(numel, dtype=torch.float32) + 1000 * self.made

    def step(self, cut: bool) -> None:
        """Every sub-group loaded (once or twice: the buckets of one), checked and changed, then stored (``cut``: the
        last not stored, as an update that raised leaves it); a request that fails ends the step."""
        order = [(key, g) for key in self.groups for g in range(len(self.groups[key]))]
        try:
            for i, (key, g) in enumerate(order):
                at, numel = sum(self.groups[key][:g]), self.groups[key][g]
                for _ in range(self.rnd.randint(1, 2)):
                    loaded = self.tier.load(key, g, tuple(self.expected[key]))
                    for kind, t in loaded.items():
                        if not torch.equal(t, self.expected[key][kind][at : at + numel]):
                            self.wrong.append(f"load {key}.{g} {kind}: {t.tolist()} for {self.expected[key][kind]}")
                        self.expected[key][kind][at : at + numel] = self.fresh(numel)
                        t.copy_(self.expected[key][kind][at : at + numel])
                if not (cut and i == len(order) - 1):
                    self.tier.store(key, g)
            self.tier.finish()
        except OSError:
            pass

    def spill(self, key: int) -> None:
        values = {kind: self.fresh(sum(self.groups[key])) for kind in self.expected[key]}
        _again(lambda: self.tier.spill(key, {kind: t.clone() for kind, t in values.items()}))
        self.expected[key] = values

    def fill(self, key: int) -> None:
        read = {kind: torch.empty(sum(self.groups[key])) for kind in self.expected[key]}
        _again(lambda: self.tier.fill(key, read))
        for kind, t in read.items():
            if not torch.equal(t, self.expected[key][kind]):
                self.wrong.append(f"fill {key} {kind}: {t.tolist()} for {self.expected[key][kind]}")

    def add_max(self, key: int) -> None:
        if "max_exp_avg_sq" not in self.expected[key]:
            _again(lambda: self.tier.add_zeros(key, "max_exp_avg_sq"))
            self.expected[key]["max_exp_avg_sq"] = torch.zeros(sum(self.groups[key]))

    def run(self, calls: int) -> None:
        for _ in range(calls):
            what, key = (
                self.rnd.choice(("step", "step", "step", "cut", "spill", "fill", "add_max")),
                self.rnd.randrange(2),
            )
            if what in ("step", "cut"):
                self.step(cut=what == "cut")
            else:
                getattr(self, what)(key)


def _sequence(path: Path, seed: int, engine: Reordering) -> list[str]:
    rnd = random.Random(seed)
    config = OffloadOptimizerConfig(device="nvme", nvme_path=str(path), buffer_count=rnd.randint(1, 4),
                                    pipeline_read=rnd.random() < 0.5, pipeline_write=rnd.random() < 0.5)  # fmt: skip
    tier = DiskTier(config, AioConfig(), rank=0, sub_group_size=8)
    sequence = _Sequence(tier, rnd)
    try:
        sequence.run(10)
        engine.fail = 0.0
        for key in sequence.groups:
            sequence.fill(key)
    finally:
        _again(tier.close)
    return sequence.wrong


@pytest.mark.parametrize("seed", range(12))
def test_random_calls_read_back_what_was_written_last(seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    engine = reorder(monkeypatch, seed)
    assert _sequence(tmp_path, seed, engine) == []


@pytest.mark.parametrize("seed", range(24))
def test_random_calls_with_failing_requests_lose_no_update(seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    engine = reorder(monkeypatch, seed, fail=0.1)
    assert _sequence(tmp_path, seed, engine) == []


@pytest.mark.parametrize(
    "stage, dtype, offload",
    [
        (2, torch.bfloat16, {"buffer_count": 1, "pipeline_read": True, "pipeline_write": True}),
        (2, torch.float16, {"buffer_count": 3, "pipeline_read": True, "pipeline_write": False, "ratio": 0.5}),
        (3, torch.bfloat16, {"buffer_count": 2, "pipeline_read": False, "pipeline_write": True}),
        (3, torch.float32, {"buffer_count": 4, "pipeline_read": True, "pipeline_write": True}),
    ],
)
def test_training_matches_plain_whatever_order_requests_finish_in(
    stage: int, dtype: torch.dtype, offload: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``exactness.pair_case`` (accumulation, clipping, a skipped step, fp16 loss scaling) with the state on disk in
    sub-groups of 32 elements, compared bit for bit after every step; at stage 3 the gradient shards in files too,
    and the parameter shards in the last case."""
    reorder(monkeypatch, stage + len(offload))
    params = {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2, "max_in_cpu": 0}
    pair_case(0, 1, stage, dtype, {"device": "nvme", "nvme_path": str(tmp_path), **offload},
              params if dtype == torch.float32 else None)  # fmt: skip
