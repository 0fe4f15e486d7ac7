"""The step's update when the optimizer state lives in a tier (``offload_optimizer``): host memory or files.

Per bucket, in the step's bucket order:

1. the bucket's reduced gradient shard is copied down into the buffer's host copy (``HostTier.down``:
   in the dtype the stage keeps it in; bf16: 2 bytes per parameter);
2. where the device parameters differ from the host copy the tier last pushed up (a load or an
   edit since the last step; ``HostTier.changed``), the bucket is copied down, so the update adopts
   the edit exactly as without offload;
3. the same fused kernel as without offload (``update.launch``: the C++ CPU Adam where the extension
   is built, else the PyTorch reference; the same backend both ways on a CPU-only machine, so results
   are bit for bit those without offload) updates the host state on the tier's threads
   (``HostTier.compute``), writing the new low-precision values into the host parameter copy (fp32
   parameters: their master is that copy);
4. the bucket's parameters go up (``HostTier.up``), then the stage all-gathers them as usual.

The state tensors of a bucket come from ``tier.state(buf, bucket)``: views of resident host tensors
(host tier) or of a sub-group swapped in from its files (disk tier), written back by ``tier.release``.
Clipping, the non-finite skip, loss scaling and the ranks' agreement checks run before, unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from ..comm.objects import all_gather_objects
from ..offload import HostTier
from .buffers import FlatBuffer, GroupHyper
from .layout import Bucket
from .outcome import Decision
from .update import BucketTensors, launch

if TYPE_CHECKING:
    from .base import Pipeline


def make_tier(options: Any, engine: Any) -> Optional[HostTier]:
    """The state tier ``options.offload_optimizer`` asks for, or None; a tier that cannot start on some rank
    raises on every rank (after the others closed theirs)."""
    config = options.offload_optimizer
    if not config.enabled:
        return None
    tier: Optional[HostTier] = None
    problem: Optional[str] = None
    try:
        if config.device == "cpu":
            tier = HostTier(config)
        else:
            from ..offload import DiskTier

            tier = DiskTier(config, options.aio, rank=engine.rank)
    except (OSError, ValueError) as err:
        problem = str(err)
    problems = all_gather_objects(engine, problem, name="offload.start") if engine.world_size > 1 else [problem]
    failed = [(r, p) for r, p in enumerate(problems) if p is not None]
    if failed:
        if tier is not None:
            tier.close()
        text = "; ".join(f"rank {r}: {p}" for r, p in failed)
        raise OSError(f"zero_optimization.offload_optimizer could not start: {text}")
    return tier


def attach(pipeline: "Pipeline", buf: FlatBuffer) -> None:
    """Give a new buffer its host copies, the parameters' taken from the device once."""
    tier = pipeline.tier
    shard = tier.attach(id(buf), buf.layout.shard_numel, buf.dtype, pipeline.accumulate_dtype_of(buf))
    for bucket in buf.layout.buckets:
        tier.init(buf.shard_slice(shard.params, bucket), pipeline.param_shard(buf, bucket))


def update_bucket(
    pipeline: "Pipeline", buf: FlatBuffer, bucket: Bucket, h: GroupHyper, decision: Decision, with_grad: set[int]
) -> None:
    """One bucket's update through the tier (see the module docstring); same arguments as ``update.update_bucket``."""
    tier = pipeline.tier
    if h.amsgrad and buf.max_exp_avg_sq is None:
        pipeline.allocate_max_exp_avg_sq(buf.group)
    shard = tier.shards[id(buf)]
    device_params = pipeline.param_shard(buf, bucket)
    params = buf.shard_slice(shard.params, bucket)
    if tier.changed(device_params, params):
        tier.down(params, device_params)
    grads = tier.down(buf.shard_slice(shard.grads, bucket), pipeline.grad_shard(buf, bucket))
    state = _state(pipeline, buf, bucket)
    low = buf.master is not None
    tensors = BucketTensors(
        state["master"] if low else params,
        grads,
        state["exp_avg"],
        state["exp_avg_sq"],
        params if low else None,
        state.get("max_exp_avg_sq") if h.amsgrad else None,
    )
    with tier.compute():
        launch(pipeline, buf, bucket, h, decision, with_grad, tensors)
    tier.up(device_params, params)


def _state(pipeline: "Pipeline", buf: FlatBuffer, bucket: Bucket) -> dict[str, torch.Tensor]:
    """``{kind: this rank's shard of bucket}`` of the state tensors ``buf`` has, in host memory."""
    return {kind: buf.shard_slice(t, bucket) for kind, t in _tensors(buf).items()}


def _tensors(buf: FlatBuffer) -> dict[str, torch.Tensor]:
    kinds = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")
    return {kind: getattr(buf, kind) for kind in kinds if getattr(buf, kind) is not None}


def finish_step(pipeline: "Pipeline") -> None:
    """After the last bucket (the disk tier's writes complete here)."""


def memory(pipeline: "Pipeline") -> dict[str, list[torch.Tensor]]:
    """The tensors of the optimizer state by tier: ``host`` (the state and the tier's host copies)."""
    state = [t for buf in pipeline.buffers for t in _tensors(buf).values()]
    return {"host": state + pipeline.tier.host_tensors()}
