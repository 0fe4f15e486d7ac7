"""Offload to host memory and to disk gives the weights and state of the same run without offload, bit for
bit, at stages 1-3 on 2 gloo ranks (accumulation, clipping, a non-finite step, fp16 overflow, AMSGrad), also
with stage 3's parameter shards in host memory or in files (``offload_param`` cpu, nvme); a checkpoint saved with
offload resumes without it at another world size, and the other way round; a missing or unwritable
``offload_param.nvme_path`` is refused on every rank."""

from __future__ import annotations

import copy
import re
import shutil
from pathlib import Path

import pytest
import torch

import zero_kernels as zk
import zero_kernels.optim as zo
from tests.helpers.dist import run_ranks
from tests.helpers.lockstep import BUCKET, ROWS, STAGE3, Net, batch
from tests.offload.exactness import copying, pair_case
from tests.offload.test_offload_config import SUPER_OFFLOAD
from zero_kernels.offload import HostTier

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _tiers(scratch: Path, rank: int) -> list[dict]:
    nvme = scratch / f"nvme{rank}"  # each rank its own disk (nvme_path is the one option ranks may differ on)
    nvme.mkdir(exist_ok=True)
    disk = {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 3, "pipeline_read": True, "pipeline_write": True}
    return [{"device": "cpu", "pin_memory": True}, disk]


def param_files(scratch: Path, rank: int, max_in_cpu: int = 0) -> dict:
    """``offload_param`` on nvme (the HF ZeRO-Infinity template's keys), a pool of 2 buffers: gathers wait for one."""
    nvme = scratch / f"params{rank}"
    nvme.mkdir(exist_ok=True)
    return {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 2, "buffer_size": 1000, "max_in_cpu": max_in_cpu}


def in_files(opt: zo.ShardedFusedAdam, kept: bool = False) -> None:
    """Between steps the shard of each unit in a file is only there: a stand-in in memory, its bytes in its file
    (``kept``: some unit's shard stays in host memory, under ``max_in_cpu``)."""
    pipeline = opt._pipeline
    units = list(pipeline.disk_params.units.values())
    sharded = [buf for buf in pipeline.buffers if not buf.persistent]
    assert units and (len(units) < len(sharded)) == kept, (len(units), len(sharded))
    assert all(buf.param_shard.device.type == "meta" for buf in units)
    files = [p.stat().st_size for p in pipeline.disk_params.files.directory.root.glob("u*.params")]
    assert sorted(files) == sorted(buf.layout.shard_numel * buf.dtype.itemsize for buf in units)


def _refused_ranks(rank: int, world: int, scratch: str) -> None:
    """``offload_param.nvme_path``: rank 0's does not exist, rank 1's cannot hold a directory (a file is where it
    would go): every rank raises, naming the key and each rank's problem, and the model is left as it was."""
    root = Path(scratch) / f"refused{rank}"
    root.mkdir()
    if rank == 0:
        path = root / "missing"
    else:
        path = root
        (root / "zero_kernels").write_text("not a directory")
    torch.manual_seed(0)
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    files = {"device": "nvme", "nvme_path": str(path), "max_in_cpu": 0}
    kwargs = dict(stage=3, reduce_bucket_size=BUCKET, **STAGE3)
    with pytest.raises(OSError) as caught:
        zo.ShardedFusedAdam(model, offload_optimizer="cpu", offload_param=files, **kwargs)
    text = str(caught.value)
    assert "zero_optimization.offload_param could not start" in text, text
    missing, blocked = Path(scratch) / "refused0" / "missing", Path(scratch) / "refused1"
    assert re.search(rf"rank 0: \[Errno \d+\] offload_param.nvme_path='{missing}' is not a directory", text), text
    assert re.search(rf"rank 1: \[Errno \d+\] offload_param.nvme_path='{blocked}': cannot write", text), text
    for name, value in model.state_dict().items():
        assert value.shape == before[name].shape and torch.equal(value, before[name]), name


def _exact_ranks(rank: int, world: int, scratch: str) -> None:
    _refused_ranks(rank, world, scratch)  # in this spawn: each one costs seconds
    files, mixed = param_files(Path(scratch), rank), param_files(Path(scratch), rank, max_in_cpu=40)
    for offload in _tiers(Path(scratch), rank):
        for stage in (1, 2, 3):
            for dtype in DTYPES:
                pair_case(rank, world, stage, dtype, offload)
            pair_case(rank, world, stage, torch.bfloat16, offload, accum=True)  # micro-steps summed in fp32
            # part of the state on the device (ratio): 0.3 splits buffers, 0.9 puts them whole in the tier (buckets
            # of 13 elements at 2 ranks: under one bucket of 3 stays on the device)
            for ratio, dtype in [(0.3, d) for d in DTYPES] + [(0.9, torch.bfloat16)]:
                placed = pair_case(rank, world, stage, dtype, {**offload, "ratio": ratio})["placed"]
                device, tier = sum(k for k, _ in placed), sum(n - k for k, n in placed)
                assert tier >= 1 and (device >= 1) == (ratio == 0.3), (stage, ratio, placed)
        # stage 3's parameter shards in host memory too (the HF ZeRO-3 template): nothing goes up at the step;
        # or in files (ZeRO-Infinity): compared after every step (the state reads bring the shards in between
        # steps), and only after the last (gathers and updates read them from the files; some shards in host
        # memory under max_in_cpu)
        on_cpu = offload["device"] == "cpu"
        cases = [
            ({"device": "cpu", "pin_memory": True}, None, DTYPES if on_cpu else (torch.bfloat16,)),
            (files, None, (torch.bfloat16, torch.float32) if on_cpu else (torch.bfloat16,)),
            (files, in_files, (torch.bfloat16,)),
            (mixed, lambda opt: in_files(opt, kept=True), (torch.bfloat16,)),
        ]
        for params, during, dtypes in cases:
            for dtype in dtypes:
                result = pair_case(rank, world, 3, dtype, offload, params, during)
                assert result["device_numel"] < result["shard_numel"] / 2, "most parameters must be in sharded units"
                assert result["traffic"] == {**result["traffic"], "up": 0, "down": 0, "init": 0}  # nothing copied
        _copying_cases(rank, world, offload, files)
    # DeepSpeed's SuperOffload example block (stage 3): its host Adam runs after backward here, results the same
    pair_case(rank, world, 3, torch.bfloat16, SUPER_OFFLOAD)


def _copying_cases(rank: int, world: int, offload: dict, files: dict) -> None:
    """The copies a GPU makes (the gradients down, the parameters up, edits found and copied down), run here with
    ``HostTier.share_host`` off: bf16 and fp32 at stages 1-3, then stage 3's parameter shards in host memory and in
    files (only the persistent units' shards go up). Stage 3 with the state on disk copies no gradient down: the
    update reads them from their files (``stage3.disk_grads``)."""
    with copying():
        for stage in (1, 2, 3):
            for dtype in (torch.bfloat16, torch.float32):
                result = pair_case(rank, world, stage, dtype, offload)
                size = torch.finfo(dtype).bits // 8
                down = stage < 3 or offload["device"] == "cpu"
                assert (result["traffic"]["down"] > 0) == down, (stage, dtype, result["traffic"])
                assert result["traffic"]["up"] > 0, (stage, dtype, result["traffic"])
                assert result["traffic"]["init"] == result["shard_numel"] * size
        for params in ({"device": "cpu", "pin_memory": True}, files):
            result = pair_case(rank, world, 3, torch.bfloat16, offload, params)
            # the persistent units' shards only, at applied steps (with the state on disk, at skipped ones too: the
            # gradients are read from files at every step, ``offloaded.skipped_on_host``)
            applied = result["steps"] - (result["skipped"] if offload["device"] == "cpu" else 0)
            up = applied * result["device_numel"] * 2
            assert result["traffic"]["up"] == up, f"offload_param {params} with {offload['device']}"


@pytest.mark.distributed
def test_offload_is_exact_at_stages_1_to_3_on_two_ranks(tmp_path: Path) -> None:
    run_ranks(_exact_ranks, 2, str(tmp_path), timeout_s=420.0)


# ---------------------------------------------------------------- checkpoints across tiers and world sizes
def _train(model: Net, opt: zo.ShardedFusedAdam, rank: int, world: int, steps: range) -> None:
    for step in steps:
        x = batch(step, world * ROWS)
        model(x[rank * ROWS : (rank + 1) * ROWS]).backward()
        opt.step()
        opt.zero_grad()


def _opt(model: Net, stage: int, offload: dict | None) -> zo.ShardedFusedAdam:
    kwargs = {"offload_optimizer": offload, "sub_group_size": 32} if offload else {}
    if offload and offload.get("params"):  # stage 3 with the parameter shards in host memory or files too
        kwargs["offload_optimizer"] = {"device": offload["device"]}
        kwargs["offload_param"] = offload["params"]
        kwargs.update(STAGE3)  # units to offload, not only persistent parameters
    return zo.ShardedFusedAdam(model, lr=2e-2, stage=stage, reduce_bucket_size=BUCKET, amsgrad=True, **kwargs)


def _save_ranks(rank: int, world: int, scratch: str) -> None:
    """At 2 ranks: the same training saved with the disk tier (stage 3), without offload (stage 2), with the
    parameter shards in host memory (stage 3) or in files (stage 3: saved with them in their files), and with a
    share of the state on the disk (stage 3)."""
    nvme = Path(scratch) / f"nvme{rank}"
    nvme.mkdir(exist_ok=True)
    files = {"device": "nvme", "nvme_path": str(nvme), "max_in_cpu": 0}
    for name, stage, offload in (("tier", 3, {"device": "nvme", "nvme_path": str(nvme)}), ("plain", 2, None),
                                 ("params", 3, {"device": "cpu", "params": {"device": "cpu"}}),
                                 ("files", 3, {"device": "cpu", "params": files}),
                                 ("ratio", 3, {"device": "nvme", "nvme_path": str(nvme), "ratio": 0.3})):  # fmt: skip
        torch.manual_seed(0)
        model = Net()
        opt = _opt(model, stage, offload)
        _train(model, opt, rank, world, range(3))
        if name == "files":
            in_files(opt)
        zk.checkpoint.save(Path(scratch) / name, model, opt)
        if offload:
            opt._pipeline.tier.close()


@pytest.mark.distributed
def test_checkpoint_resumes_across_tiers_and_world_sizes(tmp_path: Path) -> None:
    run_ranks(_save_ranks, 2, str(tmp_path))
    shutil.rmtree(tmp_path / "nvme0")  # nothing under nvme_path is needed to resume
    shutil.rmtree(tmp_path / "nvme1")
    (tmp_path / "nvme").mkdir()
    resumed = {}
    disk = {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}
    files = {"device": "cpu", "params": {"device": "nvme", "nvme_path": str(tmp_path / "nvme"), "max_in_cpu": 0}}
    cases = [("tier", 1, None), ("plain", 1, disk), ("tier", 1, {"device": "cpu"}), ("params", 1, None),
             ("plain", 3, {"device": "cpu", "params": {"device": "cpu"}}), ("files", 1, None),
             ("plain", 3, files), ("ratio", 1, None), ("ratio", 2, None),
             ("plain", 2, {"device": "cpu", "ratio": 0.3})]  # fmt: skip
    for saved, stage, offload in cases:
        torch.manual_seed(1)
        model = Net()
        opt = _opt(model, stage, offload)
        zk.checkpoint.load(tmp_path / saved, model, opt)
        if offload is files:
            assert opt._pipeline.disk_params.units
        before = copy.deepcopy(opt.full_state_dict()["state"])
        _train(model, opt, 0, 1, range(3, 5))
        with opt.gathered_params():
            weights = copy.deepcopy(model.state_dict())
        resumed[(saved, stage, str(offload))] = (before, opt.full_state_dict()["state"], weights)
    values = list(resumed.values())
    for before, after, weights in values[1:]:
        ref_before, ref_after, ref_weights = values[0]
        for i in ref_before:
            for kind in ref_before[i]:
                assert torch.equal(before[i][kind], ref_before[i][kind]), (i, kind)
                assert torch.equal(after[i][kind], ref_after[i][kind]), (i, kind)
        for name in ref_weights:
            assert torch.equal(weights[name], ref_weights[name]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("copies", [False, True])
def test_edits_between_steps_are_adopted_as_without_offload(
    copies: bool, dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-place writes into the parameters and a loaded model state between steps reach the offloaded master;
    ``copies``: as a GPU's tier (host copies of the parameters, edits found by ``fingerprint``)."""
    if copies:
        monkeypatch.setattr(HostTier, "share_host", False)
        monkeypatch.setattr(HostTier, "bitwise", lambda self, device: False)
    torch.manual_seed(0)
    plain = Net().to(dtype)
    tiered = copy.deepcopy(plain)
    a = _opt(plain, 1, None)
    b = _opt(tiered, 1, {"device": "nvme", "nvme_path": str(tmp_path)})
    loaded = {k: v * 0.5 for k, v in plain.state_dict().items()}
    for step in range(3):
        for model, opt in ((plain, a), (tiered, b)):
            model(batch(step, ROWS).to(dtype)).float().backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                model.emb.weight.data.mul_(2)
            if step == 1:
                model.load_state_dict(loaded)
        for (name, p), q in zip(plain.named_parameters(), tiered.parameters()):
            assert torch.equal(p, q), f"step {step}: {name}"
