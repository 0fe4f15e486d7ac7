"""``grad_accum_dtype`` (DeepSpeed's ``data_types.grad_accum_dtype``): bf16/fp16 gradients added up in fp32 over
``gradient_accumulation_steps`` micro-steps, at every stage.

Reference: every rank's local bf16 gradient of every micro-step, gathered, and the mean over ranks of their
sum over micro-steps taken in float64. The reduced gradients this rank holds after the last micro-step's
backward (stage 1: their sum over ranks, halved here) are compared with it element by element. Reduced in fp32
(``communication_data_type``) and accumulated in fp32 they are within fp32 rounding of it. Reduced in bf16 (the
default) and accumulated in fp32: stages 2-3 reduce every micro-step, so they equal the float64 sum of the
micro-steps' bf16 reductions (each ``bf16(a + b)`` of the two ranks' halves); stages 0-1 reduce each rank's fp32
sum once, so they equal the bf16 reduction of those sums rounded to bf16; both within fp32 rounding. Accumulated
in bf16 (the key absent) they are not at stages 0-1: the check fails there; stages 2-3 reduce every micro-step,
into a shard of the fp32 communication dtype, so they are within fp32 rounding there too. A checkpoint saved inside the
window resumes it bit for bit (stages 2-3 save the fp32 shard of the reduced micro-steps, stages 0-1 the fp32 sums of
the local ones).

Stages 0-1 with fp16 under ``torch.amp.GradScaler``: ``scaler.unscale_``, torch's ``clip_grad_norm_`` (routed to
the optimizer) and ``scaler.step`` on the last micro-step. The norm returned and the gradient the step used (its
first ``exp_avg`` is ``(1 - beta1)`` times it) are within fp32 rounding of the float64 reference (the mean over
ranks of the summed fp16 micro-step gradients, unscaled, divided by the micro-steps, clipped).
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
SCALE = 2.0**8  # GradScaler's initial scale in the fp16 cases


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 8)).to(torch.bfloat16)


def _loss(model: nn.Module, rank: int, k: int) -> torch.Tensor:
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(10 * rank + k))
    x = x.to(next(model.parameters()).dtype)
    return model(x).float().square().mean()


def _references(world: int, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0) -> dict[str, list[torch.Tensor]]:
    """Per parameter, float64: ``exact``, the mean over ranks of the micro-steps' summed gradients (of the loss times
    ``scale``); ``micro``, the sum over micro-steps of their reduction in ``dtype`` (each rank's gradient halved, the
    halves added in ``dtype``); ``local``, the reduction in ``dtype`` of each rank's fp32 sum of its micro-steps."""
    model = _model().to(dtype)
    exact, micro = [[torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()] for _ in range(2)]
    sums = [[torch.zeros(p.shape) for _ in range(world)] for p in model.parameters()]
    for k in range(STEPS):
        model.zero_grad()
        (_loss(model, dist.get_rank(), k) * scale).backward()
        for e, r, rank_sums, p in zip(exact, micro, sums, model.parameters()):
            everyone = [torch.empty_like(p.grad) for _ in range(world)]
            dist.all_gather(everyone, p.grad)
            e += sum(g.double() for g in everyone) / world
            r += sum((g / world).float() for g in everyone).to(dtype).double()
            for total, g in zip(rank_sums, everyone):
                total += g.float()
    local = [sum(t.to(dtype).float() for t in rank_sums).to(dtype).double() / world for rank_sums in sums]
    return {"exact": exact, "micro": micro, "local": local}


def _errors(rank: int, stage: int, accum: str | None, comm: str | None, want: list[torch.Tensor]) -> torch.Tensor:
    """|reduced - want| for every element of this rank's reduced gradients after the STEPS micro-steps of a second
    window."""
    model = _model()
    opt = zk.ShardedFusedAdam(model, lr=0.0, stage=stage, gradient_accumulation_steps=STEPS, grad_accum_dtype=accum,
                              communication_data_type=comm, stage3_param_persistence_threshold=0)  # fmt: skip
    for k in range(2 * STEPS):  # the second window is measured: the first one's gradients must not linger (lr=0)
        _loss(model, rank, k % STEPS).backward()
        if k < 2 * STEPS - 1:
            opt.step()  # a micro-step: no update; at the window's end: an update by 0
            if k % STEPS < STEPS - 1:
                opt.zero_grad()  # ignored inside the window
            else:
                model.zero_grad()  # as the Hugging Face Trainer clears: the optimizer's own buffers stay as they are
    pipeline = opt.pipeline
    if stage < 2 and accum:  # stages 0-1 hold the fp32 sums themselves, as stages 2-3 the reduced ones
        assert all(p.grad is None for p in model.parameters()), "p.grad after backward, fp32 accumulation"
    pipeline.finish_grad_sync()
    errors = []
    for buf in pipeline.buffers:
        wide = accum is not None or (comm is not None and stage > 0)  # stage 0 writes a reduction back in bf16
        kept = pipeline.grad_shard(buf, buf.layout.buckets[0]).dtype
        assert kept == (torch.float32 if wide else torch.bfloat16), (stage, accum, comm, kept)
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


def _scaled_and_clipped(rank: int, world: int, stage: int, want: dict[str, list[torch.Tensor]]) -> list[str]:
    """fp16 under GradScaler with clipping, fp32 accumulation: the norm and the gradient the step used."""
    model = _model().half()
    opt = zk.ShardedFusedAdam(model, stage=stage, gradient_accumulation_steps=STEPS, grad_accum_dtype="fp32",
                              communication_data_type="fp32", weight_decay=0.0)  # fmt: skip
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    grads = [e / (SCALE * STEPS) for e in want["exact"]]
    ref_norm = torch.cat([g.flatten() for g in grads]).norm().item()
    max_norm = ref_norm / 2
    for k in range(STEPS):  # a window of zero gradients: the optimizer sees the scaler, nothing moves (m stays 0)
        scaler.scale(0 * _loss(model, rank, k)).backward()
        if k < STEPS - 1:
            opt.step()
    scaler.step(opt)
    scaler.update()
    for k in range(STEPS):
        scaler.scale(_loss(model, rank, k)).backward()
        assert all(p.grad is None for p in model.parameters()), "p.grad after backward, fp32 accumulation"
        if k < STEPS - 1:
            opt.step()
            continue
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
        scaler.step(opt)
        scaler.update()
    coef = max_norm / (ref_norm + 1e-6)
    state = opt.full_state_dict()["state"]
    err = max(((state[i]["exp_avg"].double() - 0.1 * coef * g).abs().max().item() for i, g in enumerate(grads)))
    scale = 0.1 * coef * max(g.abs().max().item() for g in grads)
    line = f"stage {stage}, fp16 GradScaler: norm {norm:.6g} (float64 {ref_norm:.6g}), exp_avg error {err:.3g}"
    print(f"rank {rank} {line} (scale {scale:.3g})", flush=True)
    if abs(norm - ref_norm) > 1e-6 * ref_norm or err > 1e-6 * scale:
        return [f"{line}: expected within fp32 rounding"]
    return []


def _without_first_layer(rank: int, world: int, stage: int) -> list[str]:
    """Rank 1 gives the first layer no gradient in the measured window: its slot must not hold the previous window's
    sum. The reduced gradients equal those of a fresh optimizer given only that window (lr=0: the same model)."""

    def reduced(windows: int) -> torch.Tensor:
        model = _model()
        opt = zk.ShardedFusedAdam(model, lr=0.0, stage=stage, gradient_accumulation_steps=2, grad_accum_dtype="fp32")
        for k in range(2 * windows):
            skip = rank == 1 and k >= 2 * windows - 2
            x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(10 * rank + k % 2)).to(torch.bfloat16)
            h = model[0](x).detach() if skip else model[0](x)
            model[2](model[1](h)).float().square().mean().backward()
            if k < 2 * windows - 1:
                opt.step()
        opt.pipeline.finish_grad_sync()
        return torch.cat([opt.pipeline.grad_shard(b, k) for b in opt.pipeline.buffers for k in b.layout.buckets])

    if not torch.equal(reduced(2), reduced(1)):
        return [f"stage {stage}: a slot without a gradient on rank 1 kept the previous window's sum"]
    return []


def _cases(rank: int, world: int, root: str) -> list[str]:
    want = _references(world)
    exact = want["exact"]
    scale = max(t.abs().max().item() for t in exact)
    failures = []
    for stage in (0, 1, 2, 3):
        bf16_reduced = want["micro" if stage >= 2 else "local"]
        runs = {
            "fp32 accumulation, fp32 reduction": (_errors(rank, stage, "fp32", "fp32", exact), True),
            "fp32 accumulation, bf16 reduction": (_errors(rank, stage, "fp32", None, bf16_reduced), True),
            # stages 2-3 reduce every micro-step into a shard of the communication dtype: the sum is fp32's there
            "bf16 accumulation, fp32 reduction": (_errors(rank, stage, None, "fp32", exact), stage >= 2),
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
    fp16 = _references(world, torch.float16, SCALE)
    for stage in (0, 1):
        failures += _scaled_and_clipped(rank, world, stage, fp16)
        failures += _without_first_layer(rank, world, stage)
    return failures


@pytest.mark.distributed
def test_fp32_accumulation_of_bf16_micro_steps_at_every_stage(tmp_path: Path) -> None:
    run_ranks_checked(_cases, 2, str(tmp_path), timeout_s=300.0)


@pytest.mark.parametrize("stage", [0, 1])
def test_stages_0_and_1_accumulate_in_a_wide_buffer(stage: int, caplog: pytest.LogCaptureFixture) -> None:
    """Outside p.grad, 4 bytes per element shown as grads; no warning; micro-steps stay unreduced."""
    model = _model()
    numel = sum(p.numel() for p in model.parameters())
    before = zk.ShardedFusedAdam(_model(), stage=stage).memory_report()["grads"]
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        opt = zk.ShardedFusedAdam(model, stage=stage, gradient_accumulation_steps=STEPS, grad_accum_dtype="fp32")
    assert "grad_accum_dtype" not in caplog.text
    assert not opt.pipeline.reduces_micro_steps and not opt.pipeline.sync_enabled and not opt.pipeline.grads_in_p_grad
    assert [buf.grad_flat.dtype for buf in opt.pipeline.buffers] == [torch.float32]
    assert (before, opt.memory_report()["grads"]) == (2 * numel, 4 * numel)


def test_narrower_accumulation_dtype_never_narrows(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        opt = zk.ShardedFusedAdam(nn.Linear(4, 4), stage=2, gradient_accumulation_steps=2, grad_accum_dtype="bf16")
    assert "grad_accum_dtype='bf16' is narrower than the fp32 gradients" in caplog.text
    assert opt.pipeline.buffers[0].grad_shard.dtype == torch.float32


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("model_dtype, accum", [(torch.float16, "bf16"), (torch.bfloat16, "fp16")])
def test_the_other_16_bit_dtype_adds_up_in_fp32_and_says_so(
    model_dtype: torch.dtype, accum: str, stage: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Stage 3 (which builds its buffers apart) gave no warning at all, this one nor the narrower one's."""
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        opt = zk.ShardedFusedAdam(
            nn.Linear(4, 4).to(model_dtype), stage=stage, gradient_accumulation_steps=2, grad_accum_dtype=accum
        )
    assert f"grad_accum_dtype={accum!r} cannot hold" in caplog.text and "accumulates them in fp32" in caplog.text
    wide = [buf.grad_flat if stage == 1 else buf.grad_shard for buf in opt.pipeline.buffers]
    assert [t.dtype for t in wide] == [torch.float32]


def test_a_narrower_dtype_is_warned_at_stage_3(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        zk.ShardedFusedAdam(nn.Linear(4, 4), stage=3, gradient_accumulation_steps=2, grad_accum_dtype="fp16")
    assert "grad_accum_dtype='fp16' is narrower than the fp32 gradients" in caplog.text


def test_keyword_is_checked_and_read_from_the_config() -> None:
    with pytest.raises(ValueError, match="grad_accum_dtype='fp8'; allowed: fp32, fp16, bf16"):
        zk.ShardedFusedAdam(nn.Linear(4, 4), grad_accum_dtype="fp8")
    for spelling, dtype in (("float32", torch.float32), ("Half", torch.float16), ("torch.bfloat16", torch.bfloat16)):
        assert zk.ShardedFusedAdam(nn.Linear(4, 4), grad_accum_dtype=spelling).grad_accum_dtype == dtype
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


@pytest.mark.parametrize("stage", [0, 1])
def test_a_parameter_kept_with_a_zero_gradient_sees_zero(stage: int) -> None:
    """``zero_grad(set_to_none=False)``, then a window whose backward skips the first layer: the step gives it a zero
    gradient (its m decays), not the last window's sum left in its slot."""
    model = _model()
    opt = zk.ShardedFusedAdam(model, stage=stage, gradient_accumulation_steps=2, grad_accum_dtype="fp32")
    first = model[0].weight
    for k in range(2):
        _loss(model, 0, k).backward()
        opt.step()
    before = opt.state[first]["exp_avg"].clone()
    opt.zero_grad(set_to_none=False)
    x = torch.randn(ROWS, WIDTH).to(torch.bfloat16)
    for _ in range(2):
        model[2](model[1](model[0](x).detach())).float().square().mean().backward()
        opt.step()
    assert first.grad is None and before.abs().max() > 0
    torch.testing.assert_close(opt.state[first]["exp_avg"], 0.9 * before, rtol=1e-6, atol=0)


def test_torch_clip_reaches_the_wide_buffer() -> None:
    """Stage 0, one rank, micro-steps under ``no_sync``: torch's clip_grad_norm_ (``p.grad`` is None) is routed to the
    optimizer and measures the fp32 sum (float64 reference: the micro-steps' bf16 gradients added up)."""
    ref, model = _model(), _model()
    sums = [torch.zeros(p.shape, dtype=torch.float64) for p in ref.parameters()]
    for k in range(2):
        ref.zero_grad()
        _loss(ref, 0, k).backward()
        for total, p in zip(sums, ref.parameters()):
            total += p.grad.double()
    opt = zk.ShardedFusedAdam(model, stage=0, grad_accum_dtype="fp32")
    with opt.no_sync():
        _loss(model, 0, 0).backward()
    _loss(model, 0, 1).backward()
    want = torch.cat([t.flatten() for t in sums]).norm().item()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3).item()
    assert abs(norm - want) <= 1e-6 * want, (norm, want)


def test_a_window_of_fp32_sums_loads_only_where_they_are_kept(tmp_path: Path) -> None:
    """Saved inside a window at stage 1 with fp32 accumulation: an optimizer without it refuses the window."""
    model = _model()
    opt = zk.ShardedFusedAdam(model, stage=1, gradient_accumulation_steps=2, grad_accum_dtype="fp32")
    _loss(model, 0, 0).backward()
    opt.step()
    ck.save(tmp_path, model, opt)
    plain = _model()
    with pytest.raises(ck.CheckpointError, match="gradients added up in a wider grad_accum_dtype"):
        ck.load(tmp_path, plain, zk.ShardedFusedAdam(plain, stage=1, gradient_accumulation_steps=2))


@pytest.mark.parametrize("stage", [0, 1])
def test_a_parameter_given_another_shape_is_named_at_backward(stage: int) -> None:
    """With the wide local buffer of stages 0-1, a ``p.data`` of another shape since the optimizer was built (a
    resize without ``resize_token_embeddings`` first) made the gradient hook's add fail in torch ('The size of
    tensor a (5) must match the size of tensor b (6)'); without the key the hook names the parameter and what to do.
    Now it does with the key too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 5)).to(torch.bfloat16)
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=stage, grad_accum_dtype="fp32")
    model[1].weight.data = torch.randn(6, 5, dtype=torch.bfloat16)  # an output grown by one (a vocabulary)
    model[1].bias.data = torch.randn(6, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"parameter '1\.\w+' was replaced after the optimizer was built .*shape"):
        model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    assert opt.pipeline.wide_local, "the case of the wide local buffer"
