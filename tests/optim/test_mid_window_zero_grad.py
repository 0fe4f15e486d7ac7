"""``zero_grad()`` between ``gradient_accumulation_steps`` micro-steps: the optimizer's and ``model.zero_grad()`` keep
the window's gradients at every stage, so a loop that clears after each micro-step's ``step()`` updates on the whole
window as torch.optim.AdamW on the summed batches; a backward after a micro-step's ``step()`` (torch's DCGAN loop, the
generator's loss through the discriminator) cannot be told apart from the window's, so clearing it is refused,
nothing changed."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

import zero_kernels as zk
from tests.helpers.check import assert_close
from tests.helpers.dist import run_ranks

STAGES = (0, 1, 2, 3)
LR = 1e-2
MICRO = 2  # the discriminator's gradient_accumulation_steps
RTOL, ATOL = 1e-5, 1e-6  # fp32 against torch.optim.AdamW (DESIGN.md)


def _nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(1)
    net_d = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    torch.manual_seed(2)
    return net_d, nn.Sequential(nn.Linear(4, 6), nn.Tanh())


def _whole(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's batch, 8 rows per rank: real samples and the generator's noise."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(8 * world, 6, generator=g), torch.randn(8 * world, 4, generator=g)


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the step's batch."""
    real, noise = _whole(step, world)
    return real[8 * rank : 8 * (rank + 1)], noise[8 * rank : 8 * (rank + 1)]


def _d_loss(net_d: nn.Module, net_g: nn.Module, real: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return net_d(real).square().mean() + (net_d(net_g(noise).detach()) - 1).square().mean()


def _gan(stage: int, clear: Callable, rank: int = 0, world: int = 1, steps: int = 4) -> list[torch.Tensor]:
    """A GAN whose discriminator takes ``MICRO`` micro-steps per update, cleared by ``clear(net_d, opt_d)`` before
    each; the generator's loss reaches the discriminator's parameters only while they are frozen."""
    net_d, net_g = _nets()
    opt_d = zk.ShardedFusedAdam(net_d, lr=LR, stage=stage, gradient_accumulation_steps=MICRO)
    opt_g = zk.ShardedFusedAdam(net_g, lr=LR, stage=stage)
    for step in range(steps):
        real, noise = _batch(step, rank, world)
        clear(net_d, opt_d)
        _d_loss(net_d, net_g, real, noise).backward()
        opt_d.step()
        net_g.zero_grad()
        net_d.requires_grad_(False)
        net_d(net_g(noise)).square().mean().backward()
        net_d.requires_grad_(True)
        opt_g.step()
    with opt_d.gathered_params():
        return [p.detach().clone() for p in net_d.parameters()]


def _reference(world: int, steps: int = 4) -> list[torch.Tensor]:
    """torch.optim.AdamW on every rank's rows, the discriminator's loss averaged over each window's micro-steps."""
    net_d, net_g = _nets()
    opt_d, opt_g = torch.optim.AdamW(net_d.parameters(), lr=LR), torch.optim.AdamW(net_g.parameters(), lr=LR)
    for step in range(steps):
        real, noise = _whole(step, world)
        if step % MICRO == 0:
            opt_d.zero_grad()
        (_d_loss(net_d, net_g, real, noise) / MICRO).backward()
        if step % MICRO == MICRO - 1:
            opt_d.step()
        opt_g.zero_grad()
        net_d.requires_grad_(False)
        net_d(net_g(noise)).square().mean().backward()
        net_d.requires_grad_(True)
        opt_g.step()
    return [p.detach().clone() for p in net_d.parameters()]


def _model_zero_grad(net_d: nn.Module, opt_d: zk.ShardedFusedAdam) -> None:
    net_d.zero_grad()


def _model_zero_grad_keep(net_d: nn.Module, opt_d: zk.ShardedFusedAdam) -> None:
    net_d.zero_grad(set_to_none=False)


def _opt_zero_grad(net_d: nn.Module, opt_d: zk.ShardedFusedAdam) -> None:
    opt_d.zero_grad()


CLEARS = {"model": _model_zero_grad, "model-keep": _model_zero_grad_keep, "opt": _opt_zero_grad}


def _compare(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b, rtol=RTOL, atol=ATOL, what=f"{what} parameter {i}")


@pytest.mark.parametrize("clear", sorted(CLEARS))
@pytest.mark.parametrize("stage", STAGES)
def test_zero_grad_between_micro_steps_keeps_the_window(stage: int, clear: str) -> None:
    _compare(_gan(stage, CLEARS[clear]), _reference(1), f"stage {stage}, {clear}.zero_grad()")


def _ranks(rank: int, world: int) -> None:
    for stage in STAGES:
        _compare(_gan(stage, _model_zero_grad, rank, world), _reference(world), f"rank {rank} stage {stage}")


@pytest.mark.distributed
def test_model_zero_grad_between_micro_steps_keeps_the_window_on_two_ranks() -> None:
    run_ranks(_ranks, 2)


@pytest.mark.parametrize("clear", sorted(CLEARS))
@pytest.mark.parametrize("stage", STAGES)
def test_clearing_a_backward_after_a_micro_steps_step_is_refused(stage: int, clear: str) -> None:
    """torch's DCGAN loop with the discriminator's micro-steps: its parameters get the generator's gradients after
    its step; the clear before the next micro-step raises, the gradients and the micro-step as they were."""
    net_d, net_g = _nets()
    opt_d = zk.ShardedFusedAdam(net_d, lr=LR, stage=stage, gradient_accumulation_steps=MICRO)
    real, noise = _batch(0, 0, 1)
    _d_loss(net_d, net_g, real, noise).backward()
    opt_d.step()
    net_d(net_g(noise)).square().mean().backward()
    before = [zk.safe_get_full_grad(p) for p in net_d.parameters()]
    with pytest.raises(RuntimeError, match=r"after a backward that came after the last micro-step's step\(\)"):
        CLEARS[clear](net_d, opt_d)
    assert opt_d.micro_step == 1
    for i, (p, g) in enumerate(zip(net_d.parameters(), before)):
        assert torch.equal(zk.safe_get_full_grad(p), g), f"parameter {i}'s gradient changed"


class _Raising(torch.autograd.Function):
    """Identity whose backward raises once when armed: a backward that fails half-way, its later layers' gradients
    already delivered."""

    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _Raising.armed:
            _Raising.armed = False
            raise RuntimeError("backward failed")
        return grad


FAILS_AT = 4  # the second micro-step of the second window (3 micro-steps each)


def _raising_loss(net: nn.Module, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    _Raising.armed = i == FAILS_AT
    return (net[2](_Raising.apply(net[1](net[0](x)))) - y).square().mean()


def _failing_loop(stage: int, on_failure: Callable) -> list[torch.Tensor]:
    """12 micro-steps of 3 per update; the backward of micro-step ``FAILS_AT`` raises and ``on_failure(net, opt)``
    runs; the others step and clear."""
    net_d, _ = _nets()
    opt = zk.ShardedFusedAdam(net_d, lr=LR, stage=stage, gradient_accumulation_steps=3)
    for i in range(12):
        try:
            _raising_loss(net_d, i).backward()
        except RuntimeError:
            on_failure(net_d, opt)
            continue
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        return [p.detach().clone() for p in net_d.parameters()]


def _failing_reference(drop: bool) -> list[torch.Tensor]:
    """torch.optim.AdamW: the failed backward's window dropped (its later micro-steps start a new one), or what it
    left in ``p.grad`` kept in its window."""
    net_d, _ = _nets()
    opt = torch.optim.AdamW(net_d.parameters(), lr=LR)
    windows = [[0, 1, 2], [5, 6, 7], [8, 9, 10]] if drop else [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    for window in windows:
        for i in window:
            try:
                (_raising_loss(net_d, i) / 3).backward()
            except RuntimeError:
                pass
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net_d.parameters()]


def _fail_then_step(net_d: nn.Module, opt: zk.ShardedFusedAdam) -> None:
    opt.step()
    opt.zero_grad()


FAILURES = {"opt.zero_grad": (_opt_zero_grad, True), "model.zero_grad": (_model_zero_grad, True),
            "step": (_fail_then_step, False)}  # fmt: skip


@pytest.mark.parametrize("failure", sorted(FAILURES))
@pytest.mark.parametrize("stage", STAGES)
def test_a_backward_that_raised_mid_window(stage: int, failure: str) -> None:
    """Cleared after it, the window is dropped at every stage (stages 0-1, whose micro-steps reduce nothing, refused
    the clear as a backward after a step); stepped after it, what it left is the window's, as in AdamW (stages 2-3
    kept the failure open and dropped the window at the next micro-step's zero_grad(), 1.0e-1 off)."""
    on_failure, drop = FAILURES[failure]
    _compare(_failing_loop(stage, on_failure), _failing_reference(drop), f"stage {stage}, {failure}")


@pytest.mark.parametrize("stage", [0, 1, 2])  # stage 3 refuses a second optimizer on the parameters it shards
def test_an_optimizer_built_again_mid_window_takes_model_zero_grad_over(stage: int) -> None:
    """An optimizer rebuilt on the model inside a window, the old one still referenced: ``model.zero_grad()`` is the
    new one's (it raised the old one's refusal at every call)."""
    net_d, net_g = _nets()
    old = zk.ShardedFusedAdam(net_d, lr=LR, stage=stage, gradient_accumulation_steps=MICRO)
    real, noise = _batch(0, 0, 1)
    _d_loss(net_d, net_g, real, noise).backward()
    old.step()
    _d_loss(net_d, net_g, real, noise).backward()
    new = zk.ShardedFusedAdam(net_d, lr=LR, stage=stage)
    net_d.zero_grad()
    for p in net_d.parameters():
        assert p.grad is None, "model.zero_grad() cleared nothing for the optimizer that owns the parameters"
    assert (old.micro_step, new.micro_step) == (1, 0)
