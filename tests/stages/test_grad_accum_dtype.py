"""``grad_accum_dtype`` (DeepSpeed's ``data_types.grad_accum_dtype``): bf16 gradients added up in fp32 over
``gradient_accumulation_steps`` micro-steps at stages 2-3; stages 0-1 warn and keep adding up in ``p.grad``.

Reference: every rank's local bf16 gradient of every micro-step, gathered, and the mean over ranks of their
sum over micro-steps taken in float64. The reduced gradients this rank holds after the last micro-step's
backward are compared with it element by element. Reduced in fp32 (``communication_data_type``) and
accumulated in fp32 they are within fp32 rounding of it. Reduced in bf16 (the default) and accumulated in
fp32 they equal the float64 sum of the micro-steps' bf16 reductions (each ``bf16(a + b)`` of the two ranks'
halves) within fp32 rounding. Accumulated in bf16 (the key absent) they are not: the check fails there.
A checkpoint saved inside the window resumes it bit for bit (the fp32 shard of the reduced micro-steps is saved).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_kernels as zk
import zero_kernels.checkpoint as ck
from tests.helpers.dist import run_ranks_checked

ROWS, WIDTH, STEPS = 4, 24, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 8)).to(torch.bfloat16)


def _loss(model: nn.Module, rank: int, k: int) -> torch.Tensor:
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(10 * rank + k)).to(torch.bfloat16)
    return model(x).float().square().mean()


def _references(world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per parameter, float64: the mean over ranks of the micro-steps' summed gradients, and the sum over
    micro-steps of their bf16 reduction (each rank's gradient halved in bf16, the halves added in bf16)."""
    model = _model()
    exact = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
    bf16_reduced = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
    for k in range(STEPS):
        model.zero_grad()
        _loss(model, dist.get_rank(), k).backward()
        for e, r, p in zip(exact, bf16_reduced, model.parameters()):
            everyone = [torch.empty_like(p.grad) for _ in range(world)]
            dist.all_gather(everyone, p.grad)
            e += sum(g.double() for g in everyone) / world
            r += sum((g / world).float() for g in everyone).bfloat16().double()
    return exact, bf16_reduced


def _errors(rank: int, stage: int, accum: str | None, comm: str | None, want: list[torch.Tensor]) -> torch.Tensor:
    """|reduced - want| for every element of this rank's reduced gradients after STEPS micro-steps."""
    model = _model()
    opt = zk.ShardedFusedAdam(model, stage=stage, gradient_accumulation_steps=STEPS, grad_accum_dtype=accum,
                              communication_data_type=comm, stage3_param_persistence_threshold=0)  # fmt: skip
    for k in range(STEPS):
        _loss(model, rank, k).backward()
        if k < STEPS - 1:
            opt.step()  # a micro-step: no update
            opt.zero_grad()  # ignored inside the window
    pipeline = opt.pipeline
    pipeline.finish_grad_sync()
    errors = []
    for buf in pipeline.buffers:
        assert buf.grad_shard.dtype == (torch.float32 if accum or comm else torch.bfloat16), buf.grad_shard.dtype
        shard = torch.cat([pipeline.grad_shard(buf, b) for b in buf.layout.buckets]).double()
        for seg in buf.layout.segments(pipeline.shard_rank):
            ref = want[buf.indices[buf.layout.slots[seg.slot].param]].flatten()
            got = shard[seg.shard_offset : seg.shard_offset + seg.numel]
            errors.append((got - ref[seg.param_offset : seg.param_offset + seg.numel]).abs())
    return torch.cat(errors)


def _train(rank: int, stage: int, root: str | None) -> dict[str, torch.Tensor]:
    """Two steps of STEPS micro-steps with fp32 accumulation; with ``root``, saved after the second micro-step of
    the second step and loaded into a fresh model and optimizer. The parameters and Adam state after them."""

    def build() -> tuple[nn.Module, zk.ShardedFusedAdam]:
        model = _model()
        opt = zk.ShardedFusedAdam(model, stage=stage, gradient_accumulation_steps=STEPS, grad_accum_dtype="fp32",
                                  stage3_param_persistence_threshold=0)  # fmt: skip
        return model, opt

    model, opt = build()
    for step in range(2):
        for k in range(STEPS):
            _loss(model, rank, 10 * step + k).backward()
            opt.step()
            opt.zero_grad()
            if root is not None and (step, k) == (1, 1):
                ck.save(root, model, opt)
                model, opt = build()
                ck.load(root, model, opt)
    out = {f"state {i} {k}": v for i, entry in opt.full_state_dict()["state"].items() for k, v in entry.items()}
    with opt.gathered_params():
        out.update({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _cases(rank: int, world: int, root: str) -> list[str]:
    exact, bf16_reduced = _references(world)
    scale = max(t.abs().max().item() for t in exact)
    failures = []
    for stage in (2, 3):
        runs = {
            "fp32 accumulation, fp32 reduction": (_errors(rank, stage, "fp32", "fp32", exact), True),
            "fp32 accumulation, bf16 reduction": (_errors(rank, stage, "fp32", None, bf16_reduced), True),
            "bf16 accumulation, fp32 reduction": (_errors(rank, stage, None, "fp32", exact), False),
        }
        for what, (err, within) in runs.items():
            line = f"stage {stage}, {what}: max error {err.max():.3g} (scale {scale:.3g})"
            print(f"rank {rank} {line}", flush=True)
            if (err.max() <= 1e-6 * scale) != within:
                failures.append(f"{line}: expected {'within' if within else 'beyond'} fp32 rounding")
        expected, got = _train(rank, stage, None), _train(rank, stage, f"{root}/stage{stage}")
        differ = [key for key in expected if not torch.equal(got[key], expected[key])]
        if differ:
            failures.append(f"stage {stage}: resumed from mid-window, {', '.join(differ)} differ")
    return failures


@pytest.mark.distributed
def test_fp32_accumulation_of_bf16_micro_steps_at_stages_2_and_3(tmp_path: Path) -> None:
    run_ranks_checked(_cases, 2, str(tmp_path))


@pytest.mark.parametrize("stage", [0, 1])
def test_stages_0_and_1_warn_and_keep_bf16_accumulation(stage: int, caplog: pytest.LogCaptureFixture) -> None:
    model = _model()
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        opt = zk.ShardedFusedAdam(model, stage=stage, gradient_accumulation_steps=STEPS, grad_accum_dtype="fp32")
    assert f"data_types.grad_accum_dtype='fp32' is not acted on at stage {stage}" in caplog.text
    assert not opt.pipeline.reduces_micro_steps and not opt.pipeline.sync_enabled
    assert all(opt.pipeline.accumulate_dtype_of(buf) == torch.bfloat16 for buf in opt.pipeline.buffers)


def test_narrower_accumulation_dtype_never_narrows(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        opt = zk.ShardedFusedAdam(nn.Linear(4, 4), stage=2, gradient_accumulation_steps=2, grad_accum_dtype="bf16")
    assert "grad_accum_dtype='bf16' is narrower than the fp32 gradients" in caplog.text
    assert opt.pipeline.buffers[0].grad_shard.dtype == torch.float32 and not opt.pipeline.reduces_micro_steps


def test_keyword_is_checked_and_read_from_the_config() -> None:
    with pytest.raises(ValueError, match="grad_accum_dtype='fp8'; allowed: fp32, fp16, bf16"):
        zk.ShardedFusedAdam(nn.Linear(4, 4), grad_accum_dtype="fp8")
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2,
              "data_types": {"grad_accum_dtype": "fp32"}}  # fmt: skip
    _, opt = zk.initialize(nn.Linear(4, 4), config)
    assert opt.grad_accum_dtype == torch.float32 and opt.pipeline.accum_dtype == torch.float32
    assert opt.pipeline.buffers[0].grad_shard.dtype == torch.float32 and opt.pipeline.sync_enabled
    assert copy.deepcopy(opt).pipeline.accum_dtype == torch.float32
    del config["data_types"]
    _, opt = zk.initialize(nn.Linear(4, 4), config)
    assert opt.grad_accum_dtype is None and opt.pipeline.buffers[0].grad_shard.dtype == torch.bfloat16
    assert not opt.pipeline.sync_enabled, "bf16 micro-steps add up in p.grad, unreduced"
