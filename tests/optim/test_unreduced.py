"""A model's parameters split between a ``ShardedFusedAdam`` and another optimizer (``torch.optim.SGD`` for the
embeddings, a Muon-style split of the matrices) on several ranks (``optim.unreduced``).

The sharded optimizer reduces the gradients of the parameters it trains only: the other optimizer's parameters keep
each rank's own gradient, and the ranks drift apart without an error (2 ranks, 4 steps: the embeddings 7.8e-3 apart
under SGD, 0.15 off DDP + the same two optimizers under a Muon-style split). Its first step says so once, at WARNING,
naming a parameter; with their gradients all-reduced by hand before that step the whole model trains as DDP does, at
stages 0-3 (nothing is reduced twice); a reference model trained beside it on each rank is not warned about.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_kernels as zk
from tests.helpers.check import assert_close
from tests.helpers.dist import run_ranks_checked

ROWS = 3  # per rank


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(20, 6)
        self.l1 = nn.Linear(6, 8)
        self.l2 = nn.Linear(8, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(self.emb(idx)))).square().mean()


def _split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Muon-style: the matrices (not the embedding's) to the other optimizer, the rest to the sharded one."""
    other = [p for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith("emb")]
    return [p for p in model.parameters() if all(p is not q for q in other)], other


def _train(model: nn.Module, optimizers: list, lo: int, hi: int, reduce: list) -> None:
    for step in range(4):
        idx = torch.randint(0, 20, (2 * ROWS, 4), generator=torch.Generator().manual_seed(step))[lo:hi]
        for opt in optimizers:
            opt.zero_grad()
        model(idx).backward()
        for p in reduce:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        for opt in optimizers:
            opt.step()


class _Caught(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _case(rank: int, world: int, stage: int, by_hand: bool) -> list[str]:
    caught = _Caught()
    logging.getLogger("zero_kernels").addHandler(caught)
    try:
        model, ref = _Net(), _Net()
        mine, other = _split(model)
        ref_mine, ref_other = _split(ref)
        kw = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
        opts = [zk.ShardedFusedAdam(mine, lr=1e-2, stage=stage, module=model, **kw), torch.optim.SGD(other, lr=0.1)]
        _train(model, opts, rank * ROWS, (rank + 1) * ROWS, other if by_hand else [])
        _train(ref, [torch.optim.AdamW(ref_mine, lr=1e-2), torch.optim.SGD(ref_other, lr=0.1)], 0, world * ROWS, [])
        with opts[0].gathered_params():
            if by_hand:
                for got, want in zip(model.parameters(), ref.parameters()):
                    assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6, what=f"stage {stage}")
    finally:
        logging.getLogger("zero_kernels").removeHandler(caught)
    said = [m for m in caught.messages if "keep each rank's own gradient unless" in m]
    if len(said) != 1 or "SGD.step(): parameter 'l1.weight' and 1 more of the model" not in said[0]:
        return [f"stage {stage} by_hand {by_hand}: warnings {said}"]
    return []


def _ranks(rank: int, world: int) -> list[str]:
    torch.set_num_threads(1)
    return [
        problem for stage in (0, 1, 2, 3) for by_hand in (False, True) for problem in _case(rank, world, stage, by_hand)
    ]


@pytest.mark.distributed
def test_another_optimizers_parameters_in_the_model_are_said_to_keep_their_own_gradient() -> None:
    run_ranks_checked(_ranks, 2, timeout_s=120)
