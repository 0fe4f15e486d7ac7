"""``torch.amp.GradScaler`` at every stage on 1-3 gloo ranks, against ``torch.optim.AdamW`` with its own
GradScaler on the whole batch: ``scaler.scale(loss).backward()``, ``scaler.step(opt)``,
``scaler.update()``, with ``scaler.unscale_(opt)`` and ``opt.clip_grad_norm_`` between, or with
``max_grad_norm``; fp32 parameters, and fp16 autocast. One step gets an inf input on the last rank:
both skip it and back off, and the scales then grow alike (``growth_interval=2``). Parameters and
scales are compared after every step, element by element. The reference runs each rank's rows through
forward and backward on their own and averages the gradients, as the ranks do, so that fp16 autocast
rounds alike.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

import zero_kernels as zk
import zero_kernels.optim as zo
from tests.helpers.dist import run_ranks_checked
from tests.helpers.lockstep import BUCKET, LR, ROWS, STAGES, WORLD_SIZES, batch, compare, make_models

MAX_NORM = 0.05
SCALER = dict(init_scale=2.0**12, growth_interval=2)
OVERFLOW_STEP = 2


def _inputs(step: int, world: int) -> torch.Tensor:
    x = batch(step, world * ROWS)
    if step == OVERFLOW_STEP:
        x[-1, 0] = math.inf  # on the last rank's rows
    return x


def _autocast(fp16: bool) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.float16) if fp16 else contextlib.nullcontext()


def _scaled_loop(rank: int, world: int, stage: int, mode: str, fp16: bool) -> None:
    """``mode``: ``plain``, ``unscale_clip`` (unscale_, then clip), or ``max_grad_norm`` (clipping in the step)."""
    model, ref = make_models(torch.float32)
    kwargs = {"max_grad_norm": MAX_NORM} if mode == "max_grad_norm" else {}
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=BUCKET, **kwargs)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    scaler, rscaler = torch.amp.GradScaler("cpu", **SCALER), torch.amp.GradScaler("cpu", **SCALER)
    what = f"stage {stage} {mode}{' fp16 autocast' if fp16 else ''}"
    for step in range(5):
        x = _inputs(step, world)
        with _autocast(fp16):
            loss = model(x[rank * ROWS : (rank + 1) * ROWS])
        scaler.scale(loss).backward()
        for r in range(world):  # each rank's rows on their own, averaged as the ranks average them
            with _autocast(fp16):
                rloss = ref(x[r * ROWS : (r + 1) * ROWS])
            rscaler.scale(rloss).backward()
        for p in ref.parameters():
            if p.grad is not None:
                p.grad /= world
        if mode == "unscale_clip":
            scaler.unscale_(opt)
            norm = opt.clip_grad_norm_(MAX_NORM)
            rscaler.unscale_(ropt)
            rnorm = nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
            if step > 0 and math.isfinite(rnorm):  # from the second step on the optimizer knows the scaler
                assert float(norm) == pytest.approx(float(rnorm), rel=1e-4), f"{what} step {step}: norm"
        if mode == "max_grad_norm":
            rscaler.unscale_(ropt)
            nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        scaler.step(opt)
        rscaler.step(ropt)
        scaler.update()
        rscaler.update()
        opt.zero_grad()
        ropt.zero_grad()
        assert scaler.get_scale() == rscaler.get_scale(), f"{what} step {step}: scale"
        assert opt.last_step.skipped == (step == OVERFLOW_STEP), f"{what} step {step}: skipped"
        with opt.gathered_params():
            compare(model, ref, f"{what} step {step}")
    assert scaler.get_scale() > SCALER["init_scale"] / 2, f"{what}: the scale never grew back"


def _misuse(rank: int, world: int) -> None:
    """GradScaler with the fp16 config, and scaler.step on a micro-step that does not update: errors."""
    model, _ = make_models(torch.float32)
    scaler = torch.amp.GradScaler("cpu")
    for kwargs, error, message in (
        (dict(fp16={"enabled": True}), ValueError, "both scale the loss"),
        (dict(gradient_accumulation_steps=2), RuntimeError, "micro-step 1 of 2"),
    ):
        opt = zo.ShardedFusedAdam(model, lr=LR, stage=2, **kwargs)
        scaler.scale(model(batch(0, ROWS))).backward()
        with pytest.raises(error, match=message):
            scaler.step(opt)
        opt.pipeline.close()
        scaler = torch.amp.GradScaler("cpu")


def _body(rank: int, world: int) -> list[str]:
    problems = []
    cases = [(_misuse, ())]
    for stage in STAGES:  # scaled gradients at the step (READY), and unscaled before it (UNSCALED)
        cases += [(_scaled_loop, (stage, "max_grad_norm", False)), (_scaled_loop, (stage, "unscale_clip", False))]
        cases.append((_scaled_loop, (stage, "plain", True)))
    for case, args in cases:
        try:
            case(rank, world, *args)
        except Exception as err:  # every case runs; each rank reports what it found wrong
            problems.append(f"{case.__name__}{args}: {type(err).__name__}: {err}")
    return problems


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"world{w}")
def test_grad_scaler_matches_adamw(world: int) -> None:
    run_ranks_checked(_body, world)


@pytest.mark.parametrize("stage", STAGES)
def test_a_checkpoint_between_unscale_and_step_keeps_the_gradients_unscaled(stage: int, tmp_path) -> None:
    """Stages 0-1 keep the gradients in ``p.grad``, which ``scaler.unscale_(opt)`` divides: a checkpoint saved
    between it and ``scaler.step`` holds them divided, and the resumed scaler (its per-optimizer state is in no
    state dict) would have the step divide them again (2e-2 off AdamW, with and without a clip)."""

    extra = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    model, ref = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=BUCKET, **extra)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    for step in range(3):
        x = batch(step, ROWS)
        scaler.scale(model(x)).backward()
        scaler.unscale_(opt)
        opt.clip_grad_norm_(MAX_NORM)
        if step == 1:  # the optimizer has seen the scaler: it knows p.grad was divided
            zk.checkpoint.save(str(tmp_path), model, opt)
            saved = scaler.state_dict()
            model, _ = make_models(torch.float32)
            opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=BUCKET, **extra)
            zk.checkpoint.load(str(tmp_path), model, opt)
            scaler = torch.amp.GradScaler("cpu", **SCALER)
            scaler.load_state_dict(saved)
            scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))  # torch's step needs it after a load
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ref(x).backward()
        assert float(nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)) > MAX_NORM, "clipping inactive"
        ropt.step()
        ropt.zero_grad()
    with opt.gathered_params():
        compare(model, ref, f"stage {stage}: resumed between unscale_ and step")


class _Rows(nn.Module):
    """An embedding (the one trained parameter) whose rows the tokens pick: the first step's sample of ``p.grad`` (16
    evenly spaced elements of the flat buffer) reads row 0, not rows 1 and 2, so a rank whose tokens use only those
    has a sample of zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 8)
        self.head = nn.Linear(8, 1).requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens)).square().mean()


def _rows_pair() -> tuple:
    """Two ``_Rows`` with the same weights (seed 0): ours at stage 1 and AdamW's, each with its own GradScaler."""
    torch.manual_seed(0)
    model, ref = _Rows(), _Rows()
    ref.load_state_dict(model.state_dict())
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    return model, ref, opt, ropt, torch.amp.GradScaler("cpu", **SCALER), torch.amp.GradScaler("cpu", **SCALER)


def _sampled_on_some_ranks(rank: int, world: int, order: str) -> None:
    """Stage 1, the first step: a norm (``unscale_`` then torch's clip, as documented) or a gradient read (before
    ``unscale_``) reduces the gradients early, and the step tells from a sample of ``p.grad`` whether ``unscale_``
    divided them after. A rank whose sample held only zeros reduced again at the step on its own, a collective the
    other rank did not issue (gloo: 'Received data size doesn't match expected size', the ranks aborted). So did a rank
    whose gradients overflowed (inf/NaN only), the step to be skipped, with ``unscale_`` then torch's clip."""
    tokens = [torch.tensor([0, 0]), torch.tensor([1, 1])]
    model, ref, opt, ropt, scaler, rscaler = _rows_pair()
    if order == "an overflow on rank 1 at the first step":  # its sample: non-finite values only
        tokens = [torch.tensor([0, 0]), torch.tensor([0, 1])]
    for step in range(3):
        bad = [1.0, math.inf if step == 0 and order.startswith("an overflow") else 1.0]
        scaler.scale(model(tokens[rank]) * bad[rank]).backward()
        rscaler.scale(sum(ref(t) * b for t, b in zip(tokens, bad)) / world).backward()
        if order == "read, unscale_":
            zk.safe_get_full_grad(model.emb.weight)
        scaler.unscale_(opt)
        rscaler.unscale_(ropt)
        if order != "read, unscale_":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        for s, o in ((scaler, opt), (rscaler, ropt)):
            s.step(o)
            s.update()
            o.zero_grad()
        compare(model, ref, f"stage 1, {order}, a sample of zeros on rank 1, step {step}")


@pytest.mark.distributed
@pytest.mark.parametrize("order", ["unscale_, clip", "read, unscale_", "an overflow on rank 1 at the first step"])
def test_a_first_step_sample_of_zeros_on_one_rank(spawn, order: str) -> None:
    spawn(_sampled_on_some_ranks, 2, order, timeout_s=120.0)


def _read_unscale_save(rank: int, world: int, folder: str) -> None:
    """Stage 1 on 2 ranks, from the second step (the scaler known): a gradient read (an early reduction of the scaled
    ``p.grad``), ``scaler.unscale_(opt)``, then a checkpoint saved and loaded before ``scaler.step``. The window keeps
    ``p.grad``, which ``unscale_`` divided, but recorded it undivided (the step was to unscale the early shard):
    the resumed step divided it again (4.6e-2 off AdamW, no error)."""

    model, ref = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=1, reduce_bucket_size=BUCKET)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    scaler, rscaler = torch.amp.GradScaler("cpu", **SCALER), torch.amp.GradScaler("cpu", **SCALER)
    for step in range(3):
        x = batch(step, world * ROWS)
        scaler.scale(model(x[rank * ROWS : (rank + 1) * ROWS])).backward()
        rscaler.scale(ref(x)).backward()
        zk.safe_get_full_grad(model.head.weight)
        scaler.unscale_(opt)
        rscaler.unscale_(ropt)
        if step == 1:
            zk.checkpoint.save(folder, model, opt)
            saved = scaler.state_dict()
            model, _ = make_models(torch.float32)
            opt = zo.ShardedFusedAdam(model, lr=LR, stage=1, reduce_bucket_size=BUCKET)
            zk.checkpoint.load(folder, model, opt)
            scaler = torch.amp.GradScaler("cpu", **SCALER)
            scaler.load_state_dict(saved)
            scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))  # torch's step needs it after a load
        for s, o in ((scaler, opt), (rscaler, ropt)):
            s.step(o)
            s.update()
            o.zero_grad()
        compare(model, ref, f"stage 1, a gradient read, unscale_, a checkpoint (step 1), step {step}")


@pytest.mark.distributed
def test_a_checkpoint_after_a_read_and_unscale_keeps_the_gradients_unscaled(spawn, tmp_path) -> None:
    spawn(_read_unscale_save, 2, str(tmp_path), timeout_s=120.0)


def _zero_samples_everywhere(rank: int, world: int) -> None:
    tokens = [torch.tensor([1, 1]), torch.tensor([2, 2])]
    model, ref, opt, ropt, scaler, rscaler = _rows_pair()
    for step in range(2):
        scaler.scale(model(tokens[rank])).backward()
        rscaler.scale(sum(ref(t) for t in tokens) / world).backward()
        zk.safe_get_full_grad(model.emb.weight)  # reduces early, the scaler not known yet at the first step
        scaler.unscale_(opt)
        rscaler.unscale_(ropt)
        for s, o in ((scaler, opt), (rscaler, ropt)):
            s.step(o)
            s.update()
            o.zero_grad()
        compare(model, ref, f"stage 1, samples of zeros on every rank, step {step}")
        state, rstate = opt.full_state_dict()["state"][0], ropt.state[ref.emb.weight]
        for key in ("exp_avg", "exp_avg_sq"):
            scale = float(rstate[key].abs().max())
            torch.testing.assert_close(state[key], rstate[key], rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.distributed
def test_a_first_step_sample_of_zeros_on_every_rank(spawn) -> None:
    """The gradients reduced early (a gradient read before ``unscale_``) while every rank's sample of ``p.grad`` at
    the first step holds zeros only: no rank can tell whether ``unscale_`` came after the reduction, so the step
    reduces again and trains as ``torch.optim.AdamW`` with its own scaler (moments too)."""
    spawn(_zero_samples_everywhere, 2, timeout_s=120.0)
