"""Import a DeepSpeed ZeRO checkpoint (stages 1-3) as a zero_kernels checkpoint.

``from_deepspeed(ds_dir, out_dir)`` reads what ``engine.save_checkpoint(ds_dir)`` wrote::

    DS_DIR/latest                                   the tag of the newest checkpoint ("global_step4")
    DS_DIR/TAG/mp_rank_00_model_states.pt           stages 1-2: module state_dict, param_shapes, scheduler
    DS_DIR/TAG/zero_pp_rank_R_mp_rank_00_model_states.pt     stage 3: the same per rank (empty params)
    DS_DIR/TAG/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   rank R's fp32 partition and Adam state

and writes one new version of a zero_kernels checkpoint under ``out_dir`` (one rank file) with the
fp32 master weights, Adam's ``exp_avg``/``exp_avg_sq``, every parameter's step count, the param
groups' ``lr``/``betas``/``eps``/``weight_decay``, the fp16 loss scale, the scheduler state and the
engine's ``skipped_steps``.
``zero_kernels.checkpoint.load`` then loads it at any world size and stage.

Layouts (as ``deepspeed/utils/zero_to_fp32.py`` reads them). Stages 1-2: param group ``g`` is
one flat fp32 vector cut into equal partitions, rank ``R`` holding partition ``R``; the group's
parameters lie back to back in ``param_shapes[g]`` order (plus ``param_alignment_paddings``), and
the base optimizer's state ``g`` has the same layout. Stage 3: every parameter is cut into
``ceil(numel / world)`` elements per rank, each rank's pieces back to back over its sub-groups'
flat vectors (``fp32_flat_groups``), whose optimizer state has the same layout. Low-precision
(bf16/fp16) runs store the module's weights in that dtype and keep the fp32 master here: the
import keeps both (an fp32 model then loads the master copy).

Safe loading. Every file is read with ``torch.load(weights_only=True)``. DeepSpeed's pickles hold
four objects that are not tensors or containers, so exactly these names are allowed, each mapped
to an inert stand-in class defined here (no DeepSpeed code is imported or run): ``ZeroStageEnum``
(the stage, an int), ``LossScaler`` and ``DynamicLossScaler`` (the loss-scale state, their
attributes only), and ``fragment_address`` (two ints per parameter slice). Anything else in a
file (a user's ``client_state`` object, for example) is refused with the name of the global.

Frozen parameters (``requires_grad=False``: a LoRA base) are not in DeepSpeed's optimizer state: their
values come from the model states files' ``frozen_param_fragments`` (whole at stages 1-2, each rank's
partition at stage 3) and are written as model tensors, as a zero_kernels checkpoint holds them.

Not supported (each a clear ``CheckpointError``): model or pipeline parallel checkpoints
(``mp_rank`` other than 00), DeepSpeed's universal and offloaded (NVMe) formats, and stage 1-2 checkpoints
saved with ``elastic_checkpoint`` (which DeepSpeed 0.19.8 itself cannot load).
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..wording import plural
from . import objects
from .format import (
    BLOCK_BYTES,
    FORMAT,
    LATEST,
    METADATA,
    OBJECTS,
    TMP_PREFIX,
    VERSION,
    BlockWriter,
    CheckpointError,
    PathLike,
    dtype_name,
    next_version,
    publish,
    rank_file,
    write_small,
)

__all__ = ["from_deepspeed"]

logger = logging.getLogger("zero_kernels")

_HYPER = ("lr", "betas", "eps", "weight_decay")
STAGE12_MODEL_FILE = "mp_rank_00_model_states.pt"  # stages 0-2: the one model states file (stage 3: one per rank)


class _Stage(int):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum``: the stage as an int."""


class _Attributes:
    """Stand-in for a DeepSpeed object pickled with its ``__dict__``: keeps the attributes, runs nothing."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"{type(self).__name__}: unexpected pickled state {type(state).__name__}")
        self.__dict__.update(state)


class _LossScaler(_Attributes):
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (static scale)."""


class _DynamicLossScaler(_Attributes):
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``."""


class _FragmentAddress(_Attributes):
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address`` (numel, start)."""


SAFE_GLOBALS = [
    (_Stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def _load(path: Path) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` with DeepSpeed's four globals mapped to stand-ins."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL (\S+)", str(err))
        what = f"global {found.group(1)}" if found else type(err).__name__
        raise CheckpointError(
            f"DeepSpeed checkpoint file {path} holds an object that is not safe to load ({what}); "
            "only tensors, containers and DeepSpeed's stage, loss-scaler and fragment records are read"
        ) from None
    except (OSError, RuntimeError, EOFError) as err:
        raise CheckpointError(f"DeepSpeed checkpoint file {path} cannot be read ({type(err).__name__}: {err})") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"DeepSpeed checkpoint file {path} holds a {type(data).__name__}, expected a dict")
    return data


# ---------------------------------------------------------------- finding the files
def _tag_folder(ds_dir: Path, tag: Optional[str]) -> Path:
    if not ds_dir.is_dir():
        raise CheckpointError(f"DeepSpeed checkpoint directory {ds_dir} does not exist or is not a directory")
    if tag is None:
        if not (ds_dir / LATEST).is_file():
            raise CheckpointError(f"{ds_dir} has no 'latest' file: pass the checkpoint's tag (--tag global_stepN)")
        tag = (ds_dir / LATEST).read_text().strip()
    folder = ds_dir / tag
    if not folder.is_dir():
        tags = sorted(p.name for p in ds_dir.iterdir() if p.is_dir())
        raise CheckpointError(f"{ds_dir} has no checkpoint tag {tag!r}; tags there: {', '.join(tags) or 'none'}")
    return folder


def _by_rank(folder: Path, pattern: str, what: str, count: Optional[int] = None) -> list[Path]:
    """Files of ``folder`` matching ``pattern`` (a regex with one rank group), in rank order 0..N-1 (N: ``count``
    when the ranks are known, else as many as found)."""
    found = {}
    for path in folder.iterdir():
        match = re.fullmatch(pattern, path.name)
        if match:
            found[int(match.group(1))] = path
    count = len(found) if count is None else count
    if not found or sorted(found) != list(range(count)):
        ranks = f"0..{count - 1}" if count else "0..N-1"
        raise CheckpointError(f"{folder} lacks {what} files for ranks {ranks} (found ranks {sorted(found)})")
    return [found[r] for r in range(count)]


def _refuse_stage0(folder: Path, optim_pattern: str) -> None:
    """DeepSpeed's stage 0 keeps the whole optimizer inside the model states file and writes no ZeRO optimizer
    state files: say so, not which ranks' files are missing."""
    model_file = folder / STAGE12_MODEL_FILE
    if model_file.is_file() and not any(re.fullmatch(optim_pattern, p.name) for p in folder.iterdir()):
        raise CheckpointError(
            f"{folder} holds {model_file.name} and no ZeRO optimizer state files (zero_pp_rank_N_mp_rank_00_"
            "optim_states.pt): a ZeRO stage 0 checkpoint, which cannot be imported (stages 1, 2 and 3 can). Its "
            "weights are the 'module' entry of that file: load them into the model and start a new optimizer"
        )


def _check_single_model_parallel_rank(folder: Path) -> None:
    others = sorted(p.name for p in folder.iterdir() if re.search(r"mp_rank_(?!00_)\d+", p.name))
    if others:
        raise CheckpointError(
            f"{folder} holds model-parallel ranks ({others[0]}, ...): only data-parallel ZeRO checkpoints "
            "(mp_rank_00 alone) can be imported"
        )


# ---------------------------------------------------------------- reassembling parameters
@dataclass
class _Param:
    name: str
    group: int
    shape: torch.Size
    values: dict[str, torch.Tensor]  # master, exp_avg, exp_avg_sq (flat fp32)
    step: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _params(model_state: dict[str, Any]) -> list[_Param]:
    shapes = model_state.get("param_shapes")
    if not isinstance(shapes, list):
        raise CheckpointError("the DeepSpeed model states lack 'param_shapes': not a ZeRO checkpoint")
    return [_Param(name, g, torch.Size(shape), {}) for g, group in enumerate(shapes) for name, shape in group.items()]


def _kinds(state: dict[int, dict[str, Any]], flats: list[torch.Tensor], what: str) -> list[dict[str, torch.Tensor]]:
    """Per flat group: its master vector and its Adam moments (same layout). A group with no state never stepped
    (every step before the save skipped on an fp16 overflow): zero moments at step 0, as Adam starts them."""
    out = []
    for i, master in enumerate(flats):
        entry = state.get(i) or {"exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master)}
        if not isinstance(entry, dict) or "exp_avg" not in entry or "exp_avg_sq" not in entry:
            raise CheckpointError(f"{what}: optimizer state {i} lacks exp_avg/exp_avg_sq (is this an Adam checkpoint?)")
        master = master.reshape(-1)
        kinds = {"master": master}
        for kind in ("exp_avg", "exp_avg_sq"):
            t = entry[kind].reshape(-1)
            # The last rank's fp32 partition leaves out the group's padding; its Adam state keeps it.
            if t.numel() < master.numel():
                raise CheckpointError(f"{what}: {kind} of flat group {i} has {t.numel()} elements, < {master.numel()}")
            kinds[kind] = t[: master.numel()]
        kinds["step"] = entry.get("step", 0)
        out.append(kinds)
    return out


def _assemble_stage12(params: list[_Param], optims: list[dict[str, Any]]) -> None:
    """Stages 1-2: concatenate each group's partitions over ranks, then cut it into parameters."""
    if not all(isinstance(o.get("base_optimizer_state"), dict) for o in optims):
        raise CheckpointError(
            "stage 1/2: the optimizer state is not a torch optimizer's state_dict (a list per param group: saved with "
            "zero_optimization.elastic_checkpoint, which cannot be imported; DeepSpeed 0.19.8 cannot load it either)"
        )
    ranks = [
        _kinds(o["base_optimizer_state"]["state"], o["single_partition_of_fp32_groups"], "stage 1/2") for o in optims
    ]
    paddings = optims[0].get("param_alignment_paddings")
    for g in range(len(ranks[0])):
        full = {k: torch.cat([r[g][k].reshape(-1) for r in ranks]) for k in ("master", "exp_avg", "exp_avg_sq")}
        offset = 0
        members = [p for p in params if p.group == g]
        for i, p in enumerate(members):
            if offset + p.numel > full["master"].numel():
                raise CheckpointError(f"param group {g}: {p.name!r} lies past the end of the saved partitions")
            p.values = {k: v.narrow(0, offset, p.numel).float().clone() for k, v in full.items()}
            p.step = int(ranks[0][g]["step"])
            offset += p.numel + (paddings[g][i] if paddings else 0)


def _assemble_stage3(params: list[_Param], optims: list[dict[str, Any]]) -> None:
    """Stage 3: each parameter is ``ceil(numel / world)`` elements per rank, back to back over sub-groups."""
    world = len(optims)
    ranks = [_kinds(o["optimizer_state_dict"]["state"], o["fp32_flat_groups"], "stage 3") for o in optims]
    flat = [{k: torch.cat([g[k].reshape(-1) for g in r]) for k in ("master", "exp_avg", "exp_avg_sq")} for r in ranks]
    ends = torch.tensor([g["master"].numel() for g in ranks[0]]).cumsum(0).tolist()
    offset = 0
    for p in params:
        part = -(-p.numel // world)
        if offset + part > flat[0]["master"].numel():
            raise CheckpointError(f"stage 3: {p.name!r} lies past the end of the saved partitions")
        p.values = {
            k: torch.cat([f[k].narrow(0, offset, part) for f in flat])[: p.numel].float().clone() for k in flat[0]
        }
        sub = next(i for i, end in enumerate(ends) if offset < end)
        p.step = int(ranks[0][sub]["step"])
        offset += part


def _stage3_param_groups(params: list[_Param], optims: list[dict[str, Any]]) -> None:
    """Stage 3's ``param_shapes`` has one entry per sub-group (a param group of more than ``sub_group_size``
    elements is several, 1e9 by default): give each parameter the param group of its sub-group, the saved torch
    param group whose ``"params"`` lists that sub-group's state index. Equal counts do not make the sub-group the
    param group: a param group whose parameters are all frozen has no sub-group (DeepSpeed saves it with no
    ``"params"``), so one of the others may have two."""
    saved = optims[0]["optimizer_state_dict"]["param_groups"]
    subs = max(p.group for p in params) + 1
    owner = {}
    for index, group in enumerate(saved):
        for sub in group.get("params") or []:
            owner.setdefault(int(sub), index)
    missing = [sub for sub in range(subs) if sub not in owner]
    if missing:
        raise CheckpointError(
            f"stage 3: {plural(subs, 'sub-group')} but {plural(len(saved), 'saved param group')}, none of which "
            f"lists sub-group {missing[0]}"
        )
    for p in params:
        p.group = owner[p.group]


def _frozen(model_state: dict[str, Any], stage: int, files: list[Path]) -> dict[str, torch.Tensor]:
    """The frozen parameters' values by name (DeepSpeed saves them apart from the optimizer's): stages 1-2 keep
    each whole in ``frozen_param_fragments``; stage 3 keeps each rank's ``ceil(numel / world)`` elements there,
    in every rank's model states file (``files``, rank order), the last rank's padded."""
    shapes = model_state.get("frozen_param_shapes") or {}
    if not shapes:
        return {}
    states = [model_state] + [_load(path) for path in files[1:]] if stage == 3 else [model_state]
    values = {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        fragments = [(state.get("frozen_param_fragments") or {}).get(name) for state in states]
        if any(not isinstance(t, torch.Tensor) for t in fragments):
            raise CheckpointError(f"the DeepSpeed model states lack the fragments of frozen parameter {name!r}")
        flat = torch.cat([t.reshape(-1) for t in fragments])
        if flat.numel() < numel:
            raise CheckpointError(f"frozen parameter {name!r}: {flat.numel()} saved elements for shape {list(shape)}")
        values[name] = flat[:numel].clone().view(tuple(shape))
    return values


# ---------------------------------------------------------------- metadata
def _hyper(optims: list[dict[str, Any]], stage: int) -> list[dict[str, Any]]:
    """lr/betas/eps/weight_decay of every DeepSpeed param group (each parameter's ``group`` indexes the saved param
    groups: at stage 3 once ``_stage3_param_groups`` has mapped its sub-group to its param group)."""
    inner = optims[0]["optimizer_state_dict"] if stage == 3 else optims[0]["base_optimizer_state"]
    out = []
    for g, group in enumerate(inner["param_groups"]):  # every one: a group of frozen parameters trains none
        if group.get("amsgrad"):
            raise CheckpointError(f"param group {g} uses amsgrad, which zero_kernels does not support")
        out.append({k: list(group[k]) if k == "betas" else float(group[k]) for k in _HYPER})
    return out


def _loss_scaler(optim: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The fp16 dynamic loss scale as ``precision.LossScaler`` state (None: no dynamic scaling).

    The scale, the hysteresis left and the good steps since the last overflow (DeepSpeed's
    ``cur_iter - last_overflow_iter - 1``) carry over exactly: the resumed run scales as DeepSpeed's would.
    """
    scaler = optim.get("loss_scaler")
    if not isinstance(scaler, _DynamicLossScaler):
        return None
    s = scaler.__dict__
    good = max(0, int(s.get("cur_iter", 0)) - int(s.get("last_overflow_iter", -1)) - 1)
    return {"scale": float(s["cur_scale"]), "good_steps": good, "hysteresis_left": int(s.get("cur_hysteresis", 1))}


def _skipped_steps(model_state: dict[str, Any], path: Path) -> dict[str, int]:
    """DeepSpeed's ``skipped_steps`` (the engine's count of fp16 overflow skips) as the metadata's field; none
    where the file has none."""
    if "skipped_steps" not in model_state:
        return {}
    value = model_state["skipped_steps"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{path}: skipped_steps must be an integer >= 0, not {value!r}")
    return {"skipped_steps": value}


def _scheduler_state(state: Any) -> Optional[dict[str, Any]]:
    """The scheduler's state when a checkpoint can keep it (DeepSpeed's own: ``{"last_batch_iteration": n}``)."""
    try:
        objects.encode(state, "the DeepSpeed checkpoint's lr_scheduler state")
    except CheckpointError as err:
        logger.warning("%s; it is not imported", err)
        return None
    return state if isinstance(state, dict) else None


def _adam_w_mode(model_state: dict[str, Any]) -> bool:
    opt = (model_state.get("ds_config") or {}).get("optimizer") or {}
    params = opt.get("params") or {}
    return str(opt.get("type", "AdamW")).lower() == "adamw" or bool(params.get("adam_w_mode", True))


def _model_tensors(
    module: dict[str, torch.Tensor], params: list[_Param], shared: dict[str, str]
) -> tuple[dict[str, torch.Tensor], dict[str, bool]]:
    """Model state_dict key -> value (parameters in the module's dtype) and whether it has an fp32 master."""
    by_name = {p.name: p for p in params}
    tensors, low = {}, {}
    for key, value in module.items():
        if key in shared:
            continue
        if key in by_name:
            p = by_name[key]
            dtype = value.dtype
            saved = value if value.numel() == p.numel else p.values["master"].to(dtype)
            tensors[key] = p.values["master"].view(p.shape) if dtype == torch.float32 else saved.view(p.shape)
            low[key] = dtype != torch.float32
        else:
            tensors[key] = value
    missing = [p.name for p in params if p.name not in tensors]
    if missing:
        raise CheckpointError(f"the DeepSpeed module state lacks parameter {missing[0]!r}")
    return tensors, low


# ---------------------------------------------------------------- writing
def _write(root: Path, meta: dict[str, Any], pieces: list[tuple[str, torch.Tensor]], book: dict[str, Any]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    version = next_version(root)
    folder = root / (TMP_PREFIX + version)
    folder.mkdir()
    data = objects.dumps(book, "the imported objects")
    write_small(folder / OBJECTS, data)
    meta["objects"] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    final = folder / rank_file(0)
    tmp = final.with_name(final.name + ".tmp")
    with open(tmp, "wb") as f:
        writer = BlockWriter(f, BLOCK_BYTES)
        for key, t in pieces:
            flat = t.detach().contiguous().reshape(-1)
            meta["tensors"][key] = {
                "shape": list(t.shape),
                "dtype": dtype_name(t.dtype),
                "pieces": [[0, 0, writer.size, flat.numel()]],
            }
            writer.write_tensor(flat)
        crcs = writer.finish()
        f.flush()
        os.fsync(f.fileno())
    publish(tmp, final)
    meta["files"] = [{"name": final.name, "bytes": writer.size, "crc32": crcs}]
    write_small(folder / METADATA, json.dumps(meta).encode())
    publish(folder, root / version)
    write_small(root / LATEST, version.encode())
    return root / version


def _optimizer_states(folder: Path) -> tuple[list[dict[str, Any]], int]:
    """The ZeRO optimizer state of every rank in ``folder``, checked (one file per rank that saved it), and the
    ZeRO stage they were saved at."""
    optim_pattern = r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt"
    _refuse_stage0(folder, optim_pattern)
    optim_files = _by_rank(folder, optim_pattern, "optimizer state")
    optims = [_load(path).get("optimizer_state_dict") for path in optim_files]
    if not all(isinstance(o, dict) and "zero_stage" in o for o in optims):
        raise CheckpointError(f"{folder}: the optimizer state files are not DeepSpeed ZeRO optimizer states")
    stage = int(optims[0]["zero_stage"])
    count = optims[0].get("partition_count")
    count = max(count) if isinstance(count, (list, tuple)) else count
    if count != len(optims):
        raise CheckpointError(
            f"{folder}: the checkpoint was saved by {plural(count, 'rank')} but holds optimizer state files for "
            f"{len(optims)}"
        )
    return optims, stage


def _model_files(folder: Path, stage: int, ranks: int) -> list[Path]:
    """The model state files of a stage-``stage`` checkpoint saved by ``ranks`` ranks (stage 3: one per rank, else
    one), the first of them checked to be there."""
    if stage == 3:
        files = _by_rank(folder, r"zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt", "stage 3 model state", count=ranks)
    elif stage in (1, 2):
        files = [folder / STAGE12_MODEL_FILE]
    else:
        raise CheckpointError(f"{folder}: ZeRO stage {stage} checkpoints cannot be imported; stages 1, 2 and 3 can")
    if not files[0].is_file():
        raise CheckpointError(f"{folder} lacks {files[0].name}")
    return files


def from_deepspeed(ds_dir: PathLike, out_dir: PathLike, *, tag: Optional[str] = None) -> Path:
    """Convert a DeepSpeed ZeRO stage 1/2/3 checkpoint into a new version of a zero_kernels checkpoint.

    Args:
        ds_dir: the directory given to DeepSpeed's ``engine.save_checkpoint``.
        out_dir: the zero_kernels checkpoint root to write (created if needed; earlier versions kept).
        tag: the DeepSpeed tag (``global_step100``); None: the one named by ``ds_dir/latest``.

    Returns:
        the new version directory; ``zero_kernels.checkpoint.load(out_dir, model, optimizer)`` loads it
        into an optimizer whose param groups hold the same parameters as DeepSpeed's, at any world
        size and stage (``load(..., scheduler=...)`` also restores a DeepSpeed scheduler's position).
    """
    folder = _tag_folder(Path(ds_dir), tag)
    _check_single_model_parallel_rank(folder)
    optims, stage = _optimizer_states(folder)
    model_files = _model_files(folder, stage, len(optims))
    model_file = model_files[0]
    model_state = _load(model_file)
    params = _params(model_state)
    if stage == 3:
        _stage3_param_groups(params, optims)
    (_assemble_stage3 if stage == 3 else _assemble_stage12)(params, optims)
    shared = dict(model_state.get("shared_params") or {})
    tensors, low = _model_tensors(model_state["module"], params, shared)
    tensors.update(_frozen(model_state, stage, model_files))
    pieces = [(f"model/{key}", t) for key, t in tensors.items()]
    for i, p in enumerate(params):
        kinds = ("exp_avg", "exp_avg_sq", "master") if low[p.name] else ("exp_avg", "exp_avg_sq")
        pieces += [(f"optim/{i}/{kind}", p.values[kind].view(p.shape)) for kind in kinds]
    model_keys = {key: f"model/{key}" for key in tensors}
    model_keys.update({alias: f"model/{target}" for alias, target in shared.items()})
    groups = _hyper(optims, stage)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": 1,
        "stage": stage,
        "block_bytes": BLOCK_BYTES,
        "tensors": {},
        "model": model_keys,
        "params": [{"name": p.name, "group": p.group, "trainable": True, "step": p.step} for p in params],
        "param_groups": groups,
        "adam_w_mode": _adam_w_mode(model_state),
        "extra": None,
        **_skipped_steps(model_state, model_file),
        "imported_from": {"deepspeed": str(model_state.get("ds_version")), "tag": folder.name, "ranks": len(optims)},
    }
    book = {
        "param_groups": [{**g, "betas": tuple(g["betas"])} for g in groups],
        "lr_scheduler": _scheduler_state(model_state.get("lr_scheduler")),
        "loss_scaler": _loss_scaler(optims[0]),
        "window": None,
    }
    return _write(Path(out_dir), meta, pieces, book)
