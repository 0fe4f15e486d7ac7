"""The planner with offload: what the device, the host and the disk hold, what crosses the host link and the
disk per step, the step it predicts, the offload config it writes, and ``plan --offload``."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace

import pytest

from zero_kernels.__main__ import main
from zero_kernels.planner import NoFitError, OffloadSetup, estimate_memory, estimate_offload, format_bytes, recommend
from zero_kernels.planner.offload import AIO, MAX_SUB_GROUP, sub_group_elements
from zero_kernels.planner.rates import cpu_adam_gbps, memory_copy_gbps

GB = 10**9
PSI, N = 8 * GB, 8  # a shard of 1e9 elements per rank
SHARD = PSI // N
CPU = OffloadSetup("cpu", "none", bus_gbps=50.0, adam_gbps=100.0, host_memory=2000 * GB, ranks_per_node=8)
NVME = replace(CPU, optimizer="nvme", disk_gbps=20.0, disk_space=1000 * GB, nvme_path="/local_nvme")
FIGURES = ["--bus-gbps", "50", "--cpu-adam-gbps", "100", "--host-memory", "2TB", "--gpus-per-node", "8"]
FIGURES += ["--device-kind", "h100"]  # a GPU: the host tier copies, whatever this machine is


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cpu_offload_moves_the_state_to_the_host_and_4_bytes_per_parameter_over_the_bus(stage: int) -> None:
    est = estimate_offload(PSI, N, stage, CPU)
    assert est.host_bytes == 12 * SHARD + 4 * SHARD  # fp32 master, m, v + bf16 copies of the gradient and params
    assert est.disk_bytes == 0 and est.disk_read == est.disk_write == 0
    assert (est.bus_down, est.bus_up) == (2 * SHARD, 2 * SHARD)
    rec = recommend(PSI, gpus=N, gpu_memory=1000 * GB, link="nvlink", offload=CPU)
    plans, bucket = rec.plans, rec.deepspeed["zero_optimization"]["reduce_bucket_size"]
    device = {p.stage: p.memory for p in plans}[stage]
    plain = estimate_memory(PSI, N, stage, bucket_elements=bucket)  # stage 1's scratch buckets
    assert device.optimizer == 0 and device.total == plain.total - plain.optimizer
    assert [p.stage for p in plans] == [1, 2, 3]  # offload needs stage 1 or more


def test_where_the_device_is_the_host_the_tier_holds_the_state_alone() -> None:
    host = replace(CPU, device_is_host=True)
    for stage in (1, 2, 3):
        est = estimate_offload(PSI, N, stage, host, grad_dtype="fp32")
        assert est.host_bytes == 12 * SHARD and (est.bus_down, est.bus_up) == (0, 0)  # no copies, nothing crosses
    gpu = estimate_offload(PSI, N, 2, CPU, grad_dtype="fp32")  # from a GPU: the gradient shard's copy in fp32
    assert gpu.host_bytes == (12 + 4 + 2) * SHARD and (gpu.bus_down, gpu.bus_up) == (4 * SHARD, 2 * SHARD)
    rec = recommend(PSI, gpus=N, gpu_memory=1000 * GB, link="nvlink", offload=replace(host, param="cpu"))
    s3 = rec.plans[-1]  # offload_param cpu moves nothing: the shard stays in the device's (the host's) memory
    assert s3.memory.params == estimate_memory(PSI, N, 3).params and s3.offload.host_bytes == 12 * SHARD
    assert s3.offload.bus_up == 0


def test_nvme_offload_reads_and_writes_the_state_once_per_step_through_sub_groups() -> None:
    est = estimate_offload(PSI, N, 2, NVME)
    sub = sub_group_elements(SHARD)
    assert sub % (1 << 20) == 0 and SHARD / 32 <= sub < SHARD / 32 + (1 << 20)
    assert est.sub_group_size == sub
    assert est.disk_bytes == est.disk_read == est.disk_write == 12 * SHARD
    assert est.host_bytes == 4 * SHARD + 4 * sub * 12  # gradient and parameter copies, 4 sub-group buffers
    assert sub_group_elements(10) == 1 << 20 and sub_group_elements(10**12) == MAX_SUB_GROUP


def test_a_state_the_swap_pool_holds_is_never_read_again() -> None:
    """The disk tier's ``buffer_count`` buffers keep their sub-groups between steps: a shard of at most
    ``buffer_count`` sub-groups is written back every step and never read; a larger one is read once."""
    small = 3 * (1 << 20)  # elements per rank: 3 sub-groups of the smallest size
    est = estimate_offload(small * N, N, 2, NVME)
    assert est.sub_group_size == 1 << 20 and est.disk_read == 0 and est.disk_write == 12 * small
    assert est.phase_s["forward"] == 0
    big = estimate_offload(5 * (1 << 20) * N, N, 2, NVME)  # 5 sub-groups, 4 buffers
    assert big.disk_read == big.disk_write == 12 * 5 * (1 << 20)
    assert big.phase_s["forward"] == pytest.approx(12 * 4 * (1 << 20) / (20 * GB / 8))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_share_offloaded_counts_only_that_share(stage: int) -> None:
    share = replace(CPU, ratio=0.25)
    est = estimate_offload(PSI, N, stage, share)
    assert est.host_bytes == (12 + 4) * SHARD // 4 and (est.bus_down, est.bus_up) == (2 * SHARD // 4, 2 * SHARD // 4)
    assert est.adam_s == estimate_offload(PSI, N, stage, CPU).adam_s / 4
    plans = recommend(PSI, gpus=N, gpu_memory=1000 * GB, link="nvlink", offload=share).plans
    device, plain = {p.stage: p.memory for p in plans}[stage], estimate_memory(PSI, N, stage)
    assert device.optimizer == round(plain.optimizer * 0.75) and device.params == plain.params
    disk = estimate_offload(PSI, N, stage, replace(NVME, ratio=0.25))
    assert disk.disk_bytes == disk.disk_read == disk.disk_write == 12 * SHARD // 4


def test_stage_3_parameter_offload_uploads_the_shard_at_every_gather() -> None:
    setup = replace(NVME, param="nvme")
    cpu = estimate_offload(PSI, N, 3, replace(CPU, param="cpu", grad_accum=2))
    assert cpu.bus_up == 2 * SHARD * 2 * 2  # forward and backward of 2 micro-steps; nothing after the update
    assert cpu.bus_down == 2 * SHARD and cpu.host_bytes == 16 * SHARD  # the parameter copy is the shard
    nvme = estimate_offload(PSI, N, 3, setup)
    assert nvme.disk_bytes == 12 * SHARD + 2 * SHARD + 2 * SHARD  # the state, the parameter and gradient shards
    # shards in files: read for the forward and the backward gather, overwritten by the update; the gradient
    # shard written by the reduction and read by the update
    assert nvme.disk_read == 12 * SHARD + 2 * 2 * SHARD + 2 * SHARD
    assert nvme.disk_write == 12 * SHARD + 2 * SHARD + 2 * SHARD
    assert estimate_offload(PSI, N, 2, setup).disk_bytes == 12 * SHARD  # offload_param counts at stage 3 only
    rec = recommend(PSI, gpus=N, gpu_memory=10 * GB, link="nvlink", offload=setup)
    assert rec.plans[-1].memory.params == 0 and rec.plans[-1].memory.optimizer == 0
    assert rec.stage == 3 and not any(r.startswith("offload_param:") for r in rec.reasons)  # applied as planned
    alone = replace(setup, optimizer="none")  # the state on the device: its update reads the shards and writes them
    est = estimate_offload(PSI, N, 3, alone)
    assert est.disk_bytes == 2 * SHARD and est.disk_read == 2 * 2 * SHARD + 2 * SHARD and est.disk_write == 2 * SHARD
    assert (est.bus_down, est.bus_up) == (2 * SHARD, 2 * SHARD * 2 + 2 * SHARD)
    rec = recommend(PSI, gpus=N, gpu_memory=20 * GB, link="nvlink", offload=alone)
    assert rec.stage == 3 and rec.plans[-1].memory.params == 0
    assert not any(r.startswith("offload_param:") for r in rec.reasons)


def test_stage_3_parameter_shards_on_the_host_with_the_state_on_the_device_go_up_and_down_at_the_update() -> None:
    """``offload_param`` cpu with the state (or a share of it) on the device: the device's part of the shard goes up
    before the update and down after it, 2 + 2 bytes per element in bf16, besides the gathers' uploads."""
    alone = replace(CPU, optimizer="none", param="cpu")
    est = estimate_offload(PSI, N, 3, alone)
    assert est.host_bytes == 2 * SHARD and est.adam_s == 0  # the shard itself; no state on the host
    assert (est.bus_down, est.bus_up) == (2 * SHARD, 2 * SHARD * 2 + 2 * SHARD)
    share = estimate_offload(PSI, N, 3, replace(CPU, ratio=0.25, param="cpu"))
    quarter = SHARD // 4
    assert share.host_bytes == 12 * quarter + 2 * quarter + 2 * SHARD  # its state, its gradients, the whole shard
    assert share.bus_down == 2 * quarter + 2 * (SHARD - quarter)  # the tier's gradients; the device's parameters
    assert share.bus_up == 2 * SHARD * 2 + 2 * (SHARD - quarter)
    rec = recommend(PSI, gpus=N, gpu_memory=40 * GB, link="nvlink", offload=alone)
    s3 = rec.plans[-1]
    assert s3.memory.params == 0 and s3.memory.optimizer == estimate_memory(PSI, N, 3).optimizer
    assert not any(r.startswith("offload_param:") for r in rec.reasons)  # applied as planned


def test_stage_3_with_the_state_on_disk_keeps_the_gradient_shard_in_files() -> None:
    """Not on the device nor as a host copy: on the disk, written by each reduction beside backward (read back by
    a later one) and read by the update; stages 1-2, the cpu tier and a share keep it as before."""
    plain = estimate_offload(PSI, N, 2, NVME)
    disk_bps = 20 * GB / 8  # the node's disk shared by its 8 ranks
    for accum in (1, 4):
        est = estimate_offload(PSI, N, 3, replace(NVME, grad_accum=accum))
        reductions = accum  # stage 3 reduces every micro-step
        assert est.disk_bytes == plain.disk_bytes + 2 * SHARD
        assert est.disk_read == est.disk_write == 12 * SHARD + reductions * 2 * SHARD
        assert est.bus_down == reductions * 2 * SHARD  # down to its file at every reduction
        assert est.host_bytes == plain.host_bytes - 2 * SHARD  # the parameter copy only
        assert est.phase_s["backward"] == pytest.approx(
            max(reductions * 2 * SHARD / (50 * GB), (2 * reductions - 1) * 2 * SHARD / disk_bps)
        )
    plans = {p.stage: p for p in recommend(PSI, gpus=N, gpu_memory=1000 * GB, link="nvlink", offload=NVME).plans}
    assert plans[3].memory.grads == 0 and plans[2].memory.grads == estimate_memory(PSI, N, 2).grads
    for setup in (CPU, replace(NVME, ratio=0.5)):
        assert estimate_offload(PSI, N, 3, setup).disk_bytes == estimate_offload(PSI, N, 2, setup).disk_bytes


def test_the_shard_goes_down_once_per_step_whatever_the_micro_steps() -> None:
    """The update copies each bucket's reduced gradients down once per optimizer step; micro-steps are added up on
    the device before (``test_the_model_matches_the_gradients_down_over_micro_steps`` measures it)."""
    acc = replace(CPU, grad_accum=4)
    for stage in (1, 2, 3):
        assert estimate_offload(PSI, N, stage, acc).bus_down == 2 * SHARD
    assert estimate_offload(PSI, N, 2, acc, grad_dtype="fp32").bus_down == 4 * SHARD


@pytest.mark.parametrize("grad_accum_dtype", [None, "fp32"])
def test_the_model_matches_the_gradients_down_over_micro_steps(monkeypatch, grad_accum_dtype) -> None:
    """Stage 2 with the host tier copying as from a GPU, 2 micro-steps per step: the bytes that went down are the
    plan's, every micro-step reducing into the shard (of the gradients' dtype, or fp32)."""
    import torch

    import zero_kernels as zk
    from zero_kernels.offload import HostTier
    from zero_kernels.planner.models import reduced_grad_dtype, reduces_micro_steps

    monkeypatch.setattr(HostTier, "share_host", False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 1 << 16}
    cfg = {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "gradient_accumulation_steps": 2, "data_types": {"grad_accum_dtype": grad_accum_dtype},
           "zero_optimization": zero}  # fmt: skip
    module, opt = zk.initialize(model, cfg)
    tier = opt._pipeline.tier
    before = dict(tier.traffic())
    for _ in range(2):
        module(torch.randn(4, 256, dtype=torch.bfloat16)).float().square().mean().backward()
        opt.step()  # acts at the window's last micro-step
    moved = tier.traffic()["down"] - before.get("down", 0)
    (buf,) = opt._pipeline.buffers
    setup = replace(CPU, ranks_per_node=1, grad_accum=2)
    grads = reduced_grad_dtype("bf16", None, grad_accum_dtype)
    est = estimate_offload(buf.layout.numel, 1, 2, setup, grad_dtype=grads)
    assert reduces_micro_steps(2) and moved == est.bus_down > 0


def test_the_update_after_backward_is_the_adam_or_the_disk_whichever_is_longer() -> None:
    cpu = estimate_offload(PSI, N, 2, CPU)
    adam_s = 12 * SHARD * 8 / (100 * GB)  # the node's 8 ranks share its CPU Adam
    assert cpu.adam_s == pytest.approx(adam_s)
    bus_s = (2 + 2) * SHARD / (50 * GB)  # the gradients down and the parameters up, in the update
    assert cpu.phase_s["after"] == pytest.approx(adam_s + bus_s)
    assert cpu.phase_s["backward"] == 0
    nvme = estimate_offload(PSI, N, 2, NVME)
    pool = 4 * sub_group_elements(SHARD) * 12  # read beside the forward: the pool's sub-groups
    disk_s = (2 * 12 * SHARD - pool) / (20 * GB / 8)  # read + write, the node's disk shared by its 8 ranks
    assert disk_s > adam_s and nvme.phase_s["after"] == pytest.approx(disk_s + bus_s)
    assert nvme.phase_s["forward"] == pytest.approx(pool / (20 * GB / 8))
    fast_disk = estimate_offload(PSI, N, 2, replace(NVME, disk_gbps=10_000.0))
    assert fast_disk.phase_s["after"] == pytest.approx(adam_s + bus_s)


def test_offload_step_adds_what_compute_cannot_hide() -> None:
    compute = 100.0
    plain = recommend(PSI, gpus=N, gpu_memory=1000 * GB, link="nvlink", compute_s=compute)
    rec = recommend(PSI, gpus=N, gpu_memory=1000 * GB, link="nvlink", compute_s=compute, offload=CPU)
    for p in rec.plans:
        same = plain.plans[p.stage]
        after = p.offload.phase_s["after"]
        assert p.step_s == pytest.approx(same.step_s + after)  # bus traffic beside backward hides under compute


def test_offload_makes_a_model_fit_that_fits_nowhere_without() -> None:
    psi, mem = 70 * GB, 80 * GB
    with pytest.raises(NoFitError) as err:
        recommend(psi, gpus=8, gpu_memory=mem, link="nvlink")
    msg = str(err.value)
    assert "not supported" not in msg and "--offload cpu" in msg
    rec = recommend(psi, gpus=8, gpu_memory=mem, link="nvlink", offload=CPU)
    assert rec.stage == 3 and rec.plans[-1].gpu_bytes <= mem
    assert any("without offload no stage fits" in r for r in rec.reasons)
    assert rec.deepspeed["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


def test_offload_says_when_a_stage_would_fit_without_it() -> None:
    rec = recommend(10**9, gpus=8, gpu_memory=80 * GB, link="nvlink", offload=CPU)
    assert any(r.startswith("without offload stage 0 fits too") for r in rec.reasons)


def test_host_memory_or_disk_too_small_is_named() -> None:
    small_host = replace(CPU, host_memory=120 * GB)  # 8 ranks x 16 GB of state and copies
    with pytest.raises(NoFitError, match="host memory is too small"):
        recommend(PSI, gpus=N, gpu_memory=1000 * GB, link="nvlink", offload=small_host)
    small_disk = replace(NVME, disk_space=90 * GB)  # 8 ranks x 12 GB of state files
    with pytest.raises(NoFitError, match="the disk is too small"):
        recommend(PSI, gpus=N, gpu_memory=1000 * GB, link="nvlink", offload=small_disk)
    roomy = replace(NVME, disk_space=113 * GB)  # and at stage 3 8 x 2 GB of gradient files
    rec = recommend(PSI, gpus=N, gpu_memory=1000 * GB, link="nvlink", offload=roomy)
    assert all(p.fits for p in rec.plans)


def test_config_keys_as_deepspeed_spells_them() -> None:
    cpu = recommend(PSI, gpus=N, gpu_memory=1000 * GB, link="nvlink", offload=replace(CPU, param="cpu"))
    zero = cpu.deepspeed["zero_optimization"]
    assert "aio" not in cpu.deepspeed and zero["sub_group_size"] == MAX_SUB_GROUP
    assert ("offload_param" in zero) == (cpu.stage == 3)
    both = replace(NVME, param="nvme")
    rec = recommend(PSI, gpus=N, gpu_memory=10 * GB, link="nvlink", offload=both, largest_layer_params=3 * 10**8)
    zero = rec.deepspeed["zero_optimization"]
    assert rec.stage == 3 and rec.deepspeed["aio"] == AIO
    assert zero["offload_optimizer"] == {
        "device": "nvme",
        "nvme_path": "/local_nvme",
        "pin_memory": True,
        "buffer_count": 4,
        "pipeline_read": True,
        "pipeline_write": True,
    }
    assert zero["offload_param"]["buffer_size"] == 3 * 10**8  # holds the largest gathered unit
    assert zero["sub_group_size"] == sub_group_elements(SHARD)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_reads_the_config() -> None:
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    rec = recommend(PSI, gpus=N, gpu_memory=10 * GB, link="nvlink", offload=replace(NVME, param="nvme"))
    zero = DeepSpeedZeroConfig(**rec.deepspeed["zero_optimization"])
    assert zero.offload_optimizer.device == "nvme" and zero.offload_param.device == "nvme"
    assert str(zero.offload_optimizer.nvme_path) == "/local_nvme" and zero.sub_group_size == sub_group_elements(SHARD)
    assert {k: v for k, v in get_aio_config(rec.deepspeed).items() if k in AIO} == AIO


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: replace(CPU, optimizer="gpu"), "offload='gpu': allowed devices are none, cpu, nvme"),
        (lambda: replace(CPU, param="disk"), "offload_param='disk'"),
        (lambda: replace(CPU, bus_gbps=0), "bus_gbps=0"),
        (lambda: replace(CPU, grad_accum=0), "grad_accum=0"),
        (lambda: replace(CPU, optimizer="nvme"), "disk_gbps=None: offload to nvme needs it .plan --disk-gbps"),
        (lambda: replace(NVME, disk_space=-1), "disk_space=-1"),
        (lambda: estimate_offload(PSI, N, 0, CPU), "stage=0: offload needs ZeRO stage 1, 2 or 3"),
        (lambda: replace(CPU, ratio=0), "ratio=0: the offloaded share must be in .0, 1."),
        (lambda: replace(CPU, ratio=1.5), "ratio=1.5"),
    ],
)
def test_bad_offload_input(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


PLAN = ["plan", "--params", "70B", "--gpus", "8", "--gpu-memory", "80GB", "--link", "nvlink"]


def test_cli_offload_table_and_json(tmp_path, capsys) -> None:
    path = tmp_path / "ds.json"
    assert main(PLAN + ["--offload", "cpu", *FIGURES, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "host/rank" in out and "disk I/O/step" in out and "recommended: ZeRO stage 3" in out
    assert "offload figure" not in out  # every figure given
    setup = replace(CPU, host_memory=2 * 10**12)
    assert json.loads(path.read_text()) == recommend(70 * GB, gpus=8, gpu_memory=80 * GB, link="nvlink",
                                                     offload=setup).deepspeed  # fmt: skip


def test_cli_plans_a_cpu_device_without_host_copies(capsys, monkeypatch) -> None:
    import torch

    assert main(PLAN + ["--offload", "cpu", *FIGURES, "--device-kind", "cpu"]) == 0
    out = capsys.readouterr().out
    shard = 70 * GB // 8
    assert "recommended: ZeRO stage 3" in out and f"offload: {format_bytes(12 * shard)} of host memory" in out
    assert main(PLAN + ["--offload", "cpu", *FIGURES]) == 0  # an h100: the state and the two copies
    assert f"offload: {format_bytes(16 * shard)} of host memory" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # auto, on a machine without CUDA: its CPU
    assert main(PLAN + ["--offload", "cpu", *FIGURES[:-2]]) == 0
    out = capsys.readouterr().out
    assert "offload figure: device: the host (no CUDA device here)" in out
    assert f"offload: {format_bytes(12 * shard)} of host memory" in out


def test_cli_writes_the_offload_ratio(tmp_path, capsys) -> None:
    path = tmp_path / "ds.json"
    assert main(PLAN + ["--offload", "cpu", "--offload-ratio", "0.9", *FIGURES, "--json", str(path)]) == 0
    assert json.loads(path.read_text())["zero_optimization"]["offload_optimizer"]["ratio"] == 0.9


def test_cli_nvme_needs_the_disk_figures(tmp_path, capsys) -> None:
    assert main(PLAN + ["--offload", "nvme", *FIGURES, "--nvme-path", str(tmp_path)]) == 2
    assert "--disk-gbps" in capsys.readouterr().err
    missing = str(tmp_path / "absent")
    assert main(PLAN + ["--offload", "nvme", *FIGURES, "--nvme-path", missing, "--disk-gbps", "3"]) == 2
    assert "give --disk-space" in capsys.readouterr().err
    args = ["--offload", "nvme", *FIGURES, "--nvme-path", missing, "--disk-gbps", "3", "--disk-space", "2TB"]
    assert main(PLAN + args) == 0
    assert "recommended: ZeRO stage" in capsys.readouterr().out


@pytest.mark.ext  # measures the C++ CPU Adam
def test_cli_measures_what_it_is_not_given(tmp_path, capsys) -> None:
    args = ["plan", "--params", "100M", "--gpus", "2", "--gpu-memory", "1GB", "--link", "nvlink"]
    assert main(args + ["--offload", "nvme", "--nvme-path", str(tmp_path), "--disk-gbps", "1"]) == 0
    out = capsys.readouterr().out
    assert "measured here (cpu kernel" in out and "this machine's" in out and f"free under {tmp_path}" in out
    gbps, impl = cpu_adam_gbps()
    assert gbps > 0 and impl == "cpu" and memory_copy_gbps() > 0


@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_json_loads_through_zero_config(tmp_path, capsys, optimizer: str) -> None:
    from zero_kernels.config import ZeroConfig

    path = tmp_path / "ds.json"
    disk = ["--nvme-path", str(tmp_path), "--disk-gbps", "20", "--disk-space", "100TB"]
    assert main(PLAN + ["--offload", optimizer, *FIGURES, *disk, "--json", str(path)]) == 0
    written = json.loads(path.read_text())
    cfg = ZeroConfig.from_deepspeed(str(path), world_size=8)
    assert cfg.zero.stage == 3 and cfg.zero.offload_optimizer.device == optimizer
    assert cfg.zero.offload_optimizer.pin_memory is True
    assert cfg.zero.sub_group_size == written["zero_optimization"]["sub_group_size"]
    if optimizer == "nvme":
        assert cfg.zero.offload_optimizer.nvme_path == str(tmp_path) and cfg.zero.offload_optimizer.pipeline_read
        assert (cfg.zero.aio.block_size, cfg.zero.aio.queue_depth) == (AIO["block_size"], AIO["queue_depth"])


@pytest.mark.parametrize(
    "optimizer, ratio, shared, comm",
    [("cpu", 1.0, True, None), ("cpu", 1.0, False, None), ("cpu", 0.5, False, "fp32"), ("nvme", 1.0, True, None),
     ("nvme", 0.5, False, None)],
)  # fmt: skip
def test_the_model_matches_what_the_tiers_hold_and_move(tmp_path, monkeypatch, optimizer, ratio, shared, comm) -> None:
    """The plan's figures, byte for byte, against what a step after the first held and moved: on this machine the
    device is the host, and the tier makes no host copies (``HostTier.share_host``); with it off the tier copies as
    from a GPU. The plan is given the padded flat buffer and the share the pipeline offloaded (it cuts at whole
    buckets)."""
    import torch

    import zero_kernels as zk
    from zero_kernels.offload import HostTier
    from zero_kernels.planner.models import reduced_grad_dtype
    from zero_kernels.stages import placement

    monkeypatch.setattr(HostTier, "share_host", shared)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    block = {"device": optimizer, "ratio": ratio, **({"nvme_path": str(tmp_path)} if optimizer == "nvme" else {})}
    cfg = {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "offload_optimizer": block, "sub_group_size": 1 << 20,
                                 "reduce_bucket_size": 1 << 16}, "communication_data_type": comm}  # fmt: skip
    module, opt = zk.initialize(model, cfg)
    tier = opt._pipeline.tier
    (buf,) = opt._pipeline.buffers
    share = placement.tier_numel(buf) / buf.layout.shard_numel
    assert ratio <= share < ratio + 0.13, share
    for _ in range(2):  # the second step's traffic: the swap pool holds what the first step left in it
        module(torch.randn(4, 256, dtype=torch.bfloat16)).float().square().mean().backward()
        before = dict(tier.traffic())
        opt.step()
        opt.zero_grad()
    moved = {k: v - before.get(k, 0) for k, v in tier.traffic().items()}
    setup = replace(NVME if optimizer == "nvme" else CPU, ranks_per_node=1, ratio=share, device_is_host=shared)
    grads = reduced_grad_dtype("bf16", comm)
    est = estimate_offload(buf.layout.numel, 1, 2, setup, grad_dtype=grads)
    assert round(buf.layout.numel * share) == placement.tier_numel(buf)
    assert (moved["down"], moved["up"]) == (est.bus_down, est.bus_up)
    assert (est.bus_down > 0) != shared  # a copy crosses only from a device that is not the host
    report = opt.memory_report()
    if optimizer == "cpu":
        assert report["host"] == est.host_bytes
    else:
        assert report["disk"] == est.disk_bytes
        assert (moved["read"], moved["written"]) == (est.disk_read, est.disk_write)
    plain = estimate_memory(buf.layout.numel, 1, 2, communication_data_type=comm)
    assert report["grads"] == plain.grads
