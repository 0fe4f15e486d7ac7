"""The update runs of one bucket (``zero_kernels.stages.update``) in one process.

- ``runs``: on layouts of 1-4 shards, every rank and bucket, against a brute-force walk of the
  rank's part of the bucket: every element of a parameter that got a gradient is updated exactly
  once, at its parameter's step count + 1; nothing of a parameter without one; the padding after
  the last parameter joins the last run when that one is updated; runs are maximal (neighbours
  differ in step or are not adjacent).
- ``aligned_span``: the smallest 16-element-aligned span around a run, cut at the shard's end.
- A world of one, every stage, with runs split by differing step counts (a parameter without a
  gradient in some steps, one whose ``opt.state[p]["step"]`` is set) and buckets that cut
  parameters: in lock-step with ``torch.optim.AdamW`` on float64 copies, element by element
  (fp32 tolerance of DESIGN.md).
"""

from __future__ import annotations

import random
from functools import partial
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
from torch import nn

import zero_kernels.optim as zo
from tests.helpers.check import assert_close
from zero_kernels.layout import MIN_ALIGN_ELEMENTS, BufferLayout
from zero_kernels.stages.buffers import FlatBuffer
from zero_kernels.stages.update import aligned_span, runs

SIZES = [37, 1, 20, 2, 16, 5]


def _expected_steps(
    layout: BufferLayout, indices: list[int], rank: int, bucket: int, counts: dict[int, int], with_grad: set[int]
) -> list[Optional[int]]:
    """Per element of ``rank``'s part of ``bucket``: the step it is updated at (None: not updated), by brute force."""
    b = layout.buckets[bucket]
    owner: list[Optional[int]] = []
    for element in range(b.rank_start(rank), b.rank_start(rank) + b.shard_numel):
        hit = [s.param for s in layout.slots if s.offset <= element < s.offset + s.numel]
        owner.append(indices[hit[0]] if hit else None)
    steps = [counts[i] + 1 if i is not None and i in with_grad else None for i in owner]
    last = max((k for k, i in enumerate(owner) if i is not None), default=None)
    if last is not None:  # the padding after the last parameter goes with it
        steps[last + 1 :] = [steps[last]] * (len(steps) - last - 1)
    return steps


@pytest.mark.parametrize("bucket_numel", [1, 40, 1000])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_runs_update_each_element_once_at_its_step(num_shards: int, bucket_numel: int) -> None:
    rng = random.Random(num_shards * 1000 + bucket_numel)
    params = [torch.empty(n) for n in SIZES]
    layout = BufferLayout.build(params, bucket_numel=bucket_numel, num_shards=num_shards)
    indices = [7, 3, 12, 5, 9, 0]  # the optimizer's numbering differs from the buffer's
    for trial in range(6):
        counts = {i: rng.choice([0, 0, 1, 4]) for i in indices}
        with_grad = {i for i in indices if trial == 0 or rng.random() < 0.7}
        for rank in range(num_shards):
            pipeline = SimpleNamespace(shard_rank=rank, step_counts=SimpleNamespace(counts=counts))
            buf = SimpleNamespace(layout=layout, indices=indices)
            buf.index_of = partial(FlatBuffer.index_of, buf)  # the real lookup on this stand-in
            for b in layout.buckets:
                expected = _expected_steps(layout, indices, rank, b.index, counts, with_grad)
                got: list[Optional[int]] = [None] * b.shard_numel
                found = list(runs(pipeline, buf, b, with_grad))
                for start, numel, step in found:
                    assert 0 <= start and numel > 0 and start + numel <= b.shard_numel, (start, numel, b.shard_numel)
                    assert all(g is None for g in got[start : start + numel]), f"{found}: elements updated twice"
                    got[start : start + numel] = [step] * numel
                what = f"{num_shards} shards, rank {rank}, bucket {b.index}, counts {counts}, with_grad {with_grad}"
                assert got == expected, f"{what}: runs {found}"
                for (s1, n1, t1), (s2, _, t2) in zip(found, found[1:]):
                    assert s1 + n1 < s2 or t1 != t2, f"{what}: runs {found} not merged"


def test_aligned_span_is_the_smallest_aligned_cover() -> None:
    unit = MIN_ALIGN_ELEMENTS
    for limit in (16, 48, 160):
        for start in range(limit):
            for end in range(start + 1, limit + 1):
                first, last = aligned_span(start, end, limit)
                assert first % unit == 0 and first <= start < first + unit, (start, end, first)
                assert end <= last <= limit and (last % unit == 0 or last == limit), (start, end, last)
                assert last - end < unit, (start, end, last)


class _Four(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.randn(n)) for n in SIZES)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        used = [p for k, p in enumerate(self.params) if not (k == 2 and step % 3 == 1)]  # params[2]: no gradient
        return sum((p * x[: p.numel()]).sin().sum() * (k + 1) for k, p in enumerate(used))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_split_runs_match_adamw_in_float64(stage: int) -> None:
    torch.manual_seed(0)
    model = _Four()
    ref = _Four().double()
    ref.load_state_dict(model.state_dict())
    opt = zo.ShardedFusedAdam(model, lr=1e-2, weight_decay=0.1, stage=stage, reduce_bucket_size=16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(6):
        x = torch.randn(64, generator=torch.Generator().manual_seed(step))
        model(x, step).backward()
        ref(x.double(), step).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if step == 1:  # a step count of its own: the runs split at params[4]'s boundaries
            with opt.gathered_params():
                opt.state[model.params[4]]["step"] = torch.tensor(9.0)
            ref_opt.state[ref.params[4]]["step"] = torch.tensor(9.0, dtype=torch.float64)
        with opt.gathered_params():
            for k, (p, r) in enumerate(zip(model.params, ref.params)):
                scale = r.detach().abs().max().item()
                assert_close(p, r, rtol=1e-5, atol=1e-6 * scale, what=f"stage {stage} step {step} params[{k}]")
