"""qgZ wired into stages 2 and 3: each bucket's reduce-scatter goes through ``comm.QuantizedReduceScatter``.

Tolerance, derived per step and per element of the gradient shard Adam consumes: the shard is the sum
over ranks s of each rank's local gradient divided by the world size; each source's chunk is quantized
once on its way (one hop: 1 node x 2 ranks inside the node, 2 nodes x 1 rank across), in blocks of
``BLOCK`` counted from the start of the chunk, so the element may differ from the exact float64 sum by
at most ``sum_s max|block of s's chunk| / 7 / 2`` plus float32 rounding (2**-20 of the sum of magnitudes).
The local gradients are recomputed at every step from the parameters the optimizer holds, on a replica,
so the check follows training over several steps. The unquantized optimizer beside it is the reference
run: same steps, no collective of its own changed (its reducer is None); saved state has the same keys,
shapes and dtypes (quantization never touches the fp32 master or the Adam state).
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import fields
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.helpers.dist import run_ranks_checked

BLOCK = 16
WIDTH = 24
STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 5))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(6, WIDTH, generator=torch.Generator().manual_seed(100 * rank + step))


@contextlib.contextmanager
def _quantized_gradients() -> Iterator[dict]:
    """The optimizer keywords that turn qgZ on: the config key once ``ZeroOptions`` carries it; until then
    its attribute, set on the class while the optimizer is made."""
    from zero_kernels.config.zero_config import ZeroOptions

    if "quantized_gradients" in {f.name for f in fields(ZeroOptions)}:
        yield {"zero_quantized_gradients": True}
        return
    ZeroOptions.quantized_gradients = True
    try:
        yield {}
    finally:
        del ZeroOptions.quantized_gradients


def _local_grads(model: nn.Module, opt, rank: int, step: int) -> list[torch.Tensor]:
    """Every rank's local gradients at the optimizer's current parameters, by parameter (float64)."""
    replica = _model()
    with opt.gathered_params():
        replica.load_state_dict(model.state_dict())
    replica(_batch(rank, step)).square().mean().backward()
    mine = torch.cat([p.grad.reshape(-1) for p in replica.parameters()])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [g.double() for g in everyone]


def _shard_problems(opt, model: nn.Module, local: list[torch.Tensor], step: int) -> list[str]:
    """Each bucket's gradient shard against the exact mean of the local gradients, within the bound."""
    pipeline, world, rank = opt.pipeline, dist.get_world_size(), dist.get_rank()
    ids = {id(p): i for i, p in enumerate(model.parameters())}
    starts = torch.tensor([0] + [p.numel() for p in model.parameters()]).cumsum(0).tolist()
    problems = []
    for buf in pipeline.buffers:
        flats = [torch.zeros(buf.layout.numel, dtype=torch.float64) for _ in range(world)]
        for slot in buf.layout.slots:
            at = starts[ids[id(buf.param_of(slot))]]
            for s in range(world):
                flats[s][slot.offset : slot.offset + slot.numel] = local[s][at : at + slot.numel] / world
        for bucket in buf.layout.buckets:
            lo = bucket.start + rank * bucket.shard_numel
            chunks = [f[lo : lo + bucket.shard_numel] for f in flats]
            exact = sum(chunks)
            pad = (-bucket.shard_numel) % BLOCK
            bound = sum(
                torch.cat([c.abs(), c.new_zeros(pad)]).view(-1, BLOCK).amax(1).repeat_interleave(BLOCK)[: c.numel()]
                for c in chunks
            )
            bound = bound / 7 / 2 + sum(c.abs() for c in chunks) * 2.0**-20
            got = pipeline.grad_shard(buf, bucket).double()
            err = (got - exact).abs()
            if not bool((err <= bound).all()):
                j = int((err - bound).argmax())
                problems.append(f"step {step} bucket {bucket.index} [{j}]: {got[j]} vs {exact[j]}, bound {bound[j]}")
    return problems


def _train(rank: int, world: int, stage: int, nodes: int) -> list[str]:
    import zero_kernels as zk
    from zero_kernels.kernels import tuning

    if nodes > 1:  # one rank per emulated node
        os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    tuning.QUANT_BLOCK[4] = BLOCK
    kwargs = dict(lr=1e-2, stage=stage, reduce_bucket_size=400)
    plain_model, qgz_model = _model(), _model()
    plain = zk.ShardedFusedAdam(plain_model if stage == 3 else plain_model.parameters(), **kwargs)
    with _quantized_gradients() as on:
        qgz = zk.ShardedFusedAdam(qgz_model if stage == 3 else qgz_model.parameters(), **kwargs, **on)
    problems = []
    if plain.pipeline.quantized_reducer is not None or qgz.pipeline.quantized_reducer is None:
        return ["qgZ is not on exactly where it was asked for"]
    losses = {"plain": [], "qgz": []}
    for step in range(STEPS):
        local = _local_grads(qgz_model, qgz, rank, step)
        for name, model, opt in (("plain", plain_model, plain), ("qgz", qgz_model, qgz)):
            loss = model(_batch(rank, step)).square().mean()
            loss.backward()
            losses[name].append(loss.item())
            if name == "qgz":
                problems += _shard_problems(opt, model, local, step)
            opt.step()
            opt.zero_grad()
    if qgz.pipeline.quantized_reducer.bytes["input"] == 0:
        problems.append("no gradient went through the quantized collective")
    saved = {k: (tuple(v.shape), v.dtype) for k, v in _flat_state(qgz.state_dict()).items()}
    if saved != {k: (tuple(v.shape), v.dtype) for k, v in _flat_state(plain.state_dict()).items()}:
        problems.append("the saved state differs in keys, shapes or dtypes")
    if not all(torch.isfinite(torch.tensor(v)).all() for v in losses.values()):
        problems.append(f"losses {losses}")
    return problems


def _flat_state(sd: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_flat_state(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("stage,nodes", [(2, 1), (3, 2)], ids=["stage 2, 1 node x 2", "stage 3, 2 nodes x 1"])
def test_training_reduces_within_the_quantization_bound(stage: int, nodes: int) -> None:
    run_ranks_checked(_train, 2, stage, nodes)


def test_stage_1_refuses_quantized_gradients() -> None:
    import zero_kernels as zk

    with pytest.raises(ValueError, match="zero_quantized_gradients=True applies at stages 2-3 only"):
        zk.ShardedFusedAdam(copy.deepcopy(_model()).parameters(), stage=1, zero_quantized_gradients=True)
