"""Every rank's part of every bucket starts on a 64-byte boundary and holds a multiple of 16 elements.

That is what the Adam kernel needs to compile to its vector variant (every pointer 16-byte aligned,
the length a multiple of 16) on real models, whose parameter counts are rarely round. Parameters
still lie back to back from the buffer's start and padding only follows the last one (stage 2
relies on it); padding is never saved in a checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_kernels.optim as zo
from zero_kernels.layout import ALIGN_BYTES, BufferLayout, align_elements
from zero_kernels.stages import update

SHAPES = [(77,), (1,), (11, 5), (5,), (1000, 3), (3, 7, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 8])
@pytest.mark.parametrize("bucket_numel", [13, 1000, 1 << 20])
def test_rank_parts_aligned_params_back_to_back(dtype: torch.dtype, num_shards: int, bucket_numel: int) -> None:
    params = [torch.zeros(s, dtype=dtype) for s in SHAPES]
    layout = BufferLayout.build(params, bucket_numel=bucket_numel, num_shards=num_shards)
    unit = align_elements(params[0].element_size())
    size = params[0].element_size()
    total = sum(p.numel() for p in params)
    assert total <= layout.numel < total + num_shards * unit, "padding beyond one alignment unit per shard"
    offset = 0
    for slot in layout.slots:  # reversed order, back to back from 0
        assert slot.offset == offset
        offset += slot.numel
    for bucket in layout.buckets:
        assert bucket.shard_numel % 16 == 0, f"bucket {bucket.index}: rank parts of {bucket.shard_numel} elements"
        assert (bucket.shard_offset * 4) % ALIGN_BYTES == 0, f"bucket {bucket.index}: fp32 shard part misaligned"
        for rank in range(num_shards):
            assert (bucket.rank_start(rank) * size) % ALIGN_BYTES == 0, f"bucket {bucket.index} rank {rank}"
    for rank in range(num_shards):
        covered = sum(seg.numel for seg in layout.segments(rank))
        assert covered <= layout.shard_numel
    assert sum(seg.numel for r in range(num_shards) for seg in layout.segments(r)) == total


def _aligned_adam_case(rank: int, world: int) -> None:
    """Adam launches get 64-byte aligned shards of multiples of 16 elements: stage 1 (slices of the full
    gradient buffer) and stage 3 (gradient and parameter shards, as stage 2)."""
    seen: list[tuple[str, int, int]] = []
    real = update.adam_step

    def spy(param, grad, exp_avg, exp_avg_sq, **kwargs):
        tensors = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        if kwargs.get("out") is not None:
            tensors["out"] = kwargs["out"]
        for name, t in tensors.items():
            seen.append((name, t.data_ptr() % ALIGN_BYTES, t.numel() % 16))
        real(param, grad, exp_avg, exp_avg_sq, **kwargs)

    update.adam_step = spy
    try:
        for stage in (1, 3):
            for dtype in (torch.float32, torch.bfloat16):
                torch.manual_seed(0)
                model = nn.Sequential(nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)
                opt = zo.ShardedFusedAdam(
                    model, lr=1e-3, stage=stage, reduce_bucket_size=50, stage3_param_persistence_threshold=0
                )
                seen.clear()
                model(torch.randn(4, 13, dtype=dtype)).float().square().mean().backward()
                opt.step()
                assert seen, f"stage {stage} {dtype}: no Adam launch"
                bad = [s for s in seen if s[1] or s[2]]
                assert not bad, f"stage {stage} {dtype} rank {rank}: (tensor, address % 64, numel % 16) {bad[:4]}"
    finally:
        update.adam_step = real


def test_stage_adam_launches_are_aligned(spawn) -> None:
    spawn(_aligned_adam_case, 2)
