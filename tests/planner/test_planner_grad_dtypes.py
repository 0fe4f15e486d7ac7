"""The planner with ``communication_data_type`` and ``data_types.grad_accum_dtype``: the gradient shard of stages 2
and 3 in the dtype the pipelines keep it in, against what two ranks allocate, and ``plan`` taking and writing them."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.dist import run_ranks_checked
from zero_kernels.__main__ import main
from zero_kernels.planner import estimate_memory, recommend
from zero_kernels.planner.models import STAGE1_SCRATCH, STAGE2_SCRATCH, reduced_grad_dtype, shard_elements

GB = 10**9
PSI, N = 1_000_000, 8
WIDER = [{"communication_data_type": "fp32"}, {"grad_accum_dtype": "fp32"}]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("wider", WIDER, ids=["communication_data_type", "grad_accum_dtype"])
def test_a_wider_dtype_widens_the_gradients_the_stage_keeps(stage: int, wider: dict) -> None:
    plain, wide = estimate_memory(PSI, N, stage), estimate_memory(PSI, N, stage, **wider)
    # stages 0-1: the local gradients are added up in grad_accum_dtype, and reduced in communication_data_type
    # (stage 1's reduced shard is one of its buffers)
    if stage >= 2:
        assert wide.grads == 4 * PSI // N
    else:
        assert wide.grads == (4 * PSI if "grad_accum_dtype" in wider else plain.grads)
    grown = wide.grads - plain.grads + wide.buffers - plain.buffers
    assert wide.total - plain.total == grown and wide.working_set == plain.working_set


def test_the_reduced_dtype_promotes_as_torch_does() -> None:
    assert reduced_grad_dtype("bf16") == "bf16" and reduced_grad_dtype("bf16", grad_accum_dtype="fp32") == "fp32"
    assert reduced_grad_dtype("bf16", "fp32") == "fp32"  # stage 1 reduces into it (offload: the host copy)
    assert reduced_grad_dtype("bf16", "fp16") == "fp32"  # bf16 with fp16
    assert reduced_grad_dtype("fp32", "bf16", "fp16") == "fp32"  # never narrower than the gradients
    with pytest.raises(ValueError, match="grad_accum_dtype='int8': allowed dtypes are fp32, bf16, fp16"):
        estimate_memory(PSI, N, 1, grad_accum_dtype="int8")
    with pytest.raises(ValueError, match="communication_data_type='fp8'"):
        recommend(PSI, gpus=N, gpu_memory=80 * GB, link="nvlink", communication_data_type="fp8")


def test_stage1_keeps_its_reduced_shard_and_scratch_buckets() -> None:
    from zero_kernels.stages.stage1 import STEP_INFLIGHT

    assert STAGE1_SCRATCH == STEP_INFLIGHT + 1
    shard, bucket = PSI // N, 10_000  # 100 buckets; 5 scratch buckets of 20 kB fit under the 250 kB shard
    plain = estimate_memory(PSI, N, 1, bucket_elements=bucket)
    assert plain.buffers == 2 * shard + 5 * 2 * bucket
    assert plain.total == plain.model_states + plain.buffers == 4 * PSI + 12 * PSI // N + plain.buffers
    wide = estimate_memory(PSI, N, 1, communication_data_type="fp32", bucket_elements=bucket)
    assert wide.buffers == 4 * shard + 5 * 4 * bucket  # an fp32 shard, fp32 scratch
    accum = estimate_memory(PSI, N, 1, grad_accum_dtype="fp32", bucket_elements=bucket)
    assert accum.buffers == 4 * shard + 5 * 2 * bucket  # an fp32 shard, scratch in the gradients' bf16
    big = estimate_memory(PSI, N, 1, bucket_elements=shard // 2 + 1)  # 16 buckets; one scratch holds more than half
    assert big.buffers == 2 * shard + 2 * (shard // 2 + 1)
    assert estimate_memory(PSI, 1, 1).buffers == 0  # one rank: the local gradient is the reduced one
    assert estimate_memory(PSI, N, 0).buffers == 0


@pytest.mark.parametrize("stage", [2, 3])
def test_stages_2_and_3_keep_idle_scratch_buckets(stage: int) -> None:
    from zero_kernels.stages.base import Pipeline
    from zero_kernels.stages.stage2 import FILLING

    assert STAGE2_SCRATCH == Pipeline.max_inflight + 1 + FILLING  # on a device (Stage2Pipeline.pool_limit)
    bucket = 10_000  # 100 buckets; 5 idle ones of 20 kB fit under the 250 kB shard
    plain = estimate_memory(PSI, N, stage, bucket_elements=bucket)
    assert plain.buffers == 5 * 2 * bucket and plain.total == plain.model_states + plain.buffers
    assert plain.model_states == 16 * PSI // N if stage == 3 else 2 * PSI + 14 * PSI // N
    wide = estimate_memory(PSI, N, stage, communication_data_type="fp32", bucket_elements=bucket)
    assert wide.buffers == 5 * 4 * bucket  # reduced in fp32
    big = estimate_memory(PSI, N, stage, bucket_elements=PSI // N // 2 + 1)  # one holds more than half the shard
    assert big.buffers == 2 * (PSI // N // 2 + 1)
    assert estimate_memory(PSI, N, stage, bucket_elements=2 * PSI // N).buffers == 0  # larger than the shard
    assert estimate_memory(PSI, 1, stage).buffers == 0


@pytest.mark.parametrize("kw", [{}, {"grad_accum_dtype": "fp32"}])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulation_holds_what_one_micro_step_holds(stage: int, kw: dict) -> None:
    # stages 0-1 add micro-steps up in the full local gradient, stages 2-3 reduce each into the shard
    assert estimate_memory(PSI, N, stage, gradient_accumulation_steps=4, **kw) == estimate_memory(PSI, N, stage, **kw)


def _measured(rank: int, world_size: int) -> list[str]:
    """``memory_report()["grads"]`` and ``buffers`` after an update of two micro-steps against the plan, and
    ``grads`` between the two against the plan of two micro-steps, at every stage and dtype. Stages 2-3 keep the
    idle scratch buckets that were in use at once, which the plan bounds (in host memory the bound grows where one
    parameter spans more than two buckets: none does here)."""
    import zero_kernels as zk

    wrong = []
    for stage in (0, 1, 2, 3):
        for wider in ({}, {"communication_data_type": "fp32"}, {"data_types": {"grad_accum_dtype": "fp32"}}):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*(torch.nn.Linear(60, 60) for _ in range(12)))  # 11 buckets
            cfg = {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                   "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 4,
                   "zero_optimization": {"stage": stage, "reduce_bucket_size": 4096}, **wider}  # fmt: skip
            module, opt = zk.initialize(model.bfloat16(), cfg)
            held_between = []
            for _ in range(2):  # as DeepSpeed's engine: a step call per micro-step, the second one updates
                module(torch.randn(4, 60, dtype=torch.bfloat16)).float().square().mean().backward()
                opt.step()
                held_between.append(opt.memory_report()["grads"])
            padded = sum(buf.layout.numel for buf in opt._pipeline.buffers)  # each a multiple of the world size
            keys = {"communication_data_type": wider.get("communication_data_type")}
            keys["grad_accum_dtype"] = wider.get("data_types", {}).get("grad_accum_dtype")
            bucket = max(b.numel for buf in opt._pipeline.buffers for b in buf.layout.buckets)
            planned = estimate_memory(padded, world_size, stage, bucket_elements=bucket, **keys)
            if held_between[0] != planned.grads:
                wrong.append(f"stage {stage} {wider}: held {held_between[0]} B of gradients between micro-steps, "
                             f"planned {planned.grads} B")  # fmt: skip
            report = opt.memory_report()
            if report["grads"] != planned.grads:
                wrong.append(f"stage {stage} {wider}: held {report['grads']} B of gradients, planned {planned.grads} B")
            held = report["buffers"]
            if held != planned.buffers if stage < 2 else not 0 < held <= planned.buffers:
                wrong.append(f"stage {stage} {wider}: held {held} B of buffers, planned {planned.buffers} B")
    return wrong


@pytest.mark.distributed
def test_the_plan_counts_the_gradients_two_ranks_hold() -> None:
    run_ranks_checked(_measured, 2)


def test_plan_takes_the_keys_and_writes_them_into_the_config(tmp_path, capsys) -> None:
    from zero_kernels.config import ZeroConfig

    path = tmp_path / "ds.json"
    args = ["plan", "--params", "7.5B", "--gpus", "64", "--gpu-memory", "40GB", "--link", "ib-400"]
    wide = ["--communication-data-type", "fp32", "--grad-accum-dtype", "fp32"]
    assert main(args + wide + ["--json", str(path)]) == 0
    rec = recommend(7_500_000_000, gpus=64, gpu_memory=40 * GB, link="ib-400", communication_data_type="fp32",
                    grad_accum_dtype="fp32")  # fmt: skip
    assert json.loads(path.read_text()) == rec.deepspeed
    assert f"recommended: ZeRO stage {rec.stage}" in capsys.readouterr().out
    assert [p.memory.grads for p in rec.plans[2:]] == [4 * shard_elements(7_500_000_000, 64)] * 2
    cfg = ZeroConfig.from_deepspeed(str(path), world_size=64)
    assert (cfg.communication_data_type, cfg.grad_accum_dtype) == (torch.float32, torch.float32)
    with pytest.raises(SystemExit):
        main(args + ["--grad-accum-dtype", "int8"])
    assert "--grad-accum-dtype: invalid choice: 'int8'" in capsys.readouterr().err
