"""Hugging Face Accelerate's usual loop with ``ShardedFusedAdam`` on 2 gloo ranks, against DDP + ``AdamW``.

The reference: a plain ``Accelerator``, ``prepare(model, AdamW, loader)`` (Accelerate wraps the model
in DDP), ``accumulate`` over 2 micro-batches, ``accelerator.clip_grad_norm_`` with clipping active.
The same loop then runs at stages 0-3:

1. ``ZeroAccelerator().prepare(model, opt, loader)``, the optimizer given the parameters (stages
   0-2) or the model (stage 3): the model is not wrapped, and after every step the weights and the
   norm ``accelerator.clip_grad_norm_`` returns match the reference.
2. A plain ``Accelerator`` preparing only the optimizer and the loader (the model left alone):
   the same weights and norms (torch's clip is routed to the optimizer's global norm).
3. A plain ``Accelerator`` preparing the model too wraps it in DDP: its first forward raises an
   error naming ``ZeroAccelerator``, at every stage, whatever the optimizer was given.
4. A ``ShardedFusedAdam`` spanning one process (built before the ``ZeroAccelerator`` started the process group;
   here given a group of one rank) is refused by ``prepare``, with the model or alone: each process would
   train on its own.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from torch import nn

from tests.helpers.check import assert_close

pytest.importorskip("accelerate")

WORLD, ROWS, STEPS, ACCUMULATE, LR, MAX_NORM = 2, 2, 3, 2, 2e-2, 0.05
STAGES = (0, 1, 2, 3)


def _env(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 11), nn.Tanh(), nn.Linear(11, 5), nn.Tanh(), nn.Linear(5, 1))


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(WORLD * ROWS * STEPS * ACCUMULATE, 6, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=ROWS, shuffle=False)


def _accelerator(kind: type, mixed_precision: str = "no"):
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    return kind(cpu=True, gradient_accumulation_steps=ACCUMULATE, mixed_precision=mixed_precision)


def _train(accelerator, model: nn.Module, opt: torch.optim.Optimizer, loader) -> list[tuple[float, dict]]:
    """Accelerate's documented loop; after each optimizer step: (clip norm, weights)."""
    inner = getattr(model, "module", model)
    sharded = getattr(opt.optimizer, "gathered_params", contextlib.nullcontext)  # opt: Accelerate's wrapper
    history = []
    for (x,) in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(x).square().mean())
            if accelerator.sync_gradients:
                norm = float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM))
            opt.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            with sharded():
                history.append((norm, {k: v.detach().clone() for k, v in inner.state_dict().items()}))
    return history


def _reference() -> list[tuple[float, dict]]:
    from accelerate import Accelerator

    accelerator = _accelerator(Accelerator)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt, loader = accelerator.prepare(model, opt, _loader())
    assert isinstance(model, nn.parallel.DistributedDataParallel)
    history = _train(accelerator, model, opt, loader)
    assert max(n for n, _ in history) > MAX_NORM, "clipping inactive"
    return history


def _sharded(model: nn.Module, stage: int):
    import zero_kernels as zk

    if stage == 3:
        return zk.ShardedFusedAdam(model, lr=LR, stage=3, reduce_bucket_size=13, stage3_param_persistence_threshold=10)
    return zk.ShardedFusedAdam(model.parameters(), lr=LR, stage=stage, reduce_bucket_size=13)


def _check(history: list, expected: list, what: str) -> None:
    assert len(history) == len(expected) == STEPS, what
    for step, ((norm, weights), (rnorm, rweights)) in enumerate(zip(history, expected)):
        assert norm == pytest.approx(rnorm, rel=1e-5), f"{what} step {step}: clip norm {norm} vs DDP's {rnorm}"
        for name, value in rweights.items():
            scale = value.abs().max().item()
            assert_close(weights[name], value, rtol=1e-5, atol=1e-6 * scale, what=f"{what} step {step} {name}")


def zero_accelerator(stage: int, expected: list) -> None:
    """Item 1."""
    from zero_kernels.integrations.accelerate import ZeroAccelerator

    accelerator = _accelerator(ZeroAccelerator)
    model = _model()
    opt = _sharded(model, stage)
    prepared, aopt, loader = accelerator.prepare(model, opt, _loader())
    assert prepared is model, f"stage {stage}: wrapped in {type(prepared).__name__}"
    _check(_train(accelerator, prepared, aopt, loader), expected, f"ZeroAccelerator stage {stage}")


def optimizer_and_loader_only(stage: int, expected: list) -> None:
    """Item 2."""
    from accelerate import Accelerator

    accelerator = _accelerator(Accelerator)
    model = _model()
    aopt, loader = accelerator.prepare(_sharded(model, stage), _loader())
    _check(_train(accelerator, model, aopt, loader), expected, f"Accelerator(opt, loader) stage {stage}")


def plain_accelerator_refused(stage: int) -> None:
    """Item 3."""
    from accelerate import Accelerator

    accelerator = _accelerator(Accelerator)
    model = _model()
    opt = _sharded(model, stage)
    prepared, opt, loader = accelerator.prepare(model, opt, _loader())
    assert isinstance(prepared, nn.parallel.DistributedDataParallel)
    with pytest.raises(RuntimeError, match="DistributedDataParallel.*ZeroAccelerator in place of Accelerator"):
        prepared(next(iter(loader))[0])


def all_cases(rank: int, world: int) -> None:
    _env(rank, world)
    expected = _reference()
    for stage in STAGES:
        zero_accelerator(stage, expected)
        optimizer_and_loader_only(stage, expected)
        plain_accelerator_refused(stage)


def one_process_optimizer_refused(rank: int, world: int) -> None:
    """Item 4: an optimizer built before the process group existed is refused; one given a process group of one
    rank on purpose is taken."""
    from unittest import mock

    import torch.distributed as dist

    import zero_kernels as zk
    from zero_kernels.integrations.accelerate import ZeroAccelerator

    _env(rank, world)
    alone = [dist.new_group([r]) for r in range(world)][rank]
    accelerator = _accelerator(ZeroAccelerator)
    model = _model()
    with mock.patch.object(dist, "is_initialized", return_value=False):  # as built before init_process_group
        opt = zk.ShardedFusedAdam(model.parameters(), lr=LR, stage=2)
    refused = r"spans 1 process while Accelerate runs 2: .*Build ZeroAccelerator\(\.\.\.\) first"
    with pytest.raises(ValueError, match=refused):
        accelerator.prepare(model, opt)
    with pytest.raises(ValueError, match=refused):
        accelerator.prepare(opt)
    chosen = _model()
    accelerator.prepare(zk.ShardedFusedAdam(chosen.parameters(), lr=LR, stage=2, process_group=alone))


@pytest.mark.distributed
def test_an_optimizer_of_one_process_is_refused(spawn) -> None:
    spawn(one_process_optimizer_refused, WORLD, timeout_s=120.0)


@pytest.mark.distributed
def test_accelerate_loop_matches_ddp_adamw(spawn) -> None:
    spawn(all_cases, WORLD, timeout_s=300.0)


def _fp16_micro_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(ROWS, 6, generator=g).half() for _ in range(STEPS * ACCUMULATE)]


@pytest.mark.parametrize("stage", STAGES)
def test_backward_of_an_fp16_optimizer_goes_through_it(stage: int) -> None:
    """4. On one process, an optimizer with fp16 loss scaling: ``accelerator.backward(loss)`` runs ``opt.backward`` (a
    plain ``loss.backward()`` is refused under fp16) on the loss Accelerate divides by its accumulation steps; the
    weights equal those of the same loop written with ``opt.no_sync()`` and ``opt.backward(loss / 2)``, bit for bit."""
    import zero_kernels as zk
    from zero_kernels.integrations.accelerate import ZeroAccelerator

    def build() -> tuple[nn.Module, zk.ShardedFusedAdam]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 11), nn.Tanh(), nn.Linear(11, 1)).half()
        return model, zk.ShardedFusedAdam(model, lr=LR, stage=stage, fp16={"enabled": True, "initial_scale_power": 8})

    accelerator = _accelerator(ZeroAccelerator)
    model, opt = build()
    model, aopt = accelerator.prepare(model, opt)
    ref, ropt = build()
    for k, x in enumerate(_fp16_micro_batches()):
        with accelerator.accumulate(model):
            accelerator.backward(model(x).float().square().mean())
            aopt.step()
            aopt.zero_grad()
        last = k % ACCUMULATE == ACCUMULATE - 1
        with contextlib.nullcontext() if last else ropt.no_sync():
            ropt.backward(ref(x).float().square().mean() / ACCUMULATE)
        if last:
            ropt.step()
            ropt.zero_grad()
    assert opt.applied_steps == ropt.applied_steps == STEPS, f"stage {stage}: {opt.applied_steps} updates"
    with opt.gathered_params(), ropt.gathered_params():
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, r), f"stage {stage} {name}: {(p.float() - r.float()).abs().max().item():.3g}"


@pytest.mark.parametrize("stage", STAGES)
def test_a_step_skipped_by_the_optimizers_loss_scaling_is_reported_and_holds_the_scheduler(stage: int) -> None:
    """With the optimizer's own fp16 loss scaling (no GradScaler), a step skipped for an inf: ``step_was_skipped``
    says so and a prepared scheduler does not step, as Accelerate under DeepSpeed does (the wrapper reported every
    step applied, and the schedule advanced over the skipped one: lr 0.005 after 2 updates, where 0.0067 was due)."""
    import zero_kernels as zk
    from zero_kernels.integrations.accelerate import ZeroAccelerator

    accelerator = _accelerator(ZeroAccelerator)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 11), nn.Tanh(), nn.Linear(11, 1)).half()
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=stage, fp16={"enabled": True, "initial_scale_power": 8})
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda updates: 1.0 / (updates + 1))
    model, aopt, ascheduler = accelerator.prepare(model, opt, scheduler)
    skipped = []
    for k, x in enumerate(_fp16_micro_batches()):
        with accelerator.accumulate(model):
            loss = model(x).float().square().mean()
            accelerator.backward(loss * float("inf") if k == ACCUMULATE else loss)  # the second step's first
            aopt.step()
            ascheduler.step()
            aopt.zero_grad()
        if accelerator.sync_gradients:
            skipped.append(aopt.step_was_skipped)
    assert skipped == [False, True, False], f"stage {stage}: step_was_skipped {skipped}"
    assert opt.applied_steps == scheduler.last_epoch == 2, f"stage {stage}: scheduler at {scheduler.last_epoch}"
    assert scheduler.get_last_lr() == pytest.approx([LR / 3])


def test_accumulation_counted_by_both_is_refused() -> None:
    """Accelerate steps the optimizer once per window; an optimizer counting micro-steps too would make each update
    span both counts (its gradients divided by both): ``prepare`` refuses it, naming where the count goes."""
    import zero_kernels as zk
    from zero_kernels.integrations.accelerate import ZeroAccelerator

    accelerator = _accelerator(ZeroAccelerator)
    model = nn.Linear(6, 1)
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=2, gradient_accumulation_steps=ACCUMULATE)
    with pytest.raises(ValueError, match="Keep the count in the Accelerator and build the optimizer without it"):
        accelerator.prepare(model, opt)


def test_checkpoints_take_the_optimizer_prepare_returned(tmp_path) -> None:
    """``zk.checkpoint.save/load(dir, model, opt)`` with the ``opt`` that ``accelerator.prepare`` returned (Accelerate's
    wrapper), as the README's loop names it: saved and loaded as the ShardedFusedAdam inside (it was refused, the
    message pointing at consolidate)."""
    import zero_kernels as zk
    from zero_kernels.integrations.accelerate import ZeroAccelerator

    accelerator = _accelerator(ZeroAccelerator)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 11), nn.Tanh(), nn.Linear(11, 1))
    model, opt = accelerator.prepare(model, zk.ShardedFusedAdam(model, lr=LR, stage=2))
    model(torch.ones(ROWS, 6)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    zk.checkpoint.save(tmp_path, model, opt)
    saved = opt.optimizer.full_state_dict()["state"]
    model(torch.ones(ROWS, 6)).square().mean().backward()
    opt.step()
    assert saved and opt.optimizer.applied_steps == 2
    zk.checkpoint.load(tmp_path, model, opt)
    loaded = opt.optimizer.full_state_dict()["state"]
    assert loaded.keys() == saved.keys()
    for index, entry in loaded.items():
        assert torch.equal(entry["exp_avg"], saved[index]["exp_avg"]), f"state[{index}] after load"


INF_MICRO_BATCH = 2  # the first micro-batch of the second step: its loss is inf on rank 1


def _scaled_accelerator(kind: type):
    """An Accelerator with ``mixed_precision="fp16"`` (autocast) holding a GradScaler, as it makes one on a GPU (on
    the CPU it makes none): growth every 2 steps, so the scale both grows and backs off within the run."""
    accelerator = _accelerator(kind, "fp16")
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    accelerator.native_amp = True
    return accelerator


def _train_scaled(accelerator, model: nn.Module, opt, loader, rank: int) -> list[tuple]:
    """The loop, an inf loss on rank 1 at ``INF_MICRO_BATCH``; per step: (scale, step_was_skipped, norm, weights)."""
    inner = getattr(model, "module", model)
    sharded = getattr(opt.optimizer, "gathered_params", contextlib.nullcontext)
    history = []
    for k, (x,) in enumerate(loader):
        with accelerator.accumulate(model):
            loss = model(x).square().mean()
            accelerator.backward(loss * float("inf") if k == INF_MICRO_BATCH and rank == 1 else loss)
            if accelerator.sync_gradients:
                norm = float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM))
            opt.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            with sharded():
                weights = {k: v.detach().clone() for k, v in inner.state_dict().items()}
            history.append((accelerator.scaler.get_scale(), opt.step_was_skipped, norm, weights))
    return history


def scaled_cases(rank: int, world: int) -> None:
    from accelerate import Accelerator

    from zero_kernels.integrations.accelerate import ZeroAccelerator

    _env(rank, world)
    accelerator = _scaled_accelerator(Accelerator)
    model = _model()
    model, opt, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR), _loader())
    expected = _train_scaled(accelerator, model, opt, loader, rank)
    assert [s for _, s, _, _ in expected] == [False, True, False], expected
    for stage in STAGES:
        accelerator = _scaled_accelerator(ZeroAccelerator)
        model = _model()
        model, opt, loader = accelerator.prepare(model, _sharded(model, stage), _loader())
        history = _train_scaled(accelerator, model, opt, loader, rank)
        for step, ((scale, skipped, norm, weights), (rscale, rskipped, rnorm, rweights)) in enumerate(
            zip(history, expected)
        ):
            what = f"stage {stage} step {step} rank {rank}"
            assert (scale, skipped) == (rscale, rskipped), f"{what}: scale, skipped {scale, skipped} vs DDP's"
            assert norm == pytest.approx(rnorm, rel=1e-5, nan_ok=True), f"{what}: clip norm {norm} vs DDP's {rnorm}"
            for name, value in rweights.items():
                atol = 1e-6 * value.abs().max().item()
                assert_close(weights[name], value, rtol=1e-5, atol=atol, what=f"{what} {name}")


@pytest.mark.distributed
def test_a_grad_scaler_steps_as_with_ddp(spawn) -> None:
    """5. With a GradScaler (fp16 on a GPU), an inf on one rank: at every stage the scale, ``step_was_skipped``, the
    norm ``accelerator.clip_grad_norm_`` returns (at stages 2-3 the first step's was the scaled gradients' norm, 4096x
    DDP's, the optimizer not having seen the scaler yet) and the weights after each step are DDP + AdamW's (the
    scaler stepped the optimizer through Accelerate's wrapper, which hid ``grad_scaler``: the step ignored the scale
    at stage 0, the ranks' scales parted at stage 1, and ``scaler.update()`` failed at stages 2-3)."""
    spawn(scaled_cases, WORLD, timeout_s=300.0)


def test_a_wrapper_hiding_grad_scaler_is_refused() -> None:
    """GradScaler then passes the scale as attributes, its inf check made on one rank's ``p.grad``: refused before
    anything changes, the attributes gone."""
    import zero_kernels as zk

    model = _model()
    opt = zk.ShardedFusedAdam(model.parameters(), lr=LR, stage=1)
    before = [p.detach().clone() for p in model.parameters()]
    step = opt.step
    opt.step = lambda *args, **kwargs: step(*args, **kwargs)  # what Accelerate's AcceleratedOptimizer does
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(ROWS, 6)).square().mean()).backward()
    with pytest.raises(RuntimeError, match=r"hides step's grad_scaler .*functools.wraps\(opt.step\)"):
        scaler.step(opt)
    assert "found_inf" not in vars(opt) and "grad_scale" not in vars(opt)
    assert opt.applied_steps == 0 and all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("stage", (2, 3))
def test_a_wider_grad_accum_dtype_reduces_every_micro_batch(stage: int) -> None:
    """An optimizer adding micro-batches up reduced in a wider ``grad_accum_dtype`` (bf16 weights, fp32 sums: its
    ``reduces_micro_steps``): ``accumulate(model)`` leaves its ``no_sync()`` out, as Accelerate under DeepSpeed does,
    so the sums are fp32 as in the loop without it, bit for bit; inside ``no_sync()`` they added up in bf16
    ``p.grad``."""
    import zero_kernels as zk
    from zero_kernels.integrations.accelerate import ZeroAccelerator

    def build() -> tuple[nn.Module, zk.ShardedFusedAdam]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 11), nn.Tanh(), nn.Linear(11, 1)).bfloat16()
        return model, zk.ShardedFusedAdam(model, lr=LR, stage=stage, grad_accum_dtype="fp32")

    accelerator = _accelerator(ZeroAccelerator)
    model, opt = build()
    assert opt.reduces_micro_steps
    model, aopt = accelerator.prepare(model, opt)
    ref, ropt = build()
    for k, x in enumerate(_fp16_micro_batches()):
        with accelerator.accumulate(model):
            accelerator.backward(model(x.bfloat16()).float().square().mean())
            aopt.step()
            aopt.zero_grad()
        (ref(x.bfloat16()).float().square().mean() / ACCUMULATE).backward()
        if k % ACCUMULATE == ACCUMULATE - 1:
            ropt.step()
            ropt.zero_grad()
    mine, theirs = opt.full_state_dict()["state"], ropt.full_state_dict()["state"]
    for i, state in theirs.items():
        assert torch.equal(mine[i]["exp_avg"], state["exp_avg"]), f"stage {stage} parameter {i}"
