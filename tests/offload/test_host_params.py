"""Stage 3's parameter shards in host memory where the optimizer state is not all there (``offload_param`` on the
cpu without ``offload_optimizer``, or with its ``ratio`` below 1): bit for bit the weights and state without it on
2 gloo ranks, the copies a GPU makes run here too (``HostTier.share_host`` off: 2 + 2 bytes per parameter of the
host shards per step in bf16), what ``memory_report`` shows, checkpoints both ways, and offload_param on nvme
still warned about without all the state in the tier."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch

import zero_kernels as zk
from tests.helpers.dist import run_ranks
from tests.helpers.lockstep import BUCKET, ROWS, STAGE3, Net, batch
from tests.offload.exactness import copying, pair_case
from zero_kernels.offload import HostTier

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PARAMS = {"device": "cpu", "pin_memory": True}


def _exact_ranks(rank: int, world: int, scratch: str) -> None:
    nvme = Path(scratch) / f"nvme{rank}"
    nvme.mkdir(exist_ok=True)
    for dtype in DTYPES:  # a CPU machine: the shards are host memory already, nothing moves
        result = pair_case(rank, world, 3, dtype, None, PARAMS)
        assert result["param_traffic"] == {"up": 0, "down": 0}, result
    with copying():
        for dtype in DTYPES:
            result = pair_case(rank, world, 3, dtype, None, PARAMS)
            on_host = result["shard_numel"] - result["device_numel"]
            assert on_host > result["shard_numel"] / 2, "most parameters must be in sharded units"
            moved = result["steps"] * on_host * torch.finfo(dtype).bits // 8  # every step: the kernel decides a skip
            assert result["param_traffic"] == {"up": moved, "down": moved}, (dtype, result)
        for offload in ({"device": "cpu", "ratio": 0.3}, {"device": "nvme", "nvme_path": str(nvme), "ratio": 0.3}):
            for dtype in (torch.bfloat16, torch.float32):
                result = pair_case(rank, world, 3, dtype, offload, PARAMS)
                assert result["param_traffic"]["up"] > 0, (offload, dtype, result)
                assert result["traffic"]["up"] < result["traffic"]["down"], "the tier's part of a host shard stays"


@pytest.mark.distributed
def test_host_parameter_shards_are_exact_on_two_ranks(tmp_path: Path) -> None:
    run_ranks(_exact_ranks, 2, str(tmp_path), timeout_s=300.0)


def _opt(model: Net, params: dict | None, **kwargs) -> zk.ShardedFusedAdam:
    extra = {"offload_param": params} if params else {}
    return zk.ShardedFusedAdam(model, lr=2e-2, stage=3, reduce_bucket_size=BUCKET, amsgrad=True, **STAGE3, **extra,
                               **kwargs)  # fmt: skip


def _train(model: Net, opt: zk.ShardedFusedAdam, steps: range) -> None:
    for step in steps:
        model(batch(step, ROWS)).backward()
        opt.step()
        opt.zero_grad()


def test_memory_report_counts_the_shards_under_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HostTier, "share_host", False)
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    plain = copy.deepcopy(model)
    opt, ref = _opt(model, PARAMS), _opt(plain, None)
    shards = [buf.param_shard for buf in opt._pipeline.buffers if not buf.persistent]
    assert shards and all(s.device.type == "cpu" for s in shards)
    assert [id(s) for s in shards] == [id(s) for s in opt._pipeline.host_params.tensors()]
    on_host = sum(s.numel() * s.element_size() for s in shards)
    report, plain_report = opt.memory_report(), ref.memory_report()
    assert report["host"] == on_host and report["disk"] == 0, report
    assert report["params"] == plain_report["params"] - on_host, (report, plain_report)
    assert report["optimizer"] == plain_report["optimizer"], "the state stays on the device"


@pytest.mark.parametrize("saved_with, loaded_with", [(PARAMS, None), (None, PARAMS)])
def test_checkpoints_load_with_and_without_host_shards(
    saved_with: dict | None, loaded_with: dict | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three steps, saved, loaded into a fresh model and optimizer, two more: the weights of five steps straight."""
    monkeypatch.setattr(HostTier, "share_host", False)
    torch.manual_seed(0)
    model = Net()
    straight_model = copy.deepcopy(model)
    straight = _opt(straight_model, None)
    _train(straight_model, straight, range(5))
    opt = _opt(model, saved_with)
    _train(model, opt, range(3))
    zk.checkpoint.save(tmp_path / "ckpt", model, opt)
    torch.manual_seed(1)
    resumed_model = Net()
    resumed = _opt(resumed_model, loaded_with)
    zk.checkpoint.load(tmp_path / "ckpt", resumed_model, resumed)
    _train(resumed_model, resumed, range(3, 5))
    with straight.gathered_params(), resumed.gathered_params():
        for (name, p), q in zip(straight_model.named_parameters(), resumed_model.parameters()):
            assert torch.equal(p, q), name


@pytest.mark.parametrize("offload", [None, {"device": "cpu", "ratio": 0.5}])
def test_offload_param_on_nvme_without_all_the_state_offloaded_warns_that_the_shards_stay(
    offload: dict | None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    params = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0}
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        opt = _opt(Net(), params, **({"offload_optimizer": offload} if offload else {}))
    said = [r.getMessage() for r in caplog.records if "offload_param" in r.getMessage()]
    assert len(said) == 1 and "not acted on" in said[0], said
    assert ("ratio=0.5" in said[0]) == (offload is not None), said
    assert opt._pipeline.host_params is None and opt._pipeline.disk_params is None
    assert not (tmp_path / "zero_kernels").exists()  # no parameter files


def test_offload_param_on_the_cpu_is_acted_on_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        opt = _opt(Net(), {"device": "cpu"})
    assert not [r for r in caplog.records if "offload_param" in r.getMessage()]
    assert opt._pipeline.host_params is not None
