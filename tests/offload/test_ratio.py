"""``offload_optimizer.ratio``: the share of the state in the tier, whole buckets, shown by ``memory_report``
(the exactness against no offload is in ``test_offload_exact``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zero_kernels as zk
from zero_kernels.offload import HostTier
from zero_kernels.stages import placement

BUCKET = 256  # elements: the model's 3.4k parameters make 14 buckets
KINDS = 3  # fp32 parameters with AMSGrad: exp_avg, exp_avg_sq, max_exp_avg_sq (no separate master)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(40, 48), torch.nn.Tanh(), torch.nn.Linear(48, 30), torch.nn.Linear(30, 1)
    )


def _step(model: torch.nn.Module, opt: zk.ShardedFusedAdam) -> None:
    model(torch.randn(4, 40)).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("ratio", [0.3, 0.9])
@pytest.mark.parametrize("stage", [1, 2])
def test_memory_report_shows_the_share_on_the_device(stage: int, ratio: float, device: str, tmp_path: Path) -> None:
    model = _model()
    offload = {"device": device, "ratio": ratio, **({"nvme_path": str(tmp_path)} if device == "nvme" else {})}
    opt = zk.ShardedFusedAdam(model, stage=stage, reduce_bucket_size=BUCKET, amsgrad=True, offload_optimizer=offload)
    (buf,) = opt._pipeline.buffers
    shard, kept = buf.layout.shard_numel, placement.cut(buf)
    bucket = buf.layout.buckets[0].shard_numel
    assert (1 - ratio) * shard - bucket < kept <= (1 - ratio) * shard, (
        kept,
        shard,
    )  # whole buckets, >= ratio offloaded
    _step(model, opt)
    report = opt.memory_report()
    assert report["optimizer"] == kept * KINDS * 4, report
    tier_state = (shard - kept) * KINDS * 4
    if device == "nvme":
        assert report["disk"] == tier_state, report
    else:
        assert report["disk"] == 0 and report["host"] >= tier_state, report
    opt.state_dict()  # a read of the state brings it whole into host memory until the next step
    assert opt.memory_report()["optimizer"] == 0
    _step(model, opt)
    assert opt.memory_report()["optimizer"] == kept * KINDS * 4
    opt._pipeline.close()


def test_a_small_share_on_the_device_keeps_whole_buckets_in_the_tier() -> None:
    """Under one bucket's worth of the state for the device: all of it in the tier, as ratio 1."""
    opt = zk.ShardedFusedAdam(
        _model(), stage=1, reduce_bucket_size=10**6, offload_optimizer={"device": "cpu", "ratio": 0.5}
    )
    (buf,) = opt._pipeline.buffers
    assert len(buf.layout.buckets) == 1 and placement.cut(buf) == 0
    assert opt.memory_report()["optimizer"] == 0


@pytest.mark.parametrize("stage", [1, 2])
def test_only_the_tiers_share_crosses_the_bus(stage: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16: 2 bytes per element of the tier's part down (the gradient) and 2 up (the parameter), none for the
    device's part (the tier copying as from a GPU: ``HostTier.share_host`` off)."""
    monkeypatch.setattr(HostTier, "share_host", False)
    model = _model().to(torch.bfloat16)
    opt = zk.ShardedFusedAdam(model, stage=stage, reduce_bucket_size=BUCKET,
                              offload_optimizer={"device": "cpu", "ratio": 0.3})  # fmt: skip
    (buf,) = opt._pipeline.buffers
    tier = opt._pipeline.tier
    assert 0 < placement.cut(buf) < buf.layout.shard_numel
    before = dict(tier.traffic())
    model(torch.randn(4, 40, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    moved = {k: v - before[k] for k, v in tier.traffic().items()}
    assert moved["down"] == moved["up"] == 2 * placement.tier_numel(buf), moved


@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_each_buffer_keeps_whole_buckets_within_the_share_of_everything_placed(ratio: float) -> None:
    """Two param groups (two buffers of 4 buckets of 256 elements): the device keeps, over the buffers placed so far,
    the longest run of first buckets that stays within ``(1 - ratio)`` of their elements (a bucket that ends exactly
    there included): ``(1 - ratio)`` of each buffer here, the second's budget less what the first kept."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(31, 32), torch.nn.Linear(31, 32)  # 1024 elements each
    groups = [{"params": list(first.parameters())}, {"params": list(second.parameters())}]
    opt = zk.ShardedFusedAdam(
        groups, stage=1, reduce_bucket_size=BUCKET, offload_optimizer={"device": "cpu", "ratio": ratio}
    )
    bufs = opt._pipeline.buffers
    assert [b.layout.shard_numel for b in bufs] == [1024, 1024] and all(len(b.layout.buckets) == 4 for b in bufs)
    kept = int((1 - ratio) * 1024)
    assert [placement.cut(b) for b in bufs] == [kept, kept]
    opt._pipeline.close()


@pytest.mark.parametrize("stage", [1, 2])
def test_steps_found_unedited_by_fingerprint_copy_no_parameters_down(
    stage: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a GPU's tier (``share_host`` off, edits found by ``fingerprint``: ``bitwise`` False): every step, not only
    the first, moves 2 bytes per element of the tier's part down (the gradient) and 2 up (the parameter); the
    parameters the last step pushed up are known unedited, so none is copied down again."""
    monkeypatch.setattr(HostTier, "share_host", False)
    monkeypatch.setattr(HostTier, "bitwise", lambda self, device: False)
    model = _model().to(torch.bfloat16)
    opt = zk.ShardedFusedAdam(model, stage=stage, reduce_bucket_size=BUCKET,
                              offload_optimizer={"device": "cpu", "ratio": 0.3})  # fmt: skip
    (buf,) = opt._pipeline.buffers
    tier = opt._pipeline.tier
    for step in range(3):
        before = dict(tier.traffic())
        model(torch.randn(4, 40, dtype=torch.bfloat16)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        moved = {k: v - before[k] for k, v in tier.traffic().items()}
        assert moved["down"] == moved["up"] == 2 * placement.tier_numel(buf), (step, moved)
