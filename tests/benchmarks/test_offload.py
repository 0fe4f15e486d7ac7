"""The offload benchmark: one JSON for every provider, DeepSpeed's peers where it reads the same offload, the
disk measured in the run, ratios and the disk share taken over the ranks; and the subject itself at a tiny
size (2 gloo ranks; DeepSpeed's rows only where it is installed) and its ``--big`` case at a tiny size."""

from __future__ import annotations

import importlib.util
import os

import pytest

from benchmarks import disk_probe, offload
from benchmarks.__main__ import main
from zero_kernels import ZeroConfig

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.mark.parametrize("stage", offload.STAGES)
@pytest.mark.parametrize("device", ["none", "cpu", "nvme"])
def test_every_provider_reads_the_same_json(tmp_path, stage: int, device: str) -> None:
    cfg = offload.config(stage, device, str(tmp_path) if device == "nvme" else None, micro_batch=8)
    parsed = ZeroConfig.from_deepspeed(cfg, world_size=2)
    assert parsed.stage == stage and parsed.bf16 and parsed.zero.offload_optimizer.device == device
    assert parsed.zero.sub_group_size == offload.SUB_GROUP
    if device == "nvme":
        assert parsed.zero.offload_optimizer.nvme_path == str(tmp_path) and cfg["aio"] == offload.AIO
    if HAS_DEEPSPEED:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        theirs = DeepSpeedZeroConfig(**cfg["zero_optimization"])
        assert (theirs.stage, theirs.sub_group_size) == (stage, offload.SUB_GROUP)
        got = theirs.offload_optimizer.device if theirs.offload_optimizer else "none"
        assert got == device


def test_deepspeed_peers_where_it_offloads_the_same_way() -> None:
    assert offload.providers(deepspeed=False) == [f"zk-stage{s}{d}" for s in (2, 3) for d in ("", "-cpu", "-nvme")]
    ds = [p for p in offload.providers(deepspeed=True) if p.startswith("deepspeed")]
    assert ds == ["deepspeed-stage2-cpu", "deepspeed-stage3-cpu", "deepspeed-stage3-nvme"]
    assert [offload.peer_of(p) for p in ("zk-stage2-cpu", "zk-stage3-nvme", "zk-stage2-nvme", "zk-stage2")] == [
        "deepspeed-stage2-cpu",
        "deepspeed-stage3-nvme",
        None,  # DeepSpeed offloads the optimizer to NVMe only at stage 3
        None,
    ]


def test_ratios_per_round_and_the_disk_share_of_all_ranks() -> None:
    rows = [
        {"provider": "zk-stage3-nvme", "rank": r, "step_ms": 100.0, "rounds_ms": [100.0, 100.0, 100.0],
         "read_MB": 10.0, "written_MB": 10.0} for r in (0, 1)
    ] + [{"provider": "deepspeed-stage3-nvme", "rank": r, "step_ms": 300.0, "rounds_ms": [250.0, 300.0, 350.0]}
         for r in (0, 1)]  # fmt: skip
    disk = {"disk_write_GBps": 1.0, "disk_read_GBps": 0.6, "disk_mixed_GBps": 0.8}
    ours = offload._with_ratios([dict(r, case="c") for r in rows], disk)[0]
    assert ours["vs_deepspeed"] == 3.0 and (ours["low"], ours["high"]) == (2.5, 3.5)
    assert ours["verdict"] == "ours faster"
    assert ours["io_of_disk"] == pytest.approx(40e6 / 0.1 / 0.8e9)  # both ranks' 20 MB per 100 ms step


def test_disk_bandwidth_is_measured_in_the_folder_by_the_engine_and_leaves_nothing(tmp_path) -> None:
    got = disk_probe.measure(str(tmp_path), offload.AIO, size=16 << 20)
    assert got["disk_write_GBps"] > 0 and got["disk_read_GBps"] > 0 and got["disk_mixed_GBps"] > 0
    assert got["disk_probe"].startswith("FileIO ") and "queue depth 8" in got["disk_probe"]
    assert os.listdir(tmp_path) == []


def test_big_ratios_count_the_state_alone_and_every_byte_on_the_disk() -> None:
    got = {"params": 1_000_000_000, "peak_rss_GB": 4.0, "steps_peak_rss_GB": 3.0, "step_s": 10.0, "update_s": 8.0}
    got.update(read_GB=6.0, written_GB=6.0, params_read_GB=1.5, params_written_GB=0.5, grads_read_GB=0.5)
    got.update(grads_written_GB=0.5)
    r = offload._big_ratios(got, 1.5e9)
    assert (r["state_GB"], r["state_over_rss"], r["state_over_steps_rss"]) == (12.0, 3.0, 4.0)
    assert r["io_of_disk"] == pytest.approx(12e9 / 10 / 1.5e9) and r["update_io_of_disk"] == pytest.approx(1.0)
    assert r["step_over_io_bound"] == pytest.approx(10 / 8)
    assert r["disk_io_of_disk"] == pytest.approx(15e9 / 10 / 1.5e9)
    assert r["step_over_disk_bound"] == pytest.approx(1.0)


def test_not_in_the_default_run(monkeypatch) -> None:
    import benchmarks.__main__ as runner

    ran = []
    for name in runner.subjects():
        module = __import__(f"benchmarks.{name}", fromlist=["run"])
        monkeypatch.setattr(module, "run", lambda quick, name=name: ran.append(name) or [])
    monkeypatch.setattr(runner, "_prebuild", lambda: None)
    assert main([]) == 0
    assert "offload" in runner.subjects() and "offload" not in ran and "adam" in ran
    ran.clear()
    assert main(["offload"]) == 0 and ran == ["offload"]


@pytest.mark.distributed
@pytest.mark.ext
def test_subject_at_a_tiny_size() -> None:
    rows = offload.run(quick=True, shape=(16, 1, 1), rounds=1)
    ours = [r for r in rows if r["provider"].startswith("zk-")]
    assert len(ours) == 12 and all("step_ms" in r for r in ours), [r.get("error") for r in ours]
    host = {(r["provider"], r["rank"]): r.get("host_MB") for r in ours}
    for r in ours:
        offloaded = r["provider"].endswith(("-cpu", "-nvme"))
        assert ("down_MB" in r) == offloaded
        if offloaded:  # the "device" is host memory here: the tier uses its shards in place, nothing crosses
            assert r["up_MB"] == r["down_MB"] == 0
        if r["provider"].endswith("-nvme"):  # fp32 master, m and v written once per step, read unless kept
            in_memory = host[(r["provider"].replace("-nvme", "-cpu"), r["rank"])]  # the same state, all in memory
            assert r["written_MB"] == pytest.approx(in_memory) and in_memory > 0
            assert 0 <= r["read_MB"] <= r["written_MB"]  # the swap buffers keep what the pool holds (disk.py)
            assert r["disk_MB"] >= r["written_MB"] and r["io_of_disk"] > 0
        grads = r["provider"] == "zk-stage3-nvme"  # its gradient shard in files: written and read once per step
        assert ("grads_read_MB" in r) == grads
        if grads:
            assert r["grads_read_MB"] == r["grads_written_MB"] > 0 and r["disk_MB"] >= r["read_MB"] + r["grads_read_MB"]
    (disk,) = [r for r in rows if r["provider"] == offload.DISK]
    assert disk["disk_write_GBps"] > 0
    peers = [r for r in rows if r["provider"].startswith("deepspeed")]
    if not HAS_DEEPSPEED:
        assert peers == []
        return
    assert {r["provider"] for r in peers} == {"deepspeed-stage2-cpu", "deepspeed-stage3-cpu", "deepspeed-stage3-nvme"}
    for r in peers:  # timed, or one line saying why not (an op that cannot build here)
        assert "step_ms" in r or r["error"]


@pytest.mark.slow  # a fresh process
@pytest.mark.distributed
@pytest.mark.ext
def test_big_case_at_a_tiny_size() -> None:
    """Without and with the parameter shards on disk (``offload_param`` nvme; layers above the persistence
    threshold, 1e5 elements, so that they are gathered units), the latter also with glibc's mmap threshold set
    in the rank's environment."""
    before = os.environ.get(offload.MMAP_ENV)
    rows = offload.run_big(320 * 320 * 2, steps=2, width=320)
    assert [row["params_on_disk"] for row in rows] == [False, True, True]
    assert [row["malloc_mmap_threshold"] for row in rows] == [None, None, str(offload.MMAP_THRESHOLD)]
    assert os.environ.get(offload.MMAP_ENV) == before  # put back as it was
    for row in rows:
        assert row["params"] == 320 * 320 * 2 and "error" not in row
        assert 0 <= row["read_GB"] <= row["written_GB"] and row["written_GB"] * 1e9 >= 12 * row["params"]
        assert row["peak_rss_GB"] >= row["steps_peak_rss_GB"] > 0
        assert row["update_io_of_disk"] >= row["io_of_disk"] > 0 and row["step_over_io_bound"] > 0
        assert row["step_s"] >= row["update_s"] > 0 and row["fwd_bwd_s"] > 0
    plain, files, _ = rows
    for row in rows:  # the bf16 gradient shard in its file: written by the backward, read by the update
        assert row["grads_written_GB"] * 1e9 == row["grads_read_GB"] * 1e9 == 2 * row["params"]
    assert plain["state_on_disk_GB"] * 1e9 >= 14 * plain["params"] and plain["params_read_GB"] == 0
    assert files["state_on_disk_GB"] * 1e9 >= 16 * files["params"]  # the state, the bf16 gradients and shards
    assert files["params_written_GB"] * 1e9 == 2 * files["params"]  # the update writes each shard once
    assert files["params_read_GB"] * 1e9 == 2 * 2 * files["params"]  # two gathers; the update overwrites it
