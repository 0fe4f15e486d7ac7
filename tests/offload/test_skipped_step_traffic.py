"""A step skipped for a non-finite gradient or an fp16 overflow leaves the offload tier alone where the skip flag is
in host memory (``offloaded.skipped_on_host``): nothing copied down or up, no state read or written, as DeepSpeed
returns early; the weights and state stay those of the same run without offload, bit for bit (``pair_case``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zero_kernels.optim as zo
from tests.offload.exactness import copying, pair_case


def _per_step(rank: int, stage: int, dtype: torch.dtype, offload: dict, params: dict | None) -> list[tuple]:
    """(skipped, tier traffic of the step) for each step of ``pair_case``'s schedule."""
    seen: list[tuple] = []
    last = {"traffic": {}, "skipped": 0}

    def record(opt: zo.ShardedFusedAdam) -> None:
        traffic = opt._pipeline.tier.traffic()
        delta = {k: v - last["traffic"].get(k, 0) for k, v in traffic.items() if k != "init"}
        seen.append((opt.skipped_steps > last["skipped"], delta))
        last.update(traffic=traffic, skipped=opt.skipped_steps)

    with copying():
        pair_case(rank, 1, stage, dtype, offload, params, during=record)
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "stage, device, params", [(1, "cpu", None), (2, "nvme", None), (3, "cpu", None), (3, "cpu", "cpu")]
)
def test_a_skipped_step_moves_nothing_through_the_tier(
    stage: int, device: str, params: str | None, dtype: torch.dtype, tmp_path: Path
) -> None:
    offload = {"device": device, "nvme_path": str(tmp_path)} if device == "nvme" else {"device": device}
    steps = _per_step(0, stage, dtype, offload, None if params is None else {"device": params})
    skips = [skipped for skipped, _ in steps]
    assert any(skips) and (dtype == torch.float16 or not all(skips)), steps  # fp16: every step overflows here
    for i, (skipped, traffic) in enumerate(steps[1:], 1):  # the first step writes AMSGrad's new maximum into files
        moved = sum(traffic.values())
        assert (moved == 0) == skipped, f"step {i} ({'skipped' if skipped else 'applied'}): tier traffic {traffic}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "stage, device, params, ratio",
    [
        (1, "cpu", None, 1.0),
        (2, "cpu", None, 0.5),
        (2, "nvme", None, 1.0),
        (3, "cpu", "cpu", 1.0),
        (3, "nvme", None, 1.0),
    ],
)
def test_a_skip_flag_on_the_device_runs_the_host_adam_which_changes_nothing(
    stage: int,
    device: str,
    params: str | None,
    ratio: float,
    dtype: torch.dtype,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GPU's branch, which the CPU never takes by itself: the skip flag is a device tensor
    (``skipped_on_host`` False), so a skipped step copies through the tier and runs the host Adam with the flag,
    and edits are found by the fingerprint (``HostTier.bitwise`` False). Weights and state stay those of the run
    without offload bit for bit, and the skipped steps did move bytes (the branch ran)."""
    from zero_kernels.offload import HostTier
    from zero_kernels.stages import offloaded

    monkeypatch.setattr(offloaded, "skipped_on_host", lambda decision: False)
    monkeypatch.setattr(HostTier, "bitwise", lambda self, device: False)
    offload = {"device": device, "ratio": ratio}
    if device == "nvme":
        offload["nvme_path"] = str(tmp_path)
    steps = _per_step(0, stage, dtype, offload, None if params is None else {"device": params})
    assert any(skipped for skipped, _ in steps), steps
    assert all(sum(traffic.values()) > 0 for _, traffic in steps[1:]), steps
