"""Optimizer state of a pipeline in two forms: this rank's shards, and full per-parameter tensors.

- Sharded (``shard_state``/``load_shard_state``): the flat fp32 shards of every buffer (m, v,
  AMSGrad's running maximum when the group has used it, and the master copy when the parameters
  are low precision), valid only for the same layout (``layout_signature``: world size, stage,
  buffers and buckets).
- Full (``gather_full_state``/``scatter_full_state``): ``{param index: {"step", "exp_avg",
  "exp_avg_sq"[, "max_exp_avg_sq"][, "master"]}}`` with tensors shaped like the parameters, the
  ``torch.optim.AdamW`` layout (which keeps extra keys such as ``master``, the fp32 master of a
  bf16/fp16 parameter). Gathering is a collective (every rank must call it); scattering only reads
  this rank's parts.

Reading the masters first gives them what was written into the parameters since the last step
(``adopt.current``); loading one keeps it where it rounds to the parameter's value, and the next
step takes the parameter's value elsewhere (``master``): so a master from an older state than the
model's weights never undoes the weights.
"""

from __future__ import annotations

from typing import Any

import torch

from .adopt import current
from .base import FlatBuffer, Pipeline
from .master import record

_MOMENTS = ("exp_avg", "exp_avg_sq")
_AMSGRAD = "max_exp_avg_sq"


def layout_signature(pipeline: Pipeline) -> list[Any]:
    """What must match for a sharded state to load: stage, world size, and each buffer's shape."""
    buffers = [
        [buf.group, str(buf.dtype), buf.layout.numel, [b.numel for b in buf.layout.buckets], buf.indices]
        for buf in pipeline.buffers
    ]
    return [pipeline.stage, pipeline.world_size, buffers]


def shard_state(pipeline: Pipeline) -> list[dict[str, torch.Tensor]]:
    """Copies of this rank's shards, one dict per buffer."""
    current(pipeline)
    names = (*_MOMENTS, _AMSGRAD, "master")
    return [{n: getattr(buf, n).clone() for n in names if getattr(buf, n) is not None} for buf in pipeline.buffers]


def load_shard_state(pipeline: Pipeline, states: list[dict[str, torch.Tensor]]) -> None:
    """Copy shards saved by ``shard_state`` (same layout, checked by the caller) into the buffers."""
    for buf, saved in zip(pipeline.buffers, states):
        _match_amsgrad(buf, _AMSGRAD in saved)
        for name, tensor in saved.items():
            if getattr(buf, name) is not None:
                getattr(buf, name).copy_(tensor)
        if buf.master is not None and "master" not in saved:
            pipeline.refresh_master(buf)
        record(buf)


def _match_amsgrad(buf: FlatBuffer, loaded: bool) -> None:
    """Before loading: a buffer receives AMSGrad's maximum when the state has one; else it restarts at zero."""
    if loaded and buf.max_exp_avg_sq is None:
        buf.max_exp_avg_sq = torch.zeros_like(buf.exp_avg_sq)
    elif not loaded and buf.max_exp_avg_sq is not None:
        buf.max_exp_avg_sq.zero_()


def _gather(pipeline: Pipeline, buf: FlatBuffer, shard: torch.Tensor) -> torch.Tensor:
    if pipeline.num_shards == 1:
        return shard
    full = torch.empty(buf.layout.numel, dtype=shard.dtype, device=shard.device)
    handles = [
        pipeline.engine.all_gather(buf.bucket_slice(full, b), buf.shard_slice(shard, b), name=f"state.{b.index}")
        for b in buf.layout.buckets
    ]
    for h in handles:
        h.wait()
    return full


def gather_full_state(pipeline: Pipeline, keep: bool = True) -> dict[int, dict[str, torch.Tensor]]:
    """``{param index: {"step", "exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"][, "master"]}}`` for every parameter
    that has stepped (``master``: bf16/fp16 parameters).

    Args:
        pipeline: the pipeline whose shards are gathered (a collective: every rank calls it).
        keep: False on ranks that only take part: they return ``{}`` and hold one buffer at a time.
    """
    current(pipeline)
    out: dict[int, dict[str, torch.Tensor]] = {}
    for buf in pipeline.buffers:
        names = _MOMENTS + ((_AMSGRAD,) if buf.max_exp_avg_sq is not None else ())
        names += ("master",) if buf.master is not None else ()
        full = {name: _gather(pipeline, buf, getattr(buf, name)) for name in names}
        for slot in buf.layout.slots if keep else ():
            index = buf.indices[slot.param]
            if pipeline.steps[index] == 0:
                continue
            entry = {"step": torch.tensor(float(pipeline.steps[index]))}
            for name in names:
                entry[name] = full[name].narrow(0, slot.offset, slot.numel).view(slot.shape).clone()
            out[index] = entry
    return out


def scatter_full_state(pipeline: Pipeline, state: dict[int, dict[str, torch.Tensor]]) -> None:
    """Load a full state (shapes checked by the caller); parameters absent from it start fresh, and low-precision
    parameters without a ``master`` entry (fp32 parameters ignore one) start their master from their values."""
    for buf in pipeline.buffers:
        entries = [state.get(i) for i in buf.indices]
        _match_amsgrad(buf, any(e is not None and _AMSGRAD in e for e in entries))
        for name in _MOMENTS + ((_AMSGRAD,) if buf.max_exp_avg_sq is not None else ()):
            _scatter(pipeline, buf, state, name)
        if buf.master is not None:
            pipeline.refresh_master(buf)
            _scatter(pipeline, buf, state, "master")
            record(buf)
        for slot in buf.layout.slots:
            index = buf.indices[slot.param]
            entry = state.get(index)
            pipeline.steps[index] = 0 if entry is None else int(float(entry["step"]))


def _scatter(pipeline: Pipeline, buf: FlatBuffer, state: dict, name: str) -> None:
    """This rank's shard of ``name`` from the state's entries; where they lack it: zeros, or for ``master``
    what the shard holds (the parameters' values)."""
    full = torch.zeros(buf.layout.numel, dtype=torch.float32, device=buf.device)
    given = torch.zeros(buf.layout.numel, dtype=torch.bool, device=buf.device)
    for slot in buf.layout.slots:
        entry = state.get(buf.indices[slot.param])
        if entry is not None and name in entry:
            full.narrow(0, slot.offset, slot.numel).copy_(entry[name].reshape(-1))
            given.narrow(0, slot.offset, slot.numel).fill_(True)
    shard = getattr(buf, name)
    for b in buf.layout.buckets:
        mine = buf.shard_slice(shard, b)
        values = buf.rank_slice(full, b, pipeline.shard_rank)
        mine.copy_(values if name != "master" else values.where(buf.rank_slice(given, b, pipeline.shard_rank), mine))
