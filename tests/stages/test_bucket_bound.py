"""The bucket bound: ``reduce_bucket_size`` / ``allgather_bucket_size`` bound what one reduction holds,
and inside that bound the backend's granule (``stages.buckets``) sets the bucket.

With the sizes of published DeepSpeed configs (5e7, and DeepSpeed's default 5e8) a bucket must not
hold the whole model (nothing would overlap with backward): the gradients are reduced in several
buckets of the granule, every collective stays within the configured bound, the gradient memory of
the reductions (``memory_report()``: ``buffers`` and the scratch part of ``grads``) stays within a
few buckets, and the result is the same, bit for bit, as with the granule configured by hand. The
granule is shrunk to 4096 elements so that a small model spans many buckets. A process group whose backend is
named per device ("cpu:gloo", "cpu:gloo,cuda:nccl", or "undefined" from ``init_process_group()`` without one) takes
the granule of the backend its tensors use.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_kernels.optim as zo
from zero_kernels.stages import buckets

GRANULE = 4096  # elements (fp32) per bucket in these tests
WIDTH = 48
LIVE_BUCKETS = 2 + 1 + 2  # in flight (max_inflight, +1 while launching) and being filled, in order


def _model() -> nn.Module:
    """12 layers of 2352 parameters: each parameter fits in a bucket, the model in about 7."""
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


def _run(stage: int, rank: int, config: dict) -> tuple[list[torch.Tensor], dict]:
    """Two steps; the parameters after them, and what the collectives and memory reports showed."""
    model = _model()
    opt = zo.ShardedFusedAdam(model, lr=1e-2, stage=stage, impl="torch", **config)
    seen = {"reduce": [], "gather": [], "scratch": 0, "buffers": 0}
    engine = opt.pipeline.engine
    reduce_scatter, all_gather = engine.reduce_scatter, engine.all_gather

    def rs(out: torch.Tensor, full: torch.Tensor, **kw):
        seen["reduce"].append(full.numel())
        return reduce_scatter(out, full, **kw)

    def ag(full: torch.Tensor, shard: torch.Tensor, **kw):
        seen["gather"].append(full.numel())
        return all_gather(full, shard, **kw)

    engine.reduce_scatter, engine.all_gather = rs, ag
    shard_bytes = sum(b.grad_shard.numel() * 4 for b in opt.pipeline.buffers)

    def watch(p: torch.Tensor) -> None:  # runs after the optimizer's own hook on the same parameter
        report = opt.memory_report()
        seen["scratch"] = max(seen["scratch"], report["grads"] - shard_bytes + report["buffers"])
        seen["buffers"] = max(seen["buffers"], report["buffers"])

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(watch)
    torch.manual_seed(1 + rank)
    for _ in range(2):
        model(torch.randn(4, WIDTH)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], seen


def _bound(rank: int, world_size: int) -> None:
    buckets.GRANULE_BYTES["gloo"] = GRANULE * 4
    numel = sum(p.numel() for p in _model().parameters())
    assert numel > LIVE_BUCKETS * GRANULE  # one bucket of the whole model would break the bound
    for stage in (2, 3):
        by_hand, _ = _run(stage, rank, {"reduce_bucket_size": GRANULE})
        for size in (50_000_000, 500_000_000):
            config = {"reduce_bucket_size": size, "allgather_bucket_size": size}
            params, seen = _run(stage, rank, config)
            where = f"stage {stage}, reduce_bucket_size {size:.0e}"
            per_backward = len(seen["reduce"]) // 2
            assert per_backward >= numel // GRANULE, f"{where}: {per_backward} reductions per backward"
            assert max(seen["reduce"] + seen["gather"]) <= GRANULE, where
            if stage == 2:  # stage 3 also holds each unit's gathered gradients until they are reduced
                assert seen["scratch"] <= LIVE_BUCKETS * GRANULE * 4, f"{where}: {seen['scratch']} bytes of buckets"
            assert seen["scratch"] <= size * 4, where
            for a, b in zip(params, by_hand):
                assert torch.equal(a, b), f"{where}: not the result of reduce_bucket_size {GRANULE}"
    # allgather_bucket_size bounds stage 2's parameter all-gathers (and the buckets) on its own
    _, seen = _run(2, rank, {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 1000})
    assert max(seen["reduce"] + seen["gather"]) <= 1000
    assert len(seen["gather"]) // 2 >= numel // 1000
    # a group whose backend is named per device (as with init_process_group() and no backend) takes gloo's granule
    per_device = dist.new_group([0, 1], backend="cpu:gloo")
    params, seen = _run(2, rank, {"reduce_bucket_size": 500_000_000, "process_group": per_device})
    assert len(seen["reduce"]) // 2 >= numel // GRANULE, f"cpu:gloo: {len(seen['reduce']) // 2} reductions per backward"


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.distributed
def test_bucket_bound_with_published_sizes(spawn, world_size: int) -> None:
    spawn(_bound, world_size)
