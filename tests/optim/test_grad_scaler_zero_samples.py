"""A GradScaler's first step at stage 1 on 2 ranks, the gradients reduced early (a gradient read before
``unscale_``) while every rank's sample of ``p.grad`` holds zeros only: no rank can tell whether ``unscale_``
came after the reduction, so the step reduces again and trains as ``torch.optim.AdamW`` with its own scaler."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_kernels as zk
import zero_kernels.optim as zo
from tests.helpers.lockstep import LR, compare

SCALER = dict(init_scale=2.0**12, growth_interval=2)


class _Rows(nn.Module):
    """An embedding whose rows 1 and 2 (the tokens) lie between the 16 evenly spaced elements the sample reads."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 8)
        self.head = nn.Linear(8, 1).requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens)).square().mean()


def _case(rank: int, world: int) -> None:
    tokens = [torch.tensor([1, 1]), torch.tensor([2, 2])]
    torch.manual_seed(0)
    model, ref = _Rows(), _Rows()
    ref.load_state_dict(model.state_dict())
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    scaler, rscaler = torch.amp.GradScaler("cpu", **SCALER), torch.amp.GradScaler("cpu", **SCALER)
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
    spawn(_case, 2, timeout_s=120.0)
