"""zero_optimization keys that are parsed into ZeroOptions but that no stage acts on (overlap_comm,
contiguous_gradients, reduce_scatter, stage3_max_reuse_distance): listed among the keys without effect when given,
at WARNING where the value asks for what the stages do not do (DeepSpeed's overlap_comm false and
contiguous_gradients false lower its backward's peak memory; here they changed nothing and said nothing)."""

from __future__ import annotations

import logging
from typing import Any, Optional

import pytest
from torch import nn

import zero_kernels as zk
from zero_kernels.config import ZeroConfig


def _listed(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    found = [r.getMessage() for r in caplog.records if r.levelno == level and "without effect" in r.getMessage()]
    return [key for message in found for key in message.split("zero_kernels: ", 1)[1].split(", ")]


@pytest.mark.parametrize(
    "stage, key, value, level",
    [
        (2, "overlap_comm", False, logging.WARNING),  # stage 2 reduces during backward whatever it says
        (3, "overlap_comm", False, logging.WARNING),
        (1, "overlap_comm", True, logging.WARNING),  # stage 1 reduces at the step
        (2, "overlap_comm", True, logging.INFO),
        (1, "overlap_comm", False, logging.INFO),
        (2, "overlap_comm", "auto", logging.INFO),
        (2, "contiguous_gradients", False, logging.WARNING),
        (3, "contiguous_gradients", True, logging.INFO),
        (2, "reduce_scatter", False, logging.WARNING),
        (0, "reduce_scatter", False, logging.INFO),  # stage 0 all-reduces, as DeepSpeed's stage 0
        (1, "reduce_scatter", True, logging.INFO),
        (3, "stage3_max_reuse_distance", 0, logging.INFO),  # every unit is freed after each use anyway
        (3, "max_reuse_distance", 1e9, logging.INFO),
        (2, "stage3_max_live_parameters", 1e9, None),  # read by stage 3: not listed
    ],
)
def test_inert_key_is_listed_without_effect(
    caplog: pytest.LogCaptureFixture, stage: int, key: str, value: Any, level: Optional[int]
) -> None:
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": stage, key: value}})
    path = f"zero_optimization.{'stage3_' if key == 'max_reuse_distance' else ''}{key}"
    where = {lv for lv in (logging.INFO, logging.WARNING) if path in _listed(caplog, lv)}
    assert where == ({level} if level is not None else set()), caplog.text


def test_absent_inert_keys_are_not_listed(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2}})
    assert _listed(caplog, logging.INFO) + _listed(caplog, logging.WARNING) == []


@pytest.mark.parametrize(
    "stage, given",
    [(stage, {}) for stage in range(4)]
    + [(stage, {"overlap_comm": False}) for stage in range(4)]
    + [(stage, {"offload_optimizer": {"device": "cpu"}}) for stage in range(1, 4)],
)
def test_initialize_lists_the_keys_the_config_gives_once(
    caplog: pytest.LogCaptureFixture, stage: int, given: dict
) -> None:
    """``zk.initialize`` hands the parsed options to ``ShardedFusedAdam``: the keys without effect are listed as the
    config gives them, once, not again as keywords (every inert option, absent from the config, was listed there, at
    WARNING for ``overlap_comm`` at stages 0 and 2)."""
    config = {"zero_optimization": {"stage": stage, **given}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        zk.initialize(nn.Linear(4, 2), config)
    listed = _listed(caplog, logging.INFO) + _listed(caplog, logging.WARNING)
    assert listed == [f"zero_optimization.{key}" for key in given if key == "overlap_comm"], caplog.text
