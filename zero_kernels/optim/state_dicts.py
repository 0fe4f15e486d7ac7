"""State dicts of ``ShardedFusedAdam``: build them, check them, load them; and the snapshot that
``copy.deepcopy`` and pickle carry.

Two layouts, told apart by the ``zero_kernels.sharded`` key:

- sharded (``state_dict()``): ``state`` maps each flat buffer's index to this rank's fp32 shards;
  it reloads only with the same stage, world size, bucket size and model. Where every rank holds
  the whole state (stage 0, or one rank) ``state_dict()`` is the full layout instead, which
  ``torch.optim.AdamW`` loads too, with ``master`` (the fp32 master of bf16/fp16 parameters) in each
  entry and the loss scale, ``skipped_steps`` and ``dequantized`` (qwZ: the param groups whose other ranks' parameter
  parts a step's int8 all-gather wrote) under the ``zero_kernels.sharded`` key (so does the sharded layout; a load
  restores them where the state has them).
- full (``full_state_dict()``, ``consolidate_state_dict``, ``torch.optim.AdamW``'s): ``state`` maps
  each parameter's index to AdamW's entry (``step``, ``exp_avg``, ``exp_avg_sq``, with AMSGrad
  ``max_exp_avg_sq``, and for bf16/fp16 parameters their fp32 ``master``, an extra key AdamW keeps
  and ignores), shaped like the parameter; it loads at any stage and world size. Ours carry the loss
  scale, ``skipped_steps`` and ``dequantized`` under the ``zero_kernels.sharded`` key too (AdamW ignores the key).

Both number parameters as torch does (a parameter listed twice keeps its first index) and keep the
keys of ``opt.state`` that are not parameters (torch keeps whatever hooks put there). Loading the AdamW
layout maps each state key through the saved groups' ``params`` as torch does (so FQN keys, as
``torch.distributed.checkpoint`` writes them, load too); the sharded layout is keyed by flat-buffer index,
and entries without ``step`` (its shards, when the ``zero_kernels.sharded`` key was lost) are refused. Loading
replaces each param group by the saved one as torch does (``param_names``, ``initial_lr``,
``amsgrad``...; ``amsgrad``/``maximize`` absent from an older state: False, AdamW's defaults),
except for AdamW's implementation flags and ``decoupled_weight_decay``, which this optimizer fixes: a state
saved in the other mode (``torch.optim.Adam``'s L2 decay into AdamW mode, or the reverse; DeepSpeed's
``adam_w_mode`` key read too) with a non-zero ``weight_decay`` is logged at WARNING, naming both modes.
"""

from __future__ import annotations

import copy
import logging
import math
import operator
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ..stages import master
from ..stages import state_door as zstate
from ..wording import plural
from .args import ALGORITHM_FLAGS, IMPLEMENTATION_FLAGS, check_flags

if TYPE_CHECKING:
    from .optimizer import ShardedFusedAdam

log = logging.getLogger("zero_kernels")

FORMAT = zstate.STATE_DICT_KEY
KEEP_OWN = zstate.KEEP_OWN
_ADAMW_GROUP_KEYS = {**ALGORITHM_FLAGS, **IMPLEMENTATION_FLAGS}
_HYPER = ("lr", "betas", "eps", "weight_decay")
_LOST_FORMAT = (
    f"Entries without 'step' are the shards of a sharded state_dict() that lost its {FORMAT!r} key, as "
    "torch.distributed.checkpoint's get_state_dict drops it: a sharded state loads only as this rank's "
    "state_dict() saved it; zero_kernels.checkpoint.save/load is the sharded checkpoint, full_state_dict() "
    "the one any world size loads"
)


def groups_for_save(param_groups: list[dict[str, Any]], extra: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The groups with parameter indices as ``torch.optim.Optimizer.state_dict`` numbers them; ``extra``
    fills keys a group lacks."""
    index: dict[int, int] = {}
    start, out = 0, []
    for group in param_groups:
        saved = {k: v for k, v in group.items() if k != "params"}
        for k, v in extra.items():
            saved.setdefault(k, v)
        index.update({id(p): i for i, p in enumerate(group["params"], start) if id(p) not in index})
        saved["params"] = [index[id(p)] for p in group["params"]]
        start += len(group["params"])
        out.append(saved)
    return out


def sharded(opt: "ShardedFusedAdam") -> dict[str, Any]:
    """This rank's shard of the state (copies) and the metadata that checks a reload; the whole state in
    AdamW's layout where this rank holds all of it (``whole``)."""
    pipeline = opt.pipeline
    if pipeline.num_shards == 1:
        return whole(opt)
    return {
        "state": {**dict(enumerate(zstate.shard_state(pipeline))), **opt.state.extra},
        "param_groups": groups_for_save(opt.param_groups, {}),
        FORMAT: {
            "layout": zstate.layout_signature(pipeline),
            "shard": pipeline.shard_rank,
            "steps": dict(pipeline.steps),
            "loss_scaler": None if opt.loss_scaler is None else opt.loss_scaler.state_dict(),
            "skipped_steps": opt.skipped_steps,
            "dequantized": dequantized_groups(pipeline),
            "shapes": [tuple(pipeline.param_shape(p)) for g in opt.param_groups for p in g["params"]],
        },
    }


def dequantized_groups(pipeline: Any) -> list[int]:
    """qwZ: the param groups whose other ranks' parameter parts a step's int8 all-gather wrote (dequantized)."""
    return sorted({buf.group for buf in pipeline.buffers if buf.dequantized})


def whole(opt: "ShardedFusedAdam") -> dict[str, Any]:
    """The state of a rank that holds all of it, in AdamW's layout (no communication): each entry also
    holds ``master`` for bf16/fp16 parameters; the loss scale and ``skipped_steps`` ride under ``FORMAT``."""
    return with_whole_meta(opt, zstate.gather_full_state(opt.pipeline))


def with_whole_meta(opt: "ShardedFusedAdam", state: dict[Any, Any]) -> dict[str, Any]:
    """``state`` (whole, by parameter index) in AdamW's layout, with the loss scale, ``skipped_steps`` and
    ``dequantized`` under ``FORMAT`` (which ``torch.optim.AdamW`` ignores)."""
    pipeline = opt.pipeline
    return {
        "state": {**state, **opt.state.extra},
        "param_groups": full_groups(opt),
        FORMAT: {
            "whole": True,
            "loss_scaler": None if opt.loss_scaler is None else opt.loss_scaler.state_dict(),
            "skipped_steps": opt.skipped_steps,
            "dequantized": dequantized_groups(pipeline),
            "shapes": [tuple(pipeline.param_shape(p)) for g in opt.param_groups for p in g["params"]],
        },
    }


def full_groups(opt: "ShardedFusedAdam") -> list[dict[str, Any]]:
    """The param groups as ``torch.optim.AdamW`` saves them (every AdamW key present)."""
    groups = groups_for_save(opt.param_groups, _ADAMW_GROUP_KEYS)
    for group in groups:
        group["decoupled_weight_decay"] = opt.adam_w_mode
    return groups


def full(opt: "ShardedFusedAdam") -> dict[str, Any]:
    """The whole state in AdamW's layout, as ``whole`` (a collective: every rank calls it)."""
    return whole(opt)


# ---------------------------------------------------------------- loading
def _is_index(key: Any) -> bool:
    return isinstance(key, int) and not isinstance(key, bool)


def _by_parameter(
    opt: "ShardedFusedAdam", state: Mapping[Any, Any], saved_groups: list[dict[str, Any]]
) -> tuple[dict[int, Any], dict[Any, Any]]:
    """The entries of an AdamW-layout ``state`` by this optimizer's parameter index, and its other keys: as
    torch maps them, a key is the parameter at its place in the saved groups' ``params`` (any hashable id,
    such as the FQNs ``torch.distributed.checkpoint`` puts there); an int key listed nowhere is an error."""
    here = [i for group in groups_for_save(opt.param_groups, {}) for i in group["params"]]
    place = dict(zip((k for group in saved_groups for k in group["params"]), here))
    unlisted = [k for k in state if _is_index(k) and k not in place]
    if unlisted:
        raise ValueError(f"load_state_dict: state[{unlisted[0]!r}] is in no param group's 'params' of the state")
    entries = {place[k]: v for k, v in state.items() if k in place}
    return entries, {k: v for k, v in state.items() if k not in place}


def load(opt: "ShardedFusedAdam", state_dict: Mapping[str, Any]) -> None:
    """Check ``state_dict`` against ``opt`` (nothing changes on an error), then load it."""
    meta = state_dict.get(FORMAT)
    is_sharded = meta is not None and not meta.get("whole")
    saved_groups = _check_groups(opt, state_dict)
    skipped = _skipped_steps(meta)
    dequantized = _dequantized(meta, len(opt.param_groups))
    state = state_dict["state"]
    if is_sharded:
        _check_sharded(opt, state_dict[FORMAT])
        steps = _sharded_steps(meta)  # checked before anything changes
        count = len(opt.pipeline.buffers)
        missing = [i for i in range(count) if i not in state]
        if missing:
            raise ValueError(
                f"load_state_dict: the sharded state lacks buffer {missing[0]} (of {count}): its 'state' is keyed "
                "by flat-buffer index, as state_dict() saved it, not by parameter ids or names"
            )
        entries = {i: state[i] for i in range(count)}
        extra = {k: v for k, v in state.items() if k not in entries}
    else:
        entries, extra = _by_parameter(opt, state, saved_groups)
        entries = _check_full(opt, entries)
    zstate.warn_other_decay_mode(saved_groups, opt.adam_w_mode, "load_state_dict")
    for group, saved in zip(opt.param_groups, saved_groups):
        _adopt(group, saved)
    pipeline = opt.pipeline
    if is_sharded:
        zstate.load_shard_state(pipeline, [entries[i] for i in range(len(entries))])
        pipeline.steps.update(steps)
    else:
        zstate.scatter_full_state(pipeline, entries)
        _load_masters(pipeline, entries)
    if opt.loss_scaler is not None and meta is not None and meta.get("loss_scaler") is not None:
        opt.loss_scaler.load_state_dict(meta["loss_scaler"])
    if skipped is not None:
        opt.skipped_steps = skipped
    if dequantized is not None:
        pipeline.requantize_loaded(dequantized)
    opt.state.extra = dict(extra)


def _skipped_steps(meta: Optional[Mapping[str, Any]]) -> Optional[int]:
    """The saved ``skipped_steps`` (None where the state has none: a state dict of before the field, or AdamW's)."""
    value = None if meta is None else meta.get("skipped_steps")
    if value is None:
        return None
    return step_count(value, f"load_state_dict: state_dict[{FORMAT!r}]['skipped_steps']")


def _dequantized(meta: Optional[Mapping[str, Any]], groups: int) -> Optional[list[int]]:
    """The saved ``dequantized`` param groups (None where the state has none: a state dict of before the field, or
    AdamW's), each a group index (``ValueError`` naming the entry otherwise)."""
    value = None if meta is None else meta.get("dequantized")
    if value is None:
        return None
    where = f"load_state_dict: state_dict[{FORMAT!r}]['dequantized']"
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{where} must be a list of param group indices, got {value!r}")
    indices = [step_count(g, f"{where}[{i}]") for i, g in enumerate(value)]
    beyond = [g for g in indices if g >= groups]
    if beyond:
        raise ValueError(f"{where} names param group {beyond[0]}, of {groups}")
    return indices


def step_count(value: Any, what: str) -> int:
    """``value`` as a count of steps: an integer >= 0 (a Python, NumPy or one-element integer tensor's; not a bool),
    else ``ValueError`` naming ``what``."""
    try:
        count = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        count = None
    if count is None or count < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {value!r}")
    return count


def _sharded_steps(meta: Mapping[str, Any]) -> dict[int, int]:
    """A sharded state's step counts by parameter index, each an integer >= 0 (``ValueError`` naming the entry)."""
    where = f"load_state_dict: state_dict[{FORMAT!r}]['steps']"
    steps = {}
    for key, value in meta["steps"].items():
        index = int(key) if isinstance(key, str) and key.isdigit() else step_count(key, f"{where}: key {key!r}")
        steps[index] = step_count(value, f"{where}[{key!r}]")
    return steps


def _check_step(value: Any, what: str) -> None:
    """A saved AdamW step (a one-element tensor, or a number in older state dicts) is a whole number >= 0: the
    shards count steps in integers, so a fractional, negative or non-finite one is refused before anything loads."""
    try:
        step = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{what} must be a number or a one-element tensor, got {value!r}") from None
    if not (math.isfinite(step) and step >= 0 and step.is_integer()):
        raise ValueError(f"{what} is {step}: a step count is a whole number >= 0; nothing was loaded")


def _load_masters(pipeline: Any, entries: Mapping[int, Any]) -> None:
    """The fp32 masters a ``whole`` state carries, into this rank's part of the master shards: the optimizer's own
    write (``stages.master``), so a master that does not round to its parameter (an older state loaded) gives way to
    the parameter, as at every world size; unrecorded, it was taken for a write from outside and put the weights
    back to the state's."""
    for piece in zstate.load_pieces(pipeline):
        entry = entries.get(piece.index)
        if "master" in piece.state and entry is not None and "master" in entry:
            piece.state["master"].copy_(entry["master"].reshape(-1).narrow(0, piece.start, piece.numel))
    master.record_all(pipeline)


def _adopt(group: dict[str, Any], saved: dict[str, Any]) -> None:
    """``group`` becomes the saved one, as torch's load does (absent flags: AdamW's defaults), keeping its
    parameters, its implementation flags and, when the saved group has none, its ``param_names``."""
    new = {k: v for k, v in saved.items() if k != "params" and k not in KEEP_OWN}
    for key, default in ALGORITHM_FLAGS.items():
        new.setdefault(key, default)
    new.update({k: group[k] for k in (*KEEP_OWN, "params") if k in group})
    if "param_names" in group and "param_names" not in new:
        new["param_names"] = group["param_names"]
    group.clear()
    group.update(new)


def _check_groups(opt: "ShardedFusedAdam", state_dict: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Group count and sizes as here; returns a deep copy of the saved groups (as torch does)."""
    saved = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    if not isinstance(saved, list) or "state" not in state_dict:
        raise ValueError("load_state_dict: expected a dict with 'state' and 'param_groups'")
    if len(saved) != len(opt.param_groups):
        raise ValueError(
            f"load_state_dict: the state has {len(saved)} param groups, this optimizer {len(opt.param_groups)}"
        )
    for g, (mine, theirs) in enumerate(zip(opt.param_groups, saved)):
        if len(mine["params"]) != len(theirs["params"]):
            raise ValueError(
                f"load_state_dict: param group {g} has {len(theirs['params'])} parameters in the state "
                f"but {len(mine['params'])} here"
            )
        missing = [k for k in _HYPER if k not in theirs]
        if missing:
            raise ValueError(f"load_state_dict: param group {g} of the state lacks {', '.join(missing)}")
        check_flags({k: v for k, v in theirs.items() if k in ALGORITHM_FLAGS}, f"load_state_dict: param group {g}")
    return copy.deepcopy(saved)


def _check_shapes(opt: "ShardedFusedAdam", shapes: Mapping[int, tuple]) -> None:
    here = [tuple(opt.pipeline.param_shape(p)) for g in opt.param_groups for p in g["params"]]
    for index in sorted(shapes):
        if not 0 <= index < len(here) or here[index] != tuple(shapes[index]):
            mine = here[index] if 0 <= index < len(here) else "no such parameter"
            raise ValueError(
                f"load_state_dict: {opt._param_name(index)} has shape {tuple(shapes[index])} in the state "
                f"but {mine} here: the state comes from another model"
            )


def _check_full(opt: "ShardedFusedAdam", entries: Mapping[int, Any]) -> dict[int, Any]:
    """``entries`` checked (AdamW's layout, the parameters' shapes), less those of parameters frozen here: they have
    no place in the buffers and no step would use them (``torch.optim.AdamW`` keeps them unused); said once."""
    trainable = {i for buf in opt.pipeline.buffers for i in buf.indices}
    shapes = {}
    for key, entry in entries.items():
        missing = [k for k in ("step", "exp_avg", "exp_avg_sq") if k not in entry]
        if missing:
            raise ValueError(
                f"load_state_dict: state[{key!r}] lacks {', '.join(missing)} (AdamW layout expected). "
                + (_LOST_FORMAT if missing == ["step"] else "")
            )
        for name in ("exp_avg_sq", "max_exp_avg_sq", "master"):
            if name in entry and tuple(entry[name].shape) != tuple(entry["exp_avg"].shape):
                raise ValueError(f"load_state_dict: state[{key!r}]['{name}'] is not shaped like its exp_avg")
        _check_step(entry["step"], f"load_state_dict: state[{key!r}]['step'] ({opt._param_name(key)})")
        shapes[key] = tuple(entry["exp_avg"].shape)
    _check_shapes(opt, shapes)
    frozen = sorted(set(shapes) - trainable)
    if frozen:
        log.warning(
            "load_state_dict: the state of %d parameter(s) frozen here (requires_grad=False when the optimizer was "
            "built), first %s, is not loaded: no step uses it while frozen, and the state dicts and checkpoints saved "
            "from here do not hold it, so a run that unfreezes it later starts its Adam moments from zero "
            "(torch.optim.AdamW keeps them)",
            len(frozen),
            opt._param_name(frozen[0]),
        )
    return {i: entry for i, entry in entries.items() if i not in frozen}


def _check_sharded(opt: "ShardedFusedAdam", meta: Mapping[str, Any]) -> None:
    _check_shapes(opt, dict(enumerate(meta["shapes"])))
    saved_by, here = meta.get("shard", opt.pipeline.shard_rank), opt.pipeline.shard_rank
    if saved_by != here:  # a state dict of before the field has none: it cannot be checked
        raise ValueError(
            f"load_state_dict: this sharded state is rank {saved_by}'s shard, and this is rank {here}: each rank "
            "loads the state_dict() it saved itself (a file written by one rank for all, as accelerate's "
            "save_state writes the optimizer, holds one rank's shard); for a file one rank writes, as nanoGPT's "
            "'if master_process' and torchvision's save_on_master do, call opt.consolidate_state_dict(to=0) on every "
            "rank before it and save rank 0's state_dict() (the whole state, which loads on every rank), or "
            "full_state_dict() taken on every rank (both are collectives: on rank 0 alone they wait for the other "
            "ranks forever); or use zero_kernels.checkpoint"
        )
    if len(meta["shapes"]) != sum(len(g["params"]) for g in opt.param_groups):
        raise ValueError("load_state_dict: the state holds a different number of parameters")
    here = zstate.layout_signature(opt.pipeline)
    if meta["layout"] != here:
        stage, world, saved = meta["layout"]
        settings = f"reduce_bucket_size {opt.options.reduce_bucket_size}"
        if opt.pipeline.stage == 3:
            settings += f", stage3_param_persistence_threshold {opt.options.stage3_param_persistence_threshold}"
        raise ValueError(
            f"load_state_dict: this sharded state was saved by stage {stage} on {plural(world, 'rank')} with another "
            f"layout: {_layout_difference(saved, here[2], stage == 3)} (here: stage {opt.pipeline.stage}, "
            f"{plural(opt.pipeline.world_size, 'rank')}, {settings}); use full_state_dict() to change them"
        )


def _layout_difference(saved: list[Any], here: list[Any], stage3: bool) -> str:
    """The first difference between two ``layout_signature`` buffer lists, in words, with the setting behind it."""
    persistence = "stage3_param_persistence_threshold decides which parameters are sharded"
    if len(saved) != len(here):
        why = f" (at stage 3 one per sharded unit: {persistence})" if stage3 else ""
        return f"it has {plural(len(saved), 'flat buffer')}, this optimizer {len(here)}{why}"
    for i, (theirs, mine) in enumerate(zip(saved, here)):
        (group, dtype, _, buckets, indices), (_, my_dtype, _, my_buckets, my_indices) = theirs, mine
        if dtype != my_dtype:
            return f"flat buffer {i} (param group {group}) holds {dtype} there, {my_dtype} here"
        if indices != my_indices:
            return (
                f"flat buffer {i} (param group {group}) holds parameters {_span(indices)} there, {_span(my_indices)} "
                f"here{f' (at stage 3, {persistence})' if stage3 else ''}"
            )
        if len(buckets) != len(my_buckets):
            return (
                f"flat buffer {i} (param group {group}) is cut into {plural(len(buckets), 'bucket')} there, "
                f"{len(my_buckets)} here (reduce_bucket_size)"
            )
        if buckets != my_buckets:
            return (
                f"flat buffer {i} (param group {group}) has buckets of {_span(buckets)} elements there, "
                f"{_span(my_buckets)} here (each rank's part is padded: the sizes follow the world size and "
                "reduce_bucket_size)"
            )
    return "its flat buffers differ"


def _span(indices: list[int]) -> str:
    return f"{indices}" if len(indices) <= 6 else f"[{', '.join(map(str, indices[:6]))}, ... ({len(indices)} in all)]"
