"""Stage 3, forwards and backwards interleaved on 2 ranks: a use recorded before an earlier backward ended belongs to
that backward's round, and its end (in a later backward) counts for nothing. ``l1, l2`` forward, ``l1`` backward, ``l3``
forward, then ``l2`` and ``l3`` backward: ``l2`` calls a module twice and ``l3`` once, so counting ``l2``'s ends
against ``l3``'s uses would reduce the module between its two gradients. Weights and Adam state equal
``torch.optim.AdamW`` on the rank-averaged gradients, element by element."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_kernels as zk
from tests.helpers.lockstep import LR, compare

ROWS = 3


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.head = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, calls: int) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for _ in range(calls):
            h = torch.tanh(self.mid(h))
        return self.head(h).square().mean()


def _losses(model: nn.Module, rows: list[torch.Tensor]) -> None:
    """The interleaved order; ``rows``: the three batches of one rank."""
    l1, l2 = model(rows[0], 2), model(rows[1], 2)
    l1.backward()
    l3 = model(rows[2], 1)
    l2.backward()
    l3.backward()


def _case(rank: int, world: int) -> None:
    model, ref = _Twice(), _Twice()
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, stage3_param_persistence_threshold=0, reduce_bucket_size=64)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        batches = [torch.randn(world * ROWS, 6, generator=g) for _ in range(3)]
        _losses(model, [b[rank * ROWS : (rank + 1) * ROWS] for b in batches])
        for r in range(world):
            _losses(ref, [b[r * ROWS : (r + 1) * ROWS] for b in batches])
        for p in ref.parameters():
            p.grad /= world
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
        with opt.gathered_params():
            compare(model, ref, f"stage 3, interleaved forwards and backwards, step {step}")
        state = opt.full_state_dict()["state"]
        for i, p in enumerate(ref.parameters()):
            for key in ("exp_avg", "exp_avg_sq"):
                want = ropt.state[p][key]
                torch.testing.assert_close(state[i][key], want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


@pytest.mark.distributed
def test_a_use_recorded_before_an_earlier_backward_ended_counts_for_nothing(spawn) -> None:
    spawn(_case, 2, timeout_s=120.0)
