"""Sharded checkpoints: every rank saves only its part; load at any world size and any stage.

Usage (on every rank)::

    zk.checkpoint.save("ckpt", model, optimizer, extra={"epoch": 3}, scheduler=lr_scheduler)
    extra = zk.checkpoint.load("ckpt", model, optimizer, scheduler=lr_scheduler)
    zk.checkpoint.consolidate("ckpt", "model_and_adamw.pt")      # one process, streaming
    zk.checkpoint.from_deepspeed("ds_ckpt", "ckpt")               # a DeepSpeed ZeRO checkpoint, imported

What each rank writes. Rank ``r`` of ``N`` writes one file with, for each flat buffer of the
optimizer, its ``1/N`` part under the stage's layout (stages 1-3) or under the same layout cut
into ``N`` shards (stage 0, whose state is replicated): the parameters' values, Adam ``m`` and
``v``, AMSGrad's ``max_exp_avg_sq`` when the param group has used it, and the fp32 master copy
of low-precision parameters. Frozen parameters are cut into ``N`` even pieces; buffers, which
may differ by rank (BatchNorm's running statistics), are rank 0's, written whole by rank 0 (as
DeepSpeed saves data-parallel rank 0's module); a rank inside a gradient accumulation window adds
the gradients it holds (``checkpoint.accumulation``). So no rank writes, nor holds, more than what
it already holds; rank 0 adds the metadata (with the optimizer's ``skipped_steps``, restored by ``load``)
and the objects file (param groups, scheduler state, loss scale, the window's bookkeeping:
``checkpoint.objects``, lossless).
The directory layout, the crash-safe commit order and the metadata are described in
``checkpoint.format``.

Every rank must see the same directory (a shared file system, as for any multi-node
checkpoint): rank 0 creates the version, every rank writes its file into it. Call ``save`` and
``load`` between steps; ``load`` raises inside ``gathered_params()`` (stage 3), whose end would undo it.

Loading reads, on each rank, only the element ranges its new layout needs (ranged reads of the
rank files, checked block by block against the CRCs in the metadata), into staging tensors; the
ranks agree that every read succeeded before anything is modified. A state an offload tier keeps
between steps (on disk) is not staged: its ranges are read and checked, then read again buffer by
buffer as they are written into it (``state_door.LoadBuffer``); a save likewise reads it one buffer
at a time (``state_door.save_pieces``), so neither holds more of it in host memory than a buffer's.
A read that fails there (the file truncated, removed or written to since the check, an I/O error), or any other
failure once the writes began, stops the load part way on that rank: the ranks agree on it, every rank
raises, and steps, saves and state dicts are refused until a load completes (``_apply_everywhere``).
Tensors are matched by model name, so the optimizer's stage, world size, bucket size and param dtype may all change (not
inside an accumulation window, whose gradients resume only under the same layout).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import json
import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
from torch import nn

from .. import live
from ..comm.agreement import ranks_text
from ..comm.objects import all_gather_objects
from ..stages import Pipeline, adopt, master, state_door
from ..stages.window import Window
from ..wording import plural
from . import accumulation, objects
from .format import (
    BLOCK_BYTES,
    EXTRA,
    FORMAT,
    LATEST,
    METADATA,
    OBJECTS,
    TMP_PREFIX,
    VERSION,
    BlockWriter,
    CheckpointError,
    PathLike,
    SaveLock,
    TensorSource,
    check_byteorder,
    dtype_name,
    next_version,
    publish,
    rank_file,
    remove_unfinished,
    resolve,
    write_small,
)
from .metadata import check_objects, read_metadata, uncompiled

log = logging.getLogger("zero_kernels")


# ---------------------------------------------------------------- what lives where
def _unwrapped(optimizer: Any) -> Any:
    """``optimizer``, or the one a wrapper holds (Accelerate's ``AcceleratedOptimizer``: ``.optimizer``), which
    ``accelerator.prepare`` returns in its place."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(getattr(inner, "pipeline", None), Pipeline) else optimizer


def _pipeline(optimizer: Any) -> Pipeline:
    pipeline = getattr(optimizer, "pipeline", None)
    if not isinstance(pipeline, Pipeline):
        raise TypeError(
            f"checkpoint: expected a zero_kernels ShardedFusedAdam, got {type(optimizer).__name__}. For the model's "
            "weights alone: zk.checkpoint.consolidate(directory, out_path) (python -m zero_kernels consolidate "
            "CKPT_DIR OUT.pt), then model.load_state_dict(torch.load(out_path)['model'])"
        )
    return pipeline


def _model_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(first state_dict key -> tensor, every state_dict key -> its first key): tied tensors are stored once; keys
    as the uncompiled model has them (``metadata.uncompiled``)."""
    first: dict[int, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for compiled_key, t in model.state_dict(keep_vars=True).items():
        key = uncompiled(compiled_key)
        name = first.setdefault(id(t), key)
        tensors.setdefault(name, t)
        aliases[key] = name
    return tensors, aliases


def _names(model: nn.Module, optimizer: Any) -> list[str]:
    """The model name of every optimizer parameter, in optimizer (AdamW state_dict) order."""
    tensors, _ = _model_tensors(model)
    by_id = {id(t): name for name, t in tensors.items()}
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in by_id:
                what = (
                    optimizer._param_name(len(out))
                    if hasattr(optimizer, "_param_name")
                    else f"a parameter of param group {g}"
                )
                shape = tuple(getattr(p, "ds_shape", p.shape))
                raise CheckpointError(
                    f"checkpoint: {what} (shape {shape}), which the optimizer trains, is not in the model's "
                    "state_dict (tied to another or replaced since the optimizer was built, as "
                    "`model.head.weight = model.embed.weight` does, or taken out of the model with its module, as "
                    "`remove_parametrizations` does); checkpoints name every tensor by its model name: tie, replace "
                    "or remove parameters before building the optimizer, or save `optimizer.full_state_dict()` and "
                    "the model's weights (`zk.save_pretrained`) instead"
                )
            out.append(by_id[id(p)])
    return out


# ---------------------------------------------------------------- save
def _buffer_pieces(pipeline: Pipeline, names: list[str]) -> Iterator[tuple[str, int, torch.Tensor]]:
    """(tensor key, first element, source view) of this rank's part of every flat buffer, each view valid until
    the next buffer's (``state_door.save_pieces``: the state a tier keeps read in one buffer at a time)."""
    for piece in state_door.save_pieces(pipeline):
        yield f"model/{names[piece.index]}", piece.start, piece.value
        yield from ((f"optim/{piece.index}/{kind}", piece.start, t) for kind, t in piece.state.items())


def _even_piece(rank: int, world: int, name: str, t: torch.Tensor) -> list[tuple[str, int, torch.Tensor]]:
    """This rank's even ``1/N`` piece of tensor ``t`` (none when it has no elements there)."""
    flat = t.detach().reshape(-1)
    per = -(-flat.numel() // world)
    lo, hi = min(rank * per, flat.numel()), min((rank + 1) * per, flat.numel())
    return [(f"model/{name}", lo, flat.narrow(0, lo, hi - lo))] if hi > lo else []


def _other_pieces(pipeline: Pipeline, tensors: dict[str, torch.Tensor]) -> list[tuple[str, int, torch.Tensor]]:
    """This rank's part of every model tensor the optimizer does not shard: of a frozen parameter (the same on
    every rank) its even ``1/N`` piece, of a buffer, which each rank may hold its own (BatchNorm's running
    statistics), rank 0's whole, as DeepSpeed saves data-parallel rank 0's module; frozen parameters partitioned
    at stage 3 give their values (dequantized with ``zero_quantized_nontrainable_weights``), gathered one unit at
    a time (a collective)."""
    pieces, rank, world = [], pipeline.rank, pipeline.world_size
    stored = pipeline.frozen_partitioned()
    for name, t in tensors.items():
        if id(t) in pipeline.where or id(t) in stored:
            continue
        if isinstance(t, nn.Parameter):
            pieces += _even_piece(rank, world, name, t)
        elif rank == 0:
            pieces += _even_piece(0, 1, name, t)
    names = {id(t): name for name, t in tensors.items()}
    for params in pipeline.gathered_frozen():
        for p in params:
            pieces += [(key, lo, v.clone()) for key, lo, v in _even_piece(rank, world, names[id(p)], p)]
    return pieces


def _write_rank_file(folder: Path, rank: int, pieces: Iterable[tuple[str, int, torch.Tensor]]) -> dict[str, Any]:
    """Write this rank's pieces to its file crash-safely; return the file entry and the piece table."""
    final = folder / rank_file(rank)
    tmp = final.with_name(final.name + ".tmp")
    table = []
    with open(tmp, "wb") as f:
        writer = BlockWriter(f, BLOCK_BYTES)
        for key, start, view in pieces:
            table.append([key, start, writer.size, view.numel()])
            writer.write_tensor(view)
        crcs = writer.finish()
        f.flush()
        os.fsync(f.fileno())
    publish(tmp, final)
    return {"file": {"name": final.name, "bytes": writer.size, "crc32": crcs}, "pieces": table}


def _specs(pipeline: Pipeline, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Shape and dtype of every tensor key (the same on every rank)."""
    specs = {
        f"model/{n}": {"shape": list(pipeline.param_shape(t)), "dtype": dtype_name(t.dtype)} for n, t in tensors.items()
    }
    for index, shape, kinds in state_door.param_states(pipeline):
        for kind in kinds:
            specs[f"optim/{index}/{kind}"] = {"shape": list(shape), "dtype": "float32"}
    return specs


def _json_summary(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's options that JSON keeps as they are, for ``metadata.json`` (``inspect``, ``consolidate``
    of version 1); the exact ones go to ``objects.pt``."""
    out = {}
    for key, value in group.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[key] = list(value) if isinstance(value, tuple) else value
    return out


_LABELS = {
    "param_groups": "param_groups",
    "lr_scheduler": "the scheduler's state_dict()",
    "lr_scheduler_class": "the scheduler's class name",
    "loss_scaler": "loss scale",
}


def _hyper_groups(optimizer: Any) -> list[dict[str, Any]]:
    """Copies of ``optimizer``'s param groups without their parameters."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _book(optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """What ``objects.pt`` holds besides the accumulation window (``accumulation.book``)."""
    scaler = getattr(optimizer, "loss_scaler", None)
    return {
        "param_groups": _hyper_groups(optimizer),
        "lr_scheduler": None if scheduler is None else scheduler.state_dict(),
        "lr_scheduler_class": None if scheduler is None else type(scheduler).__name__,
        "loss_scaler": None if scaler is None else scaler.state_dict(),
    }


def _metadata(
    model: nn.Module, optimizer: Any, pipeline: Pipeline, results: list[dict], files: dict[str, Optional[dict]]
) -> dict:
    tensors, aliases = _model_tensors(model)
    names = _names(model, optimizer)
    specs = _specs(pipeline, tensors)
    for result in results:
        specs.update(result["specs"])
    for spec in specs.values():
        spec["pieces"] = []
    for file, result in enumerate(results):
        for key, start, offset, numel in result["pieces"]:
            specs[key]["pieces"].append([file, start, offset, numel])
    trainable = state_door.trained_indices(pipeline)
    groups = []
    params = []
    for g, group in enumerate(optimizer.param_groups):
        groups.append(_json_summary({k: v for k, v in group.items() if k != "params"}))
        for _ in group["params"]:
            i = len(params)
            params.append({"name": names[i], "group": g, "trainable": i in trainable, "step": pipeline.steps.get(i, 0)})
    return {
        "format": FORMAT,
        "version": VERSION,
        "world_size": pipeline.world_size,
        "stage": pipeline.stage,
        "block_bytes": BLOCK_BYTES,
        "files": [r["file"] for r in results],
        "tensors": specs,
        "model": {key: f"model/{name}" for key, name in aliases.items()},
        "params": params,
        "param_groups": groups,
        "adam_w_mode": bool(getattr(optimizer, "adam_w_mode", True)),
        "skipped_steps": optimizer.skipped_steps,  # the same on every rank (the skip is decided on global stats)
        # qwZ: the param groups whose whole copies a step's int8 all-gather wrote (a group added since, not yet)
        "dequantized": sorted({buf.group for buf in pipeline.buffers if buf.dequantized}),
        **files,
    }


def _entry(blob: Optional[bytes]) -> Optional[dict[str, int]]:
    return None if blob is None else {"bytes": len(blob), "crc32": zlib.crc32(blob)}


def _collect(pipeline: Pipeline, fn: Callable[[], Any], *, share: bool) -> Any:
    """Run ``fn`` on every rank; if it failed on any rank, raise the first failure on every rank.

    Returns every rank's result (``share``: gathered to all ranks, so keep them small) or this rank's.
    """
    failure, value = _agreed(pipeline, fn, share=share)
    if failure is not None:
        raise CheckpointError(f"{failure}; nothing was changed")
    return value


def _agreed(pipeline: Pipeline, fn: Callable[[], Any], *, share: bool) -> tuple[Optional[str], Any]:
    """Run ``fn`` on every rank; return, the same on every rank, the first failure (naming its rank where there are
    several; None where no rank failed) and every rank's result (``share``) or this rank's."""
    try:
        value, error = fn(), None
    except Exception as err:  # MemoryError too: a failure on one rank alone would leave the others waiting for it
        value, error = None, str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
    mine = (error, value if share else None)
    outcomes = all_gather_objects(pipeline.engine, mine, name="checkpoint.outcomes", device=pipeline.device)
    failed = [(rank, message) for rank, (message, _) in enumerate(outcomes) if message is not None]
    if failed:
        rank, message = failed[0]
        where = "" if pipeline.world_size == 1 else f"{ranks_text([rank], pipeline.engine.global_ranks)}: "
        return f"{where}{message}", None
    return None, [v for _, v in outcomes] if share else value


def _commit(root: Path, version: str, meta: dict, files: dict[str, Optional[bytes]]) -> None:
    """Rank 0: the small files and metadata into the temporary version, rename it into place, point ``latest``
    at it, then remove what earlier saves that did not finish left behind."""
    folder = root / (TMP_PREFIX + version)
    for name, data in files.items():
        if data is not None:
            write_small(folder / name, data)
    write_small(folder / METADATA, json.dumps(meta).encode())
    publish(folder, root / version)
    write_small(root / LATEST, version.encode())
    remove_unfinished(root, version)


def save(directory: PathLike, model: nn.Module, optimizer: Any, *, extra: Any = None, scheduler: Any = None) -> Path:
    """Save a new version of a sharded checkpoint under ``directory``; call it on every rank, at stage 3 outside
    ``gathered_params()`` (inside it raises ``CheckpointError`` on every rank and writes nothing: the block's edits
    reach the shards only at its end).

    Args:
        directory: the checkpoint root (created if needed); earlier versions stay untouched.
        model: the model the optimizer trains (tensors are named by its ``state_dict`` keys).
        optimizer: the ``ShardedFusedAdam`` training ``model`` (or the wrapper ``accelerator.prepare`` returned).
        extra: an object to keep with the checkpoint (``checkpoint.objects`` says which types); ``load``
            returns it.
        scheduler: an lr scheduler whose ``state_dict()`` is kept with the checkpoint, exactly.

    Returns:
        the directory of the new version (complete when this returns, on every rank).
    """
    check_byteorder()
    optimizer = _unwrapped(optimizer)
    pipeline = _pipeline(optimizer)
    _refuse_inside_hold(pipeline, "save")
    _refuse_held_elsewhere(model, optimizer, "save")
    refusal = state_door.unfinished_load(pipeline, "checkpoint.save")
    if refusal is not None:  # every rank holds the same (``_apply_everywhere``)
        raise CheckpointError(f"{refusal}; nothing was written")
    optimizer.check_param_groups(numbering=True)  # names from the groups, pieces from the buffers: must agree
    pipeline.wait_params()
    root = Path(directory)
    names = _names(model, optimizer)
    tensors, _ = _model_tensors(model)
    blob: Optional[bytes] = None
    with contextlib.ExitStack() as unlock:  # rank 0 holds the root's lock from numbering the version to 'latest'

        def start() -> Optional[str]:
            nonlocal blob
            if pipeline.rank != 0:
                return None
            blob = None if extra is None else objects.dumps(extra, "extra")
            for key, value in _book(optimizer, scheduler).items():  # refused before anything is written
                objects.encode(value, _LABELS[key])
            root.mkdir(parents=True, exist_ok=True)
            unlock.callback(SaveLock(root).release)
            version = next_version(root)
            (root / (TMP_PREFIX + version)).mkdir()
            return version

        version = _collect(pipeline, start, share=True)[0]
        folder = root / (TMP_PREFIX + version)
        adopt.follow_replaced(pipeline, pipeline.name_of)
        held = accumulation.capture(optimizer, pipeline)
        others = _other_pieces(pipeline, tensors) + held.pieces
        pieces = itertools.chain(_buffer_pieces(pipeline, names), others)  # read as they are written

        def write() -> dict[str, Any]:
            return {**_write_rank_file(folder, pipeline.rank, pieces), "specs": held.specs, "window": held.flags}

        results = _collect(pipeline, write, share=True)

        def finish() -> None:
            if pipeline.rank == 0:
                book = {**_book(optimizer, scheduler), "window": accumulation.book(results, optimizer, pipeline)}
                files = {OBJECTS: objects.dumps(book, "the checkpoint's objects"), EXTRA: blob}
                entries = {"objects": _entry(files[OBJECTS]), "extra": _entry(blob)}
                meta = _metadata(model, optimizer, pipeline, results, entries)
                _commit(root, version, meta, files)
                accumulation.warn_saved(book["window"], root / version)

        _collect(pipeline, finish, share=False)
        return root / version


# ---------------------------------------------------------------- load
def _check_model(meta: dict, pipeline: Pipeline, model: nn.Module, version: Path) -> set[str]:
    """Every model tensor is in the checkpoint with its shape, and nothing else is: else name the first mismatch.

    Returns the model tensors to leave as they are: frozen parameters absent from a checkpoint imported from
    DeepSpeed, whose ``save_checkpoint(exclude_frozen_parameters=True)`` (the HF Trainer's with a PEFT model)
    leaves them out; DeepSpeed's own load keeps the model's values there (``load_module_strict=False``)."""
    tensors, aliases = _model_tensors(model)
    saved = meta["model"]
    imported = isinstance(meta.get("imported_from"), dict) and "deepspeed" in meta["imported_from"]
    kept: set[str] = set()
    for key, name in aliases.items():
        t = tensors[name]
        if key not in saved and imported and isinstance(t, nn.Parameter) and not t.requires_grad:
            kept.add(name)
            continue
        if key not in saved:
            raise CheckpointError(
                f"checkpoint: model tensor {key!r} is not in {version}: it was saved from another model"
            )
        shape, spec = tuple(pipeline.param_shape(tensors[name])), meta["tensors"][saved[key]]
        if tuple(spec["shape"]) != shape:
            raise CheckpointError(
                f"checkpoint: model tensor {key!r} has shape {shape} here but {tuple(spec['shape'])} in {version}: "
                "it was saved from another model"
            )
    unknown = [key for key in saved if key not in aliases]
    if unknown:
        raise CheckpointError(f"checkpoint: {version} holds model tensor {unknown[0]!r}, which this model lacks")
    if kept and pipeline.rank == 0:
        names = ", ".join(sorted(kept)[:3]) + (", ..." if len(kept) > 3 else "")
        log.warning(
            "checkpoint: %s lacks %s (%s), frozen here (DeepSpeed's save_checkpoint(exclude_frozen_parameters=True) "
            "leaves them out): the model's own values are kept, as DeepSpeed's load_checkpoint keeps them",
            version,
            plural(len(kept), "frozen parameter"),
            names,
        )
    return kept


def _check_optimizer(meta: dict, optimizer: Any, names: list[str], version: Path) -> dict[str, int]:
    """The optimizer holds the saved parameters in the same param groups; returns name -> saved index. A mismatch
    names the first parameter that differs, before the counts are compared."""
    saved = {p["name"]: i for i, p in enumerate(meta["params"])}
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            name = names[index]
            index += 1
            if name not in saved or meta["params"][saved[name]]["group"] != g:
                where = (
                    "not optimized" if name not in saved else f"in param group {meta['params'][saved[name]]['group']}"
                )
                raise CheckpointError(
                    f"checkpoint: parameter {name!r} is in param group {g} here but {where} in {version}"
                    f"{_frozen_here(param, name not in saved)}{_empty_groups(meta)}"
                )
    here = set(names)
    for entry in meta["params"]:
        if entry["name"] not in here:
            raise CheckpointError(
                f"checkpoint: parameter {entry['name']!r} is in param group {entry['group']} in {version} but not "
                "optimized here (frozen, or left out of the optimizer's param groups)"
            )
    if len(meta["param_groups"]) != len(optimizer.param_groups) or len(saved) != len(names):
        raise CheckpointError(
            f"checkpoint: {version} has {len(meta['param_groups'])} param groups with {len(saved)} parameters; "
            f"this optimizer has {len(optimizer.param_groups)} with {len(names)}{_empty_groups(meta)}"
        )
    return saved


def _frozen_here(param: Any, unsaved: bool) -> str:
    """Where a parameter the checkpoint did not optimize is frozen here (DeepSpeed keeps frozen parameters given in
    its param groups apart from its optimizer's state): what to give the optimizer instead; else ""."""
    if not unsaved or getattr(param, "requires_grad", True):
        return ""
    return (
        " (frozen here, and the checkpoint keeps no optimizer state for it, as DeepSpeed keeps none for frozen "
        "parameters: give the optimizer only the parameters with requires_grad=True)"
    )


def _empty_groups(meta: dict) -> str:
    """Where the saved param groups include some that hold no parameter (a DeepSpeed run's group of frozen
    parameters, imported), which they are and what the optimizer gives in their place; else ""."""
    held = {p["group"] for p in meta["params"]}
    empty = [g for g in range(len(meta["param_groups"])) if g not in held]
    if not empty:
        return ""
    return (
        f" (param group {', '.join(map(str, empty))} there holds no parameter, frozen where it was saved: give the "
        "optimizer an empty param group, {'params': []}, in that place)"
    )


def _state_key(src: TensorSource, kind: str, index: int, name: str, trained: bool) -> Optional[str]:
    """Where a state kind of a parameter comes from (None: zeros, the state of a parameter never trained)."""
    master = f"optim/{index}/master"
    if kind == "master":
        return master if master in src.meta["tensors"] else f"model/{name}"
    key = f"optim/{index}/{kind}"
    if kind == "max_exp_avg_sq":  # saved only by param groups that used AMSGrad
        return key if trained and key in src.meta["tensors"] else None
    return key if trained else None


def _param_key(src: TensorSource, index: int, name: str, dtype: torch.dtype) -> str:
    """A parameter of the saved dtype loads the saved value; of another dtype (fp32, or bf16 saved as fp16 and
    the reverse), the fp32 master copy when the checkpoint has one, rounded by the copy: the value the kept master
    rounds to, so the first step does not take it for a write and drop the master."""
    master, saved = f"optim/{index}/master", f"model/{name}"
    tensors = src.meta["tensors"]
    return master if master in tensors and tensors[saved]["dtype"] != dtype_name(dtype) else saved


Move = tuple[torch.Tensor, Optional[torch.Tensor]]  # (destination, value; None: zeros)
Value = Union[None, torch.Tensor, Callable[[], torch.Tensor]]  # zeros, a value read, or one to read when applied


def _stage_buffers(src: TensorSource, pipeline: Pipeline, names: list[str], saved: dict[str, int]) -> list[BufferLoad]:
    """Read what this rank's flat buffers need: its shard of the state and its parameter shard (stage 3). Where a tier
    keeps a buffer's state between steps, the values are read and checked now but kept on disk, read again when
    they are applied (``state_door.LoadBuffer``: one buffer's state in host memory at a time)."""
    params, tensors = src.meta["params"], src.meta["tensors"]

    def amsgrad(i: int) -> bool:
        return f"optim/{saved[names[i]]}/max_exp_avg_sq" in tensors

    loads = []
    for target in state_door.load_buffers(pipeline, amsgrad):
        values: list[list[Value]] = []
        for spec in target.specs():
            name = names[spec.index]
            index = saved[name]
            keys = [_state_key(src, kind, index, name, params[index]["trainable"]) for kind in spec.kinds]
            if spec.param:
                keys.append(_param_key(src, index, name, spec.dtype))
            values.append([None if key is None else _value(src, key, spec, target.kept) for key in keys])
        loads.append(BufferLoad(target, values))
    return loads


def _value(src: TensorSource, key: str, spec: state_door.LoadSpec, later: bool) -> Value:
    """Elements ``spec.start .. + spec.numel`` of ``key``; ``later``: checked now (their blocks' checksums), read
    again when applied (``_read_again``)."""
    value, crc = src.read_summed(key, spec.start, spec.numel)
    if not later:
        return value
    return functools.partial(_read_again, src, key, spec, crc)


def _read_again(src: TensorSource, key: str, spec: state_door.LoadSpec, crc: int) -> torch.Tensor:
    """The elements ``_value`` checked, read again: the same bytes (their CRC-32 ``crc``), else a CheckpointError
    (the file was written to since: the blocks checked once are not checked again)."""
    value, again = src.read_summed(key, spec.start, spec.numel)
    if again != crc:
        raise CheckpointError(
            f"checkpoint: {key!r} (elements {spec.start}..{spec.start + spec.numel}) in {src.version} changed since "
            "the load checked it: its shard file was written to during the load"
        )
    return value


def _whole_params(src: TensorSource, pipeline: Pipeline, names: list[str], saved: dict[str, int]) -> list[Move]:
    """The parameters every rank holds whole (stages 0-2)."""
    return [(dest, src.read(_param_key(src, saved[names[i]], names[i], dtype)))
            for i, dtype, dest in state_door.whole_params(pipeline)]  # fmt: skip


@dataclass
class BufferLoad:
    """A buffer's part of a load: per run of ``target.specs()``, the value of each destination (state kinds, then
    the parameter shard)."""

    target: state_door.LoadBuffer
    values: list[list[Value]]

    def apply(self) -> None:
        with self.target.into() as pieces:
            for piece, values in zip(pieces, self.values):
                dests = [*piece.state.values(), *([piece.param] if piece.param is not None else [])]
                for dst, value in zip(dests, values):
                    _move(dst, value() if callable(value) else value)


def _move(dst: torch.Tensor, value: Optional[torch.Tensor]) -> None:
    if value is None:
        dst.zero_()
    else:
        dst.copy_(value.view(dst.shape))


def _read_book(version: Path, meta: dict, scheduler: Any) -> dict[str, Any]:
    """``objects.pt``, checked; a version-1 checkpoint's JSON instead, its scheduler state given back the
    types JSON took from it where ``scheduler``'s own state shows them (``objects.from_json``)."""
    if meta["version"] >= 2:
        book = objects.read_file(version, OBJECTS, meta["objects"])
        return check_objects(book, meta, version / OBJECTS)
    state = meta.get("lr_scheduler")
    if scheduler is not None and state is not None:
        state = objects.from_json(state, scheduler.state_dict())
    groups = [{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()} for g in meta.get("param_groups", [])]
    book = {"param_groups": groups, "lr_scheduler": state, "loss_scaler": meta.get("loss_scaler"), "window": None}
    return check_objects(book, meta, version / METADATA)


def _check_scheduler(book: dict[str, Any], optimizer: Any, scheduler: Any, version: Path) -> None:
    """The saved scheduler state fits ``scheduler``: its class, where the checkpoint names it, and a trial
    ``load_state_dict`` on a copy of it, whose optimizer is a stand-in holding copies of the param groups (another
    scheduler's state, or one it cannot read, would fail in the real load, after everything else was loaded)."""
    if scheduler is None:
        return
    state, here = book["lr_scheduler"], type(scheduler).__name__
    if state is None:
        raise CheckpointError(f"checkpoint: {version} holds no scheduler state; load it without scheduler=")
    saved = book.get("lr_scheduler_class")
    if saved is not None and saved != here:
        raise CheckpointError(f"checkpoint: {version} holds the state of a {saved} scheduler, scheduler= is a {here}")
    trial = _scheduler_copy(scheduler, optimizer)
    if trial is None:
        return
    try:
        trial.load_state_dict(copy.deepcopy(state))
    except Exception as err:  # whatever the scheduler's own load_state_dict raises
        raise CheckpointError(
            f"checkpoint: {version}'s scheduler state does not fit scheduler= (a {here}): "
            f"{type(err).__name__}: {err}; load it with the scheduler it was saved with"
        ) from err


def _scheduler_copy(scheduler: Any, optimizer: Any) -> Any:
    """A copy of ``scheduler`` whose optimizer is a stand-in with copies of the param groups, sharing the parameters
    (never copied); None for a scheduler that cannot be copied, which is then loaded untried."""
    stand_in = SimpleNamespace(param_groups=_hyper_groups(optimizer))
    memo: dict[int, Any] = {id(p): p for g in optimizer.param_groups for p in g["params"]}
    memo[id(optimizer)] = stand_in
    try:
        return copy.deepcopy(scheduler, memo)
    except Exception:  # an attribute deepcopy refuses (a lock, an open file): no trial, as before the check
        return None


@dataclass
class _Staged:
    """What ``load`` read and checked on this rank, before anything changes."""

    meta: dict
    book: dict[str, Any]
    buffers: list[BufferLoad]
    moves: list[Move]
    frozen: dict[int, torch.Tensor]  # id(frozen parameter partitioned at stage 3) -> its saved value
    extra: Any
    window: Optional[Window]


def _stage(
    directory: PathLike,
    model: nn.Module,
    optimizer: Any,
    pipeline: Pipeline,
    scheduler: Any,
    files: contextlib.ExitStack,
) -> _Staged:
    """Check the checkpoint against the model and optimizer and read this rank's part; change nothing. The checkpoint's
    files stay open in ``files`` for the values read when applied."""
    version = resolve(directory)
    meta = read_metadata(version)
    book = _read_book(version, meta, scheduler)
    _check_scheduler(book, optimizer, scheduler, version)
    names = _names(model, optimizer)
    kept = _check_model(meta, pipeline, model, version)
    saved = _check_optimizer(meta, optimizer, names, version)
    accumulation.check(book["window"], optimizer, pipeline, version)
    tensors, _ = _model_tensors(model)
    stored = pipeline.frozen_partitioned()
    frozen = {}
    src = files.enter_context(TensorSource(version, meta))
    buffers = _stage_buffers(src, pipeline, names, saved)
    moves = _whole_params(src, pipeline, names, saved)
    for name, t in tensors.items():
        if name in kept:
            continue
        if id(t) in stored:
            frozen[id(t)] = src.full(f"model/{name}")
        elif id(t) not in pipeline.where:
            moves.append((t.detach(), src.full(f"model/{name}")))
    window = accumulation.stage(src, book["window"], pipeline, version)
    return _Staged(meta, book, buffers, moves, frozen, objects.read_file(version, EXTRA, meta.get("extra")), window)


@torch.no_grad()
def _apply_everywhere(staged: _Staged, optimizer: Any, pipeline: Pipeline, names: list[str]) -> None:
    """Write what ``staged`` holds on every rank, then agree that every rank did. Where a tier keeps the state between
    steps its values are read from the checkpoint's files as they are written (``_value``), so a read that fails
    there (the file truncated, removed or written to since it was checked, an I/O error), or any other failure (a
    ``MemoryError``), stops the load part way on that rank: every rank raises, naming it, and steps, saves and state
    dicts are refused until a load completes (``state_door.stopped_load``). The parameters' collective (qwZ's whole
    copies made as a step leaves them) runs once every rank has written."""
    failure, _ = _agreed(pipeline, lambda: _apply(staged, optimizer, pipeline, names), share=False)
    state_door.stopped_load(pipeline, failure)
    if failure is not None:
        raise CheckpointError(
            f"{failure}; the load stopped part way, after it had begun writing: the optimizer state and the "
            "parameters are partly the checkpoint's and partly what they were (the ranks may differ), so steps, "
            "checkpoint saves and state dicts are refused until zk.checkpoint.load, called again on every rank, "
            "completes"
        )
    pipeline.requantize_loaded(staged.meta.get("dequantized", True))  # absent before it was kept: as then


@torch.no_grad()
def _apply(staged: _Staged, optimizer: Any, pipeline: Pipeline, names: list[str]) -> None:
    state_door.give_amsgrad(pipeline, [load.target for load in staged.buffers])
    for load in staged.buffers:
        load.apply()
    for dst, value in staged.moves:
        _move(dst, value)
    pipeline.assign_frozen(staged.frozen)
    master.record_all(pipeline)
    saved = {p["name"]: p for p in staged.meta["params"]}
    for index in pipeline.steps:
        entry = saved[names[index]]
        pipeline.steps[index] = int(entry["step"]) if entry["trainable"] else 0
    state_door.warn_other_decay_mode(staged.book["param_groups"], optimizer.adam_w_mode, "zero_kernels.checkpoint.load")
    for group, hyper in zip(optimizer.param_groups, staged.book["param_groups"]):
        group.update({k: v for k, v in hyper.items() if k not in state_door.KEEP_OWN})
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is not None and staged.book["loss_scaler"] is not None:
        scaler.load_state_dict(staged.book["loss_scaler"])
    if "skipped_steps" in staged.meta:  # absent from checkpoints of before it was kept
        optimizer.skipped_steps = staged.meta["skipped_steps"]
    accumulation.apply(staged.window, staged.book["window"], optimizer, pipeline)


def _refuse_held_elsewhere(model: nn.Module, optimizer: Any, action: str) -> None:
    """A model tensor that another live stage-3 optimizer shards (a GAN's discriminator in the wrapper holding both
    parts, each part with its optimizer) is an empty tensor on every rank here between uses (unless kept whole under
    ``stage3_param_persistence_threshold``): its values are in that optimizer's shards, which this optimizer's
    checkpoint does not reach. Raise on every rank (every rank finds the same), before anything is read, written or
    changed, naming it and what to save instead."""
    owners = live.owners()
    for name, t in _model_tensors(model)[0].items():
        other = owners.get(id(t))
        if other is None or other is optimizer or other.pipeline.stage != 3 or t.numel() == getattr(t, "ds_numel", 0):
            continue
        done = "nothing was written" if action == "save" else "nothing was changed"
        raise CheckpointError(
            f"checkpoint: {action}: model tensor {name!r} is trained by another ShardedFusedAdam, at stage 3, whose "
            "shards hold its values (this optimizer's checkpoint cannot reach them): give each optimizer the module "
            f"holding what it trains, one directory each (zk.checkpoint.{action}(dir_g, model.generator, opt_g) and "
            f"zk.checkpoint.{action}(dir_d, model.discriminator, opt_d)); {done}"
        )


def _refuse_inside_hold(pipeline: Pipeline, action: str) -> None:
    """At stage 3 the block's edits reach the shards, which checkpoints read and write, only at the end of
    ``gathered_params()``: a save inside it would write the weights from before the edits, and the block's end
    would write the values gathered at its start back over a load's. Every rank is inside the block, so every rank
    raises, before anything is read, written or changed."""
    if not pipeline.holding:
        return
    if action == "save":
        why = "the block's edits reach the shards it saves only at the block's end, so it would save the weights "
        why += "from before them; call checkpoint.save after the block; nothing was written"
    else:
        why = "the block's end would write the parameters gathered before the load back over the loaded ones; "
        why += "call checkpoint.load after the block; nothing was changed"
    raise CheckpointError(f"checkpoint: {action} was called inside gathered_params() at stage 3: {why}")


def load(directory: PathLike, model: nn.Module, optimizer: Any, *, scheduler: Any = None) -> Any:
    """Load the version ``directory``'s ``latest`` names (or that version directory); call it on every rank.

    Works whatever the world size, stage, bucket size and parameter dtypes of the run that saved,
    except for a checkpoint saved inside a gradient accumulation window, which resumes that window
    only under the same layout (``checkpoint.accumulation``). Every problem (missing, truncated or
    corrupted files, another model, another format version, a save that did not finish, a call inside
    stage 3's ``gathered_params()``) raises ``CheckpointError`` on every rank before anything changes.
    A failure once it has begun writing (a read of a file that fails where an offload tier's state is
    loaded as it is read, a ``MemoryError``) raises ``CheckpointError`` on every rank, naming the rank, and
    the optimizer refuses to step or give its state dicts, and ``save`` to save, until a load completes.

    Args:
        directory: a checkpoint root written by ``save`` or one of its ``vNNNNNN`` version directories.
        model: the model (same parameter names and shapes as the one saved).
        optimizer: its ``ShardedFusedAdam`` (same param groups, by parameter name), or the wrapper
            ``accelerator.prepare`` returned.
        scheduler: an lr scheduler to restore from the state saved with ``save(..., scheduler=)``
            (or imported from DeepSpeed); it is loaded after the optimizer's param groups.

    Returns:
        the ``extra`` object given to ``save`` (None when there was none).
    """
    check_byteorder()
    optimizer = _unwrapped(optimizer)
    pipeline = _pipeline(optimizer)
    _refuse_inside_hold(pipeline, "load")
    _refuse_held_elsewhere(model, optimizer, "load")
    optimizer.check_param_groups(numbering=True)
    pipeline.wait_params()
    adopt.follow_replaced(pipeline, pipeline.name_of)  # model.to(...) copies: load into what the model reads
    with contextlib.ExitStack() as files:
        staged = _collect(
            pipeline, lambda: _stage(directory, model, optimizer, pipeline, scheduler, files), share=False
        )
        _apply_everywhere(staged, optimizer, pipeline, _names(model, optimizer))
    if scheduler is not None:
        scheduler.load_state_dict(staged.book["lr_scheduler"])
    elif staged.book.get("lr_scheduler") is not None:
        log.warning(
            "zero_kernels: checkpoint.load: the checkpoint holds the state of a %s scheduler, and no scheduler= was "
            "given: the schedule starts again from its beginning; pass scheduler=<your lr scheduler> to resume it "
            "(DeepSpeed's load_checkpoint restores the engine's own)",
            staged.book.get("lr_scheduler_class") or "learning-rate",
        )
    return staged.extra
