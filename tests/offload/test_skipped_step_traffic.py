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
