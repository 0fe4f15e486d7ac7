"""Offload with what users' configurations combine, against the same run without offload, bit for bit after every
step on 2 gloo ranks: param groups with their own lr, weight decay, betas, eps, AMSGrad and ``maximize``, a head tied
to the embedding, a frozen parameter, a module left out of some steps, a share of the state on the device
(``ratio``), sub-groups smaller than a parameter swapped through one buffer with both pipelines on, accumulation
with clipping, and ``clip_grad_norm_``'s returned norm."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import zero_kernels.optim as zo
from tests.helpers.dist import run_ranks
from tests.offload.exactness import assert_same

BUCKET = 13  # elements: parameters straddle buckets and shards
ROWS = 2


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.scale = nn.Parameter(torch.tensor([1.3]))
        self.mid = nn.Linear(8, 8)
        self.frozen = nn.Parameter(torch.randn(8), requires_grad=False)
        self.extra = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.mid(self.emb(idx) * self.scale) + self.frozen)
        if use_extra:
            h = h + self.extra(h)
        return self.head(h).float().square().mean()


def _groups(m: _Tied) -> list[dict]:
    return [
        {"params": [m.emb.weight, m.scale], "lr": 2e-2, "weight_decay": 0.1, "betas": (0.8, 0.99), "amsgrad": True},
        {"params": [m.mid.weight, m.mid.bias, m.frozen], "lr": 1e-2, "weight_decay": 0.0, "maximize": True},
        {"params": [m.extra.weight, m.extra.bias, m.head.bias], "lr": 3e-2, "eps": 1e-6},
    ]


def _opt(model: _Tied, stage: int, offload: dict | None) -> zo.ShardedFusedAdam:
    kwargs: dict = {"stage3_param_persistence_threshold": 10} if stage == 3 else {}
    if offload is not None:
        kwargs.update(offload_optimizer=offload, sub_group_size=5)
    return zo.ShardedFusedAdam(
        _groups(model), module=model, stage=stage, reduce_bucket_size=BUCKET, max_grad_norm=0.05, **kwargs
    )


def _pair(rank: int, world: int, stage: int, offload: dict) -> None:
    torch.manual_seed(0)
    plain = _Tied().to(torch.bfloat16)
    tiered = copy.deepcopy(plain)
    a, b = _opt(plain, stage, None), _opt(tiered, stage, offload)
    for step in range(5):
        x = torch.randint(0, 20, (2 * world * ROWS, 3), generator=torch.Generator().manual_seed(step))
        norms = []
        for model, opt in ((plain, a), (tiered, b)):
            for micro in range(2):
                rows = x[(micro * world + rank) * ROWS : (micro * world + rank + 1) * ROWS]
                with opt.no_sync() if micro == 0 else contextlib.nullcontext():
                    model(rows, step % 3 != 1).backward()  # extra: no gradient at step 1, then one again
            norms.append(opt.clip_grad_norm_(0.03))
            opt.step()
            opt.zero_grad()
        what = f"stage {stage} {offload['device']} step {step}"
        assert torch.equal(norms[0], norms[1]), f"{what}: clip_grad_norm_ {norms}"
        assert_same(a, b, plain, tiered, what)
    assert all(buf.tier_from > 0 for buf in b._pipeline.buffers[:1]), "ratio 0.5 keeps a part on the device"
    b._pipeline.close()


def _ranks(rank: int, world: int, scratch: str) -> None:
    nvme = Path(scratch) / f"nvme{rank}"
    nvme.mkdir()
    disk = {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 1, "pipeline_read": True, "pipeline_write": True}
    for offload in ({"device": "cpu"}, disk):
        for stage in (1, 2, 3):
            _pair(rank, world, stage, {**offload, "ratio": 0.5})


@pytest.mark.distributed
@pytest.mark.slow
def test_groups_tied_weights_and_a_share_on_the_device_are_exact(tmp_path: Path) -> None:
    run_ranks(_ranks, 2, str(tmp_path), timeout_s=300.0)
