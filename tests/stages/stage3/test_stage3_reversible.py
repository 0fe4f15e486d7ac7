"""Stage 3 under reversible layers (RevNet, Hugging Face's Reformer), on 1-2 gloo ranks.

A reversible block runs its sub-modules' forwards under ``torch.no_grad()`` inside a custom
``torch.autograd.Function`` and keeps no activations; its backward rebuilds the inputs from the
outputs, runs the sub-modules' forwards again under ``torch.enable_grad()`` and backpropagates
through them with ``torch.autograd.backward`` from inside the outer backward. So each sub-module
runs twice per step, its second forward inside the backward, where its parameters are gathered,
and gets its gradient from a backward nested in another. Two blocks share one ``Function`` call
(as Reformer's layers do), followed by a head the outer backward reaches first. Every parameter
matches ``torch.optim.AdamW`` on the whole batch element by element after every step, with every
parameter freed between uses and small buckets, and with gradient accumulation over 2 micro-steps.

Tolerances of DESIGN.md for fp32, as ``tests.helpers.lockstep.compare``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zero_kernels as zk
from tests.helpers.lockstep import compare

DIM, ROWS, LR, STEPS = 6, 2, 2e-2, 3


class Half(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h))


class RevBlock(nn.Module):
    """``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)``: invertible, so backward rebuilds ``x`` from ``y``."""

    def __init__(self) -> None:
        super().__init__()
        self.f, self.g = Half(), Half()

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y1 = x1 + self.f(x2)
        return y1, x2 + self.g(y1)

    def backward_pass(self, y1, y2, dy1, dy2):
        """The inputs and their gradients from the outputs and theirs; the parameters' gradients accumulate."""
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_()
            gy1 = self.g(y1)
            torch.autograd.backward(gy1, dy2)
        with torch.no_grad():
            x2 = y2 - gy1
            dy1 = dy1 + y1.grad
        with torch.enable_grad():
            x2 = x2.detach().requires_grad_()
            fx2 = self.f(x2)
            torch.autograd.backward(fx2, dy1)
        with torch.no_grad():
            return y1 - fx2, x2, dy1, dy2 + x2.grad


class Reversible(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x1, x2, blocks):
        with torch.no_grad():
            for block in blocks:
                x1, x2 = block(x1, x2)
        ctx.blocks = blocks
        ctx.save_for_backward(x1.detach(), x2.detach())
        return x1, x2

    @staticmethod
    def backward(ctx, dy1, dy2):
        y1, y2 = ctx.saved_tensors
        for block in reversed(ctx.blocks):
            y1, y2, dy1, dy2 = block.backward_pass(y1, y2, dy1, dy2)
        return dy1, dy2, None


class RevNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, 2 * DIM)
        self.blocks = nn.ModuleList(RevBlock() for _ in range(2))
        self.head = nn.Linear(2 * DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self.embed(x).chunk(2, dim=-1)
        y1, y2 = Reversible.apply(x1, x2, list(self.blocks))
        return self.head(torch.cat([y1, y2], dim=-1)).square().mean()


def _batch(step: int, micro: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, 3, generator=torch.Generator().manual_seed(100 * step + micro))


def _reversible_case(rank: int, world: int, accumulation: int) -> None:
    model = RevNet()
    ref = copy.deepcopy(model)
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 16},
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 0.0,
    }
    model, opt = zk.initialize(model, config)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    for step in range(STEPS):
        for micro in range(accumulation):
            x = _batch(step, micro, world * ROWS)
            model(x[rank * ROWS : (rank + 1) * ROWS]).backward()
            opt.step()
            opt.zero_grad()
            (ref(x) / accumulation).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with opt.gathered_params():
            compare(model, ref, f"reversible, world {world}, {accumulation} micro-steps, step {step}")


@pytest.mark.distributed
@pytest.mark.parametrize("world,accumulation", [(1, 1), (2, 1), (2, 2)])
def test_reversible_blocks_recomputed_in_backward_match_adamw(spawn, world: int, accumulation: int) -> None:
    spawn(_reversible_case, world, accumulation)
