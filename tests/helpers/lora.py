"""A LoRA-like model for the tests of stage 3's frozen parameters: frozen ``Linear`` layers, each with a trainable
low-rank adapter beside it; its data by step and rank, its loss, a training loop and its values gathered whole."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

SIZES = [(24, 96), (96, 96), (96, 8)]


class Lora(nn.Module):
    """Three frozen ``Linear`` layers, each with a trainable low-rank adapter beside it; ``recompute``: each
    block under activation checkpointing ("reentrant" or "non-reentrant")."""

    def __init__(self, dtype: torch.dtype, recompute: str = "", seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.base = nn.ModuleList([nn.Linear(i, o) for i, o in SIZES]).requires_grad_(False)
        self.down = nn.ModuleList([nn.Linear(i, 4, bias=False) for i, _ in SIZES])
        self.up = nn.ModuleList([nn.Linear(4, o) for _, o in SIZES])
        self.to(dtype)
        self.recompute = recompute

    def block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        y = self.base[i](x) + self.up[i](self.down[i](x))
        return torch.tanh(y) if i < 2 else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(3):
            reentrant = self.recompute == "reentrant"
            if self.recompute and (i > 0 or not reentrant):  # reentrant: not the first block (its input needs no grad)
                x = checkpoint(self.block, i, x, use_reentrant=reentrant)
            else:
                x = self.block(i, x)
        return x


def batch(step: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 24, generator=g).to(dtype), torch.randn(6, 8, generator=g).to(dtype)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y.float()).square().mean()


def train(model: nn.Module, opt: Any, rank: int, dtype: torch.dtype, steps: range) -> list[float]:
    """``steps`` steps on this rank's batches; the losses."""
    losses = []
    for step in steps:
        loss = loss_of(model, *batch(step, rank, dtype))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def gathered(model: nn.Module, opt: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(frozen values, trainable values), full, copied inside ``gathered_params()``."""
    with opt.gathered_params():
        frozen = [p.detach().clone() for p in model.base.parameters()]
        trainable = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    return frozen, trainable
