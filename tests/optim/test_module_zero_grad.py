"""``model.zero_grad()`` clears what a backward left for the next step at every stage, as with
``torch.optim.AdamW``: a backward not followed by a step (an input-saliency backward after the step, a GAN's
generator step through the discriminator, as torch's DCGAN example writes it) adds nothing to the next step, on one
rank and on two; modules that together hold an optimizer's parameters (an encoder and a decoder) clear it once all
were zeroed, and a part alone clears nothing, which the next step says."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zero_kernels as zk
from tests.helpers.check import assert_close
from tests.helpers.dist import run_ranks

STAGES = (0, 1, 2, 3)
LR = 1e-2
RTOL, ATOL = 1e-5, 1e-6  # fp32 against torch.optim.AdamW (DESIGN.md)


def _net(seed: int, width: int = 10) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 3))


def _rows(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the step's batch (8 rows per rank)."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8 * world, 6, generator=g), torch.randn(8 * world, 3, generator=g)
    return x[8 * rank : 8 * (rank + 1)], y[8 * rank : 8 * (rank + 1)]


def _weights(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    holding = opt.gathered_params() if isinstance(opt, zk.ShardedFusedAdam) else torch.no_grad()
    with holding:
        return [p.detach().clone() for p in model.parameters()]


def _saliency_loop(stage: int | None, rank: int = 0, world: int = 1) -> list[list[torch.Tensor]]:
    """``model.zero_grad()``, backward, step, then a backward for the inputs' saliency that no step uses; ``stage``
    None: AdamW on the whole batch."""
    model = _net(0)
    whole = stage is None
    opt = torch.optim.AdamW(model.parameters(), lr=LR) if whole else zk.ShardedFusedAdam(model, lr=LR, stage=stage)
    seen = []
    for step in range(4):
        x, y = _rows(step, 0, 1) if whole and world == 1 else _rows(step, rank, world)
        if whole and world > 1:
            x, y = (
                torch.cat([_rows(step, r, world)[0] for r in range(world)]),
                torch.cat([_rows(step, r, world)[1] for r in range(world)]),
            )
        model.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        xs = x.clone().requires_grad_(True)
        model(xs).sum().backward()
        assert xs.grad is not None
        seen.append(_weights(model, opt))
    return seen


def _compare(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]], what: str) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(g, w)):
            assert_close(a, b, rtol=RTOL, atol=ATOL, what=f"{what} step {step} parameter {i}")


@pytest.mark.parametrize("stage", STAGES)
def test_a_backward_cleared_by_model_zero_grad_adds_nothing(stage: int) -> None:
    _compare(_saliency_loop(stage), _saliency_loop(None), f"stage {stage}")


def _gan_loop(stage: int | None) -> list[list[torch.Tensor]]:
    """torch's DCGAN loop: ``netD.zero_grad()``, D's backward, D's step; ``netG.zero_grad()``, G's loss through D
    (D's parameters get gradients that no D step may use), G's step."""
    net_d, net_g = _net(1), nn.Sequential(nn.Linear(4, 6), nn.Tanh())
    torch.manual_seed(2)
    net_g[0].reset_parameters()
    make = (lambda m: torch.optim.AdamW(m.parameters(), lr=LR)) if stage is None else (
        lambda m: zk.ShardedFusedAdam(m, lr=LR, stage=stage))  # fmt: skip
    opt_d, opt_g = make(net_d), make(net_g)
    seen = []
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        real, noise = torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)
        net_d.zero_grad()
        d_loss = net_d(real).square().mean() + (net_d(net_g(noise).detach()) - 1).square().mean()
        d_loss.backward()
        opt_d.step()
        net_g.zero_grad()
        net_d(net_g(noise)).square().mean().backward()
        opt_g.step()
        seen.append(_weights(net_d, opt_d) + _weights(net_g, opt_g))
    return seen


@pytest.mark.parametrize("stage", STAGES)
def test_torchs_dcgan_loop_trains_as_with_adamw(stage: int) -> None:
    _compare(_gan_loop(stage), _gan_loop(None), f"stage {stage}")


def _frozen_d_loop(stage: int | None) -> list[list[torch.Tensor]]:
    """pix2pix/CycleGAN's pattern: D frozen (``requires_grad_(False)``) while G trains, cleared with ``G.zero_grad()``;
    D steps every second iteration, on the gradients of two (``G.zero_grad()`` must not touch D's)."""
    net_d, net_g = _net(1), nn.Sequential(nn.Linear(4, 6), nn.Tanh())
    make = (lambda m: torch.optim.AdamW(m.parameters(), lr=LR)) if stage is None else (
        lambda m: zk.ShardedFusedAdam(m, lr=LR, stage=stage))  # fmt: skip
    opt_d, opt_g = make(net_d), make(net_g)
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        real, noise = torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)
        net_d.requires_grad_(True)
        fake = net_g(noise)
        (net_d(real).square().mean() + (net_d(fake.detach()) - 1).square().mean()).backward()
        if step % 2 == 1:
            opt_d.step()
            net_d.zero_grad()
        net_d.requires_grad_(False)
        net_g.zero_grad()
        net_d(fake).square().mean().backward()
        opt_g.step()
    net_d.requires_grad_(True)
    return [_weights(net_d, opt_d) + _weights(net_g, opt_g)]


@pytest.mark.parametrize("stage", STAGES)
def test_a_module_frozen_for_a_while_keeps_its_gradients_from_another_modules_zero_grad(stage: int) -> None:
    _compare(_frozen_d_loop(stage), _frozen_d_loop(None), f"stage {stage}")


def _spike_loop(stage: int | None, rank: int = 0, world: int = 1) -> list[list[torch.Tensor]]:
    """ "Skip a batch whose gradient norm spikes": backward, ``clip_grad_norm_`` (routed to the optimizer), and on a
    spike ``model.zero_grad()`` and on to the next batch; else step. Batches 1 and 3 spike."""
    model = _net(0)
    whole = stage is None
    opt = torch.optim.AdamW(model.parameters(), lr=LR) if whole else zk.ShardedFusedAdam(model, lr=LR, stage=stage)
    for step in range(5):
        rows = [_rows(step, r, world) for r in (range(world) if whole else (rank,))]
        x, y = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        ((50.0 if step in (1, 3) else 1.0) * ((model(x) - y) ** 2).mean()).backward()
        if torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) > 20:
            model.zero_grad()
            continue
        opt.step()
        model.zero_grad()
    return [_weights(model, opt)]


def _ranks(rank: int, world: int) -> None:
    want, spiked = _saliency_loop(None, world=world), _spike_loop(None, world=world)
    for stage in STAGES:
        if stage >= 2:
            _compare(_saliency_loop(stage, rank, world), want, f"rank {rank} stage {stage}")
        _compare(_spike_loop(stage, rank, world), spiked, f"spikes: rank {rank} stage {stage}")


@pytest.mark.distributed
def test_a_backward_cleared_by_model_zero_grad_adds_nothing_on_two_ranks() -> None:
    run_ranks(_ranks, 2)


def _two_part_loop(stage: int | None) -> list[list[torch.Tensor]]:
    """One optimizer over an encoder and a decoder, cleared with ``enc.zero_grad(); dec.zero_grad()``: a spiking batch
    skipped after ``clip_grad_norm_``, and a saliency backward after each step that no step uses."""
    torch.manual_seed(0)
    enc, dec = nn.Sequential(nn.Linear(6, 10), nn.Tanh()), nn.Linear(10, 3)
    model = nn.ModuleDict({"enc": enc, "dec": dec})
    opt = torch.optim.AdamW(model.parameters(), lr=LR) if stage is None else zk.ShardedFusedAdam(
        model, lr=LR, stage=stage)  # fmt: skip
    for step in range(5):
        x, y = _rows(step, 0, 1)
        enc.zero_grad()
        dec.zero_grad()
        ((50.0 if step == 1 else 1.0) * ((dec(enc(x)) - y) ** 2).mean()).backward()
        if torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) > 20:
            continue
        opt.step()
        dec(enc(x.clone().requires_grad_(True))).sum().backward()
    return [_weights(model, opt)]


@pytest.mark.parametrize("stage", STAGES)
def test_modules_zeroed_one_after_the_other_clear_the_optimizer_they_share(stage: int) -> None:
    _compare(_two_part_loop(stage), _two_part_loop(None), f"stage {stage}")


def test_a_part_of_the_model_clears_nothing_and_the_step_says_so(caplog: pytest.LogCaptureFixture) -> None:
    model = _net(0)
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=2)
    x, y = _rows(0, 0, 1)
    ((model(x) - y) ** 2).mean().backward()
    held = [t.clone() for t in opt.pipeline.buffers[0].grad_shard.split(1)]
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        model[2].zero_grad()
        model[2].zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(opt.pipeline.buffers[0].grad_shard.split(1), held))
        assert not caplog.records
        opt.step()
        ((model(x) - y) ** 2).mean().backward()
        model[2].zero_grad()
        opt.step()
    said = [r.getMessage() for r in caplog.records if "zero_grad()" in r.getMessage()]
    assert len(said) == 1 and "Linear, Linear.zero_grad() held 2 of the 4 parameters" in said[0], said
    ((model(x) - y) ** 2).mean().backward()
    model.zero_grad()
    assert not opt.pipeline.window_open


def test_a_backward_between_the_parts_keeps_the_first_parts_gradients() -> None:
    """``enc.zero_grad()``, a backward, ``dec.zero_grad()``: the parts span a backward, so they clear nothing (the
    backward's encoder gradients are held, which the encoder's zero_grad came before)."""
    model = _net(0)
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=2)
    x, y = _rows(0, 0, 1)
    ((model(x) - y) ** 2).mean().backward()
    model[0].zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    model[2].zero_grad()
    assert opt.pipeline.window_open
    model[0].zero_grad()
    assert not opt.pipeline.window_open


@pytest.mark.parametrize("stage", STAGES)
def test_a_skipped_spiking_batch_leaves_nothing_behind(stage: int) -> None:
    _compare(_spike_loop(stage), _spike_loop(None), f"stage {stage}")


@pytest.mark.parametrize("stage", STAGES)
def test_an_unscaled_backward_cleared_by_model_zero_grad_is_not_refused(stage: int) -> None:
    """fp16 loss scaling: a saliency backward (plain ``backward()``, no step uses it) cleared with
    ``model.zero_grad()`` is forgotten, as ``opt.zero_grad()`` forgets it: the next scaled step trains."""
    model = _net(0)
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=stage, fp16={"enabled": True, "initial_scale_power": 8})
    for step in range(3):
        x, y = _rows(step, 0, 1)
        model.zero_grad()
        opt.backward(((model(x) - y) ** 2).mean())
        opt.step()
        model(x.clone().requires_grad_(True)).sum().backward()
    assert opt.applied_steps == 3


def _branch_loop(stage: int | None) -> list[list[torch.Tensor]]:
    """A branch used on every third step, ``model.zero_grad(set_to_none=False)``: AdamW keeps stepping it on a zero
    gradient once it had one (its moments decay, weight decay applies)."""
    torch.manual_seed(0)
    always, sometimes = nn.Linear(6, 3), nn.Linear(6, 3)
    model = nn.ModuleList([always, sometimes])
    kwargs = dict(lr=LR, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), **kwargs) if stage is None else zk.ShardedFusedAdam(
        model, stage=stage, **kwargs)  # fmt: skip
    for step in range(6):
        x, y = _rows(step, 0, 1)
        model.zero_grad(set_to_none=False)
        (((always(x) + (sometimes(x) if step % 3 == 0 else 0)) - y) ** 2).mean().backward()
        opt.step()
    return [_weights(model, opt)]


@pytest.mark.parametrize("stage", STAGES)
def test_zero_gradients_kept_by_model_zero_grad_step_a_branch_left_unused(stage: int) -> None:
    _compare(_branch_loop(stage), _branch_loop(None), f"stage {stage}")
