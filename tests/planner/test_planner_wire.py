"""The planner's wire bytes per optimizer step: gradient reductions in ``communication_data_type``, parameter
all-gathers in the parameters' dtype, and what ``gradient_accumulation_steps`` repeats, against the collectives two
ranks issue."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from tests.helpers.dist import run_ranks_checked
from zero_kernels.__main__ import main
from zero_kernels.planner import estimate_comm, offload_cli, recommend
from zero_kernels.planner.cli import add_arguments
from zero_kernels.planner.models import reduces_micro_steps

GB = 10**9
PSI, N = 1_000_000_000, 8
LINK = {"link_gbps": 50.0, "latency_us": 0.0}
RING = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}  # times (N - 1)/N of the buffer each rank sends


def _ring(kind: str, nbytes: int, world_size: int) -> int:
    return RING[kind] * (world_size - 1) * nbytes // world_size


@pytest.mark.parametrize("stage, grads, params", [(0, 2, 0), (1, 1, 1), (2, 1, 1), (3, 1, 2)])
def test_gradients_cross_in_the_communication_dtype_parameters_in_theirs(stage: int, grads: int, params: int) -> None:
    # a 1B-parameter bf16 model on 8 ranks, gradients reduced in fp32: the reductions take 4 bytes per element
    est = estimate_comm(PSI, N, stage, comm_dtype="fp32", param_dtype="bf16", **LINK)
    assert est.grad_bytes == grads * 4 * PSI * (N - 1) // N
    assert est.param_bytes == params * 2 * PSI * (N - 1) // N
    assert est.bytes_sent == est.grad_bytes + est.param_bytes
    plain = estimate_comm(PSI, N, stage, param_dtype="bf16", **LINK)
    assert (plain.grad_bytes * 2, plain.param_bytes) == (est.grad_bytes, est.param_bytes)
    assert est.bandwidth_s == pytest.approx(est.bytes_sent / 50e9, rel=1e-12)


def test_recommend_reduces_in_the_communication_dtype() -> None:
    kw = {"gpus": N, "gpu_memory": 80 * GB, "link": "ib-400"}
    plain, wide = recommend(PSI, **kw), recommend(PSI, **kw, communication_data_type="fp32")
    for p, w in zip(plain.plans, wide.plans):
        assert (w.comm.grad_bytes, w.comm.param_bytes) == (2 * p.comm.grad_bytes, p.comm.param_bytes), w.stage


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulation_repeats_what_the_stage_repeats(stage: int) -> None:
    one = estimate_comm(PSI, N, stage, **LINK)
    four = estimate_comm(PSI, N, stage, gradient_accumulation_steps=4, **LINK)
    per_micro = stage >= 2  # Pipeline.reduces_micro_steps
    assert reduces_micro_steps(stage) == per_micro
    assert four.grad_bytes == (4 if per_micro else 1) * one.grad_bytes
    assert four.param_bytes == (4 if stage == 3 else 1) * one.param_bytes  # stage 3 gathers at every micro-step
    assert four.time_s == pytest.approx(one.time_s + 3 * four.micro_time_s)
    assert four.micro_steps == 4 and one.micro_time_s == four.micro_time_s


def test_micro_step_communication_hides_behind_each_micro_step() -> None:
    kw = {"gpus": N, "gpu_memory": 80 * GB, "link": "ib-400", "compute_s": 1.0, "latency_us": 0.0}
    one = recommend(PSI, **kw).plans[3]
    four = recommend(PSI, **kw, gradient_accumulation_steps=4).plans[3]
    # stage 3's gathers: 1.75 GB (35 ms at 50 GB/s) per pass; 1/3 s of forward hides one, 1/12 s too
    assert one.exposed_comm_s == pytest.approx(0.0) and four.exposed_comm_s == pytest.approx(0.0)
    slow = recommend(PSI, **kw, gradient_accumulation_steps=20, link_gbps=10.0).plans[3]
    gather = reduce = 2 * PSI * (N - 1) / N / 10e9  # 0.175 s each, against 1/60 s of forward, 1/30 s of backward
    hidden = 20 * (gather - 1 / 60) + 20 * (gather + reduce - 1 / 30)  # every micro-step's backward reduces
    assert slow.exposed_comm_s == pytest.approx(hidden)


def test_the_offload_estimate_reads_the_same_micro_steps_under_either_name() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--params", "1B", "--gpus", "8", "--gpu-memory", "80GB", "--link", "ib-400", "--offload", "cpu"]
    base += ["--device-kind", "h100", "--cpu-adam-gbps", "10", "--host-memory", "64GB"]
    for flag in ("--gradient-accumulation-steps", "--grad-accum"):  # the second: the offload options' older name
        assert offload_cli.setup(parser.parse_args(base + [flag, "4"]))[0].grad_accum == 4
    assert offload_cli.setup(parser.parse_args(base))[0].grad_accum == 1


def test_plan_takes_gradient_accumulation_steps_and_writes_it(tmp_path, capsys) -> None:
    path = tmp_path / "ds.json"
    args = ["plan", "--params", "1B", "--gpus", "8", "--gpu-memory", "80GB", "--link", "ib-400"]
    assert main(args + ["--gradient-accumulation-steps", "4", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "comm/micro-step" in out and "per optimizer step of 4 micro-steps" in out
    assert json.loads(path.read_text())["gradient_accumulation_steps"] == 4
    assert main(args + ["--json", str(path)]) == 0
    assert json.loads(path.read_text())["gradient_accumulation_steps"] == 1
    with pytest.raises(SystemExit):
        main(args + ["--gradient-accumulation-steps", "0"])
    assert "--gradient-accumulation-steps='0': must be > 0" in capsys.readouterr().err


_CONTROL = ("step.", "clip.", "stage3.", "state.", "exact.", "frozen")  # host exchanges, checks, saving


def _measured(rank: int, world_size: int) -> list[str]:
    """Bytes the gradient reductions and the parameter all-gathers send over an optimizer step of two micro-steps,
    by the ring formula on each collective's full buffer, against the plan."""
    import zero_kernels as zk

    wrong = []
    for stage in (0, 1, 2, 3):
        for wider in ({}, {"communication_data_type": "fp32"}, {"data_types": {"grad_accum_dtype": "fp32"}}):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(64, 257), torch.nn.GELU(), torch.nn.Linear(257, 64))
            zero = {"stage": stage, "reduce_bucket_size": 4096, "stage3_param_persistence_threshold": 0}
            cfg = {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                   "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 4,
                   "zero_optimization": zero, **wider}  # fmt: skip
            module, opt = zk.initialize(model.bfloat16(), cfg)
            engine, sent = opt._pipeline.engine, {"grads": 0, "params": 0}

            def counted(kind: str, call):  # noqa: ANN001, ANN202 - a wrapper of the engine's method
                def run(*args, name: str = "", **kw):  # noqa: ANN002, ANN003, ANN202
                    full = args[1] if kind == "reduce_scatter" else args[0]
                    if not name.startswith(_CONTROL):
                        payload = "grads" if name.startswith("grads.") else "params"
                        sent[payload] += _ring(kind, full.numel() * full.element_size(), world_size)
                    return call(*args, name=name, **kw)

                return run

            for kind in RING:
                setattr(engine, kind, counted(kind, getattr(engine, kind)))
            for _ in range(2):  # as DeepSpeed's engine: a step call per micro-step, the second one updates
                module(torch.randn(4, 64, dtype=torch.bfloat16)).float().square().mean().backward()
                opt.step()
            padded = sum(buf.layout.numel for buf in opt._pipeline.buffers)
            comm_dtype = wider.get("communication_data_type")
            est = estimate_comm(padded, world_size, stage, gradient_accumulation_steps=2, comm_dtype=comm_dtype, **LINK)
            planned = {"grads": est.grad_bytes, "params": est.param_bytes}
            if sent != planned:
                wrong.append(f"stage {stage} {wider}: sent {sent}, planned {planned}")
    return wrong


@pytest.mark.distributed
def test_the_plan_counts_the_bytes_two_ranks_send() -> None:
    run_ranks_checked(_measured, 2)
