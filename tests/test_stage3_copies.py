"""Stage 3: parameters assigned while freed, on 1-2 gloo ranks, against ``torch.optim.AdamW``.

- ``p.data = new`` outside a forward, while ``p`` is freed, reaches this rank's shard (and the fp32
  master) before anything reads it: a checkpoint saved right after holds ``new``, and a step taken
  right after (its gradients from a backward before the assignment) updates ``new``, as AdamW does,
  instead of leaving the update to be overwritten by the next gather.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from _dist import run_ranks_checked
from torch import nn

import zero_kernels as zk

ROWS, LR, BUCKET = 3, 1e-2, 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 7), nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _batch(step: int, world: int) -> torch.Tensor:
    return torch.randn(ROWS * world, 6, generator=torch.Generator().manual_seed(step))


def _backward(model: Net, ref: Net, rank: int, world: int, step: int) -> None:
    x = _batch(step, world)
    model(x[rank * ROWS : (rank + 1) * ROWS]).square().mean().backward()
    ref(x).square().mean().backward()


def _step(opt: torch.optim.Optimizer, ropt: torch.optim.Optimizer) -> None:
    for o in (opt, ropt):
        o.step()
        o.zero_grad()


def _make(world: int) -> tuple[Net, Net, zk.ShardedFusedAdam, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, reduce_bucket_size=BUCKET, stage3_param_persistence_threshold=0)
    return model, ref, opt, torch.optim.AdamW(ref.parameters(), lr=LR)


def _differences(model: nn.Module, ref: nn.Module, what: str) -> list[str]:
    found = []
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        if not torch.allclose(p, r, rtol=1e-5, atol=1e-6 * r.abs().max().item()):
            found.append(f"{what}: {name} differs from AdamW's by {(p - r).abs().max().item():.3g}")
    return found


def _assigned(seed: int) -> torch.Tensor:
    return torch.randn(7, 6, generator=torch.Generator().manual_seed(seed))


def _assign_case(rank: int, world: int, directory: str) -> list[str]:
    model, ref, opt, ropt = _make(world)
    _backward(model, ref, rank, world, 0)
    _step(opt, ropt)
    for m in (model, ref):  # freed in the model: outside any forward
        m.a.weight.data = _assigned(1)
    zk.checkpoint.save(directory, model, opt)
    loaded, _, opt2, _ = _make(world)
    zk.checkpoint.load(directory, loaded, opt2)
    with opt2.gathered_params():
        found = _differences(loaded, ref, f"world {world}: a checkpoint saved after p.data = ...")
    _backward(model, ref, rank, world, 1)
    _step(opt, ropt)
    _backward(model, ref, rank, world, 2)
    for m in (model, ref):  # between the backward and the step
        m.a.weight.data = _assigned(2)
    _step(opt, ropt)
    with opt.gathered_params():
        found += _differences(model, ref, f"world {world}: the step after p.data = ... (after backward)")
    _backward(model, ref, rank, world, 3)
    _step(opt, ropt)
    with opt.gathered_params():
        found += _differences(model, ref, f"world {world}: one step later")
    return found


@pytest.mark.distributed
@pytest.mark.parametrize("world", (1, 2), ids=lambda w: f"world{w}")
def test_data_assigned_while_freed_reaches_the_shard(world: int, tmp_path: Path) -> None:
    run_ranks_checked(_assign_case, world, str(tmp_path), timeout_s=60)
