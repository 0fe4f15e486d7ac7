"""``communication_data_type``: bf16 gradients reduced (and, at stages 2-3, added up until the step) in fp32.

Reference: every rank's local bf16 gradients, summed in float64 and divided by the world size (every stage
keeps the mean). The reduced gradients this rank holds are compared with it element by element:
reduced in fp32 they must be closer to it than reduced in bf16 (the default, as DeepSpeed's: the
gradients' own dtype), and within fp32 rounding of it where the stage keeps them in fp32 (stages 2-3).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_kernels as zk
from tests.helpers.dist import run_ranks_checked

ROWS, WIDTH = 4, 24


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 8)).to(torch.bfloat16)


def _batch(rank: int, k: int) -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(10 * rank + k)).to(torch.bfloat16)


def _reference(rank: int, world: int, passes: int) -> list[torch.Tensor]:
    """Per parameter, the float64 sum over passes of the local bf16 gradients, averaged over ranks."""
    model = _model()
    total = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
    for k in range(passes):
        model.zero_grad()
        model(_batch(rank, k)).float().square().mean().backward()
        for t, p in zip(total, model.parameters()):
            everyone = [torch.empty_like(p.grad) for _ in range(world)]
            dist.all_gather(everyone, p.grad)
            t += sum(g.double() for g in everyone)
    return [t / world for t in total]


def _errors(rank: int, world: int, stage: int, comm: str | None, passes: int) -> tuple[torch.Tensor, float]:
    """|reduced - reference| for every element of this rank's reduced gradients (float64), and the largest
    magnitude of the reference."""
    model = _model()
    opt = zk.ShardedFusedAdam(model, stage=stage, communication_data_type=comm, stage3_param_persistence_threshold=0)
    for k in range(passes):
        model(_batch(rank, k)).float().square().mean().backward()
    pipeline = opt.pipeline
    pipeline.finish_grad_sync()
    ref = _reference(rank, world, passes)
    errors = []
    for buf in pipeline.buffers:
        shard = torch.cat([pipeline.grad_shard(buf, b) for b in buf.layout.buckets]).double()
        for seg in buf.layout.segments(pipeline.shard_rank):
            want = ref[buf.indices[buf.layout.slots[seg.slot].param]].flatten()
            got = shard[seg.shard_offset : seg.shard_offset + seg.numel]
            errors.append((got - want[seg.param_offset : seg.param_offset + seg.numel]).abs())
    opt.zero_grad()
    return torch.cat(errors), max(t.abs().max().item() for t in ref)


def _cases(rank: int, world: int) -> list[str]:
    failures = []
    for stage in (0, 1, 2, 3):
        passes = 2 if stage >= 2 else 1  # stages 2-3 add the reductions of several backward passes up
        (low, scale), (wide, _) = _errors(rank, world, stage, None, passes), _errors(rank, world, stage, "fp32", passes)
        what = f"stage {stage}: mean error {wide.mean():.3g} in fp32 vs {low.mean():.3g} in bf16 (scale {scale:.3g})"
        print(f"rank {rank} {what}", flush=True)
        if not wide.mean() < low.mean():
            failures.append(f"{what}: fp32 reduction is not closer to the reference")
        if stage >= 2 and not wide.max() <= 1e-6 * scale:
            failures.append(f"{what}: max {wide.max():.3g}, more than fp32 rounding")
    return failures


@pytest.mark.distributed
def test_fp32_communication_reduces_bf16_gradients_closer_to_the_reference() -> None:
    run_ranks_checked(_cases, 3)


def _near_the_limit(rank: int, world: int) -> list[str]:
    """fp16 gradients of 40000 on every rank (each finite, their sum over 2 ranks is not): every stage averages
    before it sums, as DeepSpeed does, so the step applies (stage 1 summed first and skipped it)."""
    failures = []
    for stage in (0, 1, 2, 3):
        model = nn.Linear(8, 1, bias=False).half()
        nn.init.zeros_(model.weight)
        opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=stage, fp16={"enabled": True, "initial_scale_power": 0})
        opt.backward(model(torch.full((1, 8), 40000.0, dtype=torch.float16)).sum())
        opt.step()
        with opt.gathered_params():
            weight = model.weight.detach().float().clone()
        if opt.skipped_steps or not torch.allclose(weight, torch.full_like(weight, -1e-2), rtol=1e-3):
            failures.append(f"rank {rank} stage {stage}: skipped {opt.skipped_steps}, weights {weight.tolist()}")
    return failures


@pytest.mark.distributed
def test_fp16_gradients_whose_sum_overflows_are_averaged_first() -> None:
    run_ranks_checked(_near_the_limit, 2)


def test_communication_data_type_is_read_checked_and_copied() -> None:
    model = nn.Linear(4, 4)
    cases = (("fp32", torch.float32), ("BF16", torch.bfloat16), (torch.float16, torch.float16), (None, None))
    for value, dtype in cases:
        opt = zk.ShardedFusedAdam(model, stage=2, communication_data_type=value)
        assert opt.communication_data_type == dtype and opt.pipeline.comm_dtype == dtype
    with pytest.raises(ValueError, match="communication_data_type='fp8'; allowed: fp32, fp16, bf16"):
        zk.ShardedFusedAdam(model, communication_data_type="fp8")
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2}, "communication_data_type": "fp32"}  # fmt: skip
    _, opt = zk.initialize(nn.Linear(4, 4), config)
    assert opt.communication_data_type == torch.float32
    assert opt.pipeline.buffers[0].grad_shard.dtype == torch.float32, "bf16 gradients added up in fp32"
    assert copy.deepcopy(opt).communication_data_type == torch.float32
    del config["communication_data_type"]
    _, opt = zk.initialize(nn.Linear(4, 4), config)
    assert opt.communication_data_type is None and opt.pipeline.buffers[0].grad_shard.dtype == torch.bfloat16
