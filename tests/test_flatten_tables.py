"""No host synchronisation in backward: stage 2 and 3 build each flatten table once, on the first step.

Stage 2 copies each gradient into its bucket with one flatten launch as it arrives. The launch's table
(offsets, sizes, chunks) must not depend on where the gradient lives: on CUDA the caching allocator
may hand out new addresses every step, and a table keyed on them is rebuilt (and copied to the
device) for every parameter of every step. Here each step's gradients are kept alive so that the
next step's land at new addresses, and the tables built and host copies made are counted per step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_kernels as zk
from zero_kernels.kernels import triton_flatten

STEPS = 3


@pytest.mark.parametrize("stage", [2, 3])
def test_tables_built_on_the_first_step_only(stage: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 7), nn.LayerNorm(7))
    kept: list[torch.Tensor] = []  # every step's gradients stay alive: the next step's get new addresses
    for p in model.parameters():  # registered first, so it sees p.grad before the optimizer takes it
        p.register_post_accumulate_grad_hook(lambda p: kept.append(p.grad))
    opt = zk.ShardedFusedAdam(
        model, lr=1e-3, stage=stage, impl="triton", reduce_bucket_size=64, stage3_param_persistence_threshold=0
    )
    triton_flatten.cache_clear()
    built, copies, addresses = [], [], []
    for step in range(STEPS):
        before = triton_flatten.cache_info()
        kept_before = len(kept)
        model(torch.randn(5, 12)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        after = triton_flatten.cache_info()
        built.append(after["misses"] - before["misses"])
        copies.append(after["host_copies"] - before["host_copies"])
        addresses.append({g.data_ptr() for g in kept[kept_before:]})
    assert all(not (addresses[i] & addresses[j]) for i in range(STEPS) for j in range(i)), "addresses were reused"
    pieces = sum(len(buf.layout.slot_buckets[i]) for buf in opt._pipeline.buffers for i in range(len(buf.layout.slots)))
    assert 0 < built[0] <= pieces, f"first step: {built[0]} tables built, at most one per parameter piece ({pieces})"
    assert built[1:] == [0] * (STEPS - 1), f"tables built per step: {built}"
    assert copies == built, f"host copies per step: {copies} (one per table built)"
