"""``copy.deepcopy``, pickle and ``torch.save`` of a ``ShardedFusedAdam``.

What a copy is. As with torch's optimizers, a copy optimizes copies of the parameters (same
values) and has copies of this rank's state (m, v, AMSGrad's maximum, the fp32 masters, step
counts, loss scale, the other keys of ``opt.state``), the same param groups and options, and
neither hooks nor gradients (torch's optimizers drop both too). It is rebuilt from them: a new
comm engine and pipeline, so it trains at once. Nothing here communicates: one rank may copy or
save alone.

Where a copy lives. The snapshot holds this rank's shard only, so the copy must live on the same
rank of a process group of the same size. ``copy.deepcopy`` keeps the original's process group.
Unpickling (``torch.load(f, weights_only=False)``) uses the default process group of the loading
process (none: one rank) and raises when its rank or size differ. An optimizer on a group other
than the default one cannot be pickled, since a group cannot be made again from a file: save
``opt.state_dict()`` (same world size and stage) or ``opt.full_state_dict()`` (any) instead.

The model. At stages 0-2 a copy holds the parameters only, as torch's optimizers do: copy or
pickle the model and the optimizer in one call (``copy.deepcopy((model, opt))``,
``torch.save({"model": model, "opt": opt}, f)``) for a copied optimizer that trains the copied
model. At stage 3 the optimizer needs the model (its hooks gather parameters), so a copy carries a
copy of it, ``copy.pipeline.module``; the model itself cannot be pickled while the optimizer's
hooks are on it, and to deep-copy both in one call put the optimizer first:
``opt2, model2 = copy.deepcopy((opt, model))``. Copy between steps, and at stage 3 outside
``gathered_params()``. Stage 3's partitioned frozen parameters come with it: the copy holds this rank's
chunk of each frozen unit (``stage3.frozen``), as of the trainable ones.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..stages import state_door as zstate

if TYPE_CHECKING:
    from .optimizer import ShardedFusedAdam

_TAG = "zero_kernels.ShardedFusedAdam"
_VERSION = 1
# the optimizer's settings a snapshot carries (attributes of ``ShardedFusedAdam``)
SETTINGS = (
    "options",
    "adam_w_mode",
    "max_grad_norm",
    "gradient_accumulation_steps",
    "loss_scaler",
    "skip_nonfinite_steps",
    "skipped_steps",
    "communication_data_type",
    "grad_accum_dtype",
)


@dataclass(frozen=True)
class Origin:
    """Where a snapshot was taken: a copy must be rebuilt on the same rank of a same-size group."""

    rank: int
    world_size: int

    def check(self, engine: Any) -> None:
        """Raise unless ``engine`` (the copy's) is on the same rank of a group of the same size."""
        if (engine.rank, engine.world_size) != (self.rank, self.world_size):
            raise RuntimeError(
                f"this ShardedFusedAdam was saved on rank {self.rank} of {self.world_size} and holds only that "
                f"rank's shard, but this process is rank {engine.rank} of {engine.world_size}: load it on the same "
                "rank of a process group of the same size, or save state_dict()/full_state_dict() instead"
            )


def _portable(opt: "ShardedFusedAdam", process_group: Any) -> dict[str, Any]:
    """Everything a copy is rebuilt from, by reference (the caller copies)."""
    pipeline = opt.pipeline
    params = [p for g in opt.param_groups for p in g["params"]]
    return {
        _TAG: _VERSION,
        "defaults": opt.defaults,
        "param_groups": opt.param_groups,
        "module": pipeline.module if pipeline.requires_module else None,
        "names": [opt._names.get(id(p)) for p in params],
        **{key: getattr(opt, key) for key in SETTINGS},
        "impl": pipeline.impl,
        "last_step": opt.last_step,
        "extra_state": opt.state.extra,
        "process_group": process_group,
        "origin": Origin(pipeline.rank, pipeline.world_size),
        "shard": {
            "layout": zstate.layout_signature(pipeline),
            "buffers": zstate.shard_tensors(pipeline),
            "written": zstate.written_masters(pipeline),
            "param_shards": zstate.param_shards(pipeline),
            "steps": dict(pipeline.steps),
            "shapes": [tuple(pipeline.param_shape(p)) for p in params],
            "dequantized": [buf.dequantized for buf in pipeline.buffers],  # qwZ: as the copied whole copies hold
        },
        "frozen": pipeline.frozen_chunks(),
    }


def deep_copy(opt: "ShardedFusedAdam", memo: dict[int, Any]) -> "ShardedFusedAdam":
    """``copy.deepcopy(opt)``: the copy shares the process group; everything else is copied."""
    new = type(opt).__new__(type(opt))
    memo[id(opt)] = new
    group = opt._engine.group_held
    if group is not None:
        memo[id(group)] = group
    with opt.pipeline.hooks_removed():
        state = copy.deepcopy(_portable(opt, group), memo)
    new.__setstate__(state)
    return new


def snapshot(opt: "ShardedFusedAdam") -> dict[str, Any]:
    """``opt.__getstate__()``: what pickle writes (the parameters themselves, so that a model pickled
    with the optimizer keeps training with it; at stage 3 a copy of the model without its hooks)."""
    group = opt._engine.group_held
    if group is not None and group is not dist.group.WORLD:
        raise RuntimeError(
            "a ShardedFusedAdam on a process group other than the default one cannot be pickled (a process group "
            "cannot be made again from a file): save opt.state_dict() or opt.full_state_dict() and load it into a "
            "new optimizer built on the group"
        )
    state = _portable(opt, None)
    if state["module"] is not None:  # its hooks cannot be pickled: a copy of it without them (and its parameters)
        with opt.pipeline.hooks_removed():
            copied = {key: state[key] for key in ("module", "param_groups", "frozen")}
            state.update(copy.deepcopy(copied))
    return state


def check(state: dict[str, Any]) -> None:
    """Raise unless ``state`` is a snapshot this version rebuilds from."""
    if state.get(_TAG) != _VERSION:
        raise RuntimeError(f"not a snapshot of a {_TAG} (version {_VERSION}): {sorted(state)[:5]}")


def settings(state: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's settings a snapshot carries (``SETTINGS``; absent from older snapshots: None)."""
    return {key: state.get(key) for key in SETTINGS}


def param_groups(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The snapshot's param groups, stage 3's freed parameters given back their shapes (zeros until loaded)."""
    groups = state["param_groups"]
    params = [p for g in groups for p in g["params"]]
    for p, shape in zip(params, state["shard"]["shapes"]):
        if p.requires_grad and p.numel() == 0 and math.prod(shape) > 0:  # stage 3 frees parameters between uses
            p.data = torch.zeros(shape, dtype=p.dtype, device=p.device)
    return groups


def frozen_values(state: dict[str, Any]) -> list[torch.Tensor]:
    """Stage 3's frozen parameters of the snapshot, freed, given back their shapes (zeros until loaded) and frozen
    again where they were unfrozen since (and not given to a param group), so that the copy has the original's
    frozen units; returns those, to unfreeze once the copy is built."""
    unfrozen = []
    for params, shapes, _ in state.get("frozen", []):
        for p, shape in zip(params, shapes):
            p.data = torch.zeros(shape, dtype=p.dtype, device=p.device)
            if p.requires_grad:
                unfrozen.append(p.requires_grad_(False))
    return unfrozen


def load_shards(opt: "ShardedFusedAdam", state: dict[str, Any]) -> None:
    """Into ``opt``, rebuilt from ``state`` by its own methods: this rank's shards, step counts, the last step's
    result and the other keys of ``opt.state``; raises when the rebuilt layout is not the saved one."""
    shard = state["shard"]
    pipeline = opt.pipeline
    if zstate.layout_signature(pipeline) != shard["layout"]:
        raise RuntimeError(
            "the rebuilt optimizer has another flat-buffer layout than the saved one: the model's modules or "
            "parameters, or the param groups, changed after the optimizer was built (a parametrization registered "
            "or removed, a module replaced); copy or pickle it only with the model and groups it was built with"
        )
    zstate.load_shard_state(pipeline, shard["buffers"])
    zstate.mark_written(pipeline, shard.get("written", []))
    pipeline.steps.update(shard["steps"])
    zstate.load_param_shards(pipeline, shard["param_shards"])
    for buf, dequantized in zip(pipeline.buffers, shard.get("dequantized", [True] * len(pipeline.buffers))):
        buf.dequantized = dequantized  # absent from older snapshots: requantized at a block's end, as then
    pipeline.load_frozen_chunks(state.get("frozen", []))
    opt.last_step = state["last_step"]
    opt.state.extra = dict(state["extra_state"])
