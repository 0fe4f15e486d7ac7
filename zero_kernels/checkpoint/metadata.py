"""Reading a checkpoint's ``metadata.json``: parsed, then checked before anything is opened or allocated.

A checkpoint directory may come from anywhere, so its metadata is untrusted input. ``read_metadata``
makes sure that every field the readers use has the type and range they expect, so that a bad file
raises one ``CheckpointError`` naming the field, never a ``KeyError`` or an allocator failure:

- shard file names are plain names inside the version directory (no path separators, no ``..``);
- every tensor's pieces lie inside the bytes the metadata gives their file, and cover the tensor
  exactly once, so a tensor is never larger than the files that hold it (the readers check each
  file's real size against the metadata before reading it);
- bookkeeping (model names, optimizer parameters, param groups, loss scaler, skipped steps, extra) has the shape
  ``checkpoint.load``, ``consolidate`` and ``inspect`` read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from ..wording import plural
from .format import DTYPES, FORMAT, METADATA, OBJECTS, READABLE_VERSIONS, CheckpointError
from .objects import read_file

_ITEM_BYTES = {name: dtype.itemsize for name, dtype in DTYPES.items()}


class _Checker:
    def __init__(self, where: Path):
        self.where = where

    def fail(self, field: str, problem: str) -> CheckpointError:
        return CheckpointError(f"checkpoint: {self.where}: {field} {problem}")

    def of_type(self, value: Any, kind: type, field: str) -> Any:
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise self.fail(field, f"must be an integer, not {value!r}")
        if not isinstance(value, kind):
            raise self.fail(field, f"must be a {_KIND_NAMES.get(kind, kind.__name__)}, not {type(value).__name__}")
        return value

    def count(self, value: Any, field: str, lo: int = 0, hi: Optional[int] = None) -> int:
        self.of_type(value, int, field)
        if value < lo or (hi is not None and value > hi):
            bound = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise self.fail(field, f"must be {bound}, not {value}")
        return value

    def number(self, value: Any, field: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(field, f"must be a finite number, not {value!r}")
        return float(value)


_KIND_NAMES = {dict: "JSON object", list: "JSON list", str: "string", bool: "boolean"}


def plain_file_name(name: Any) -> bool:
    """True for a file name that stays inside its directory: no separators, not ``.``/``..``, printable."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0:")
        and name.isprintable()
        and Path(name).name == name
    )


def _files(c: _Checker, files: Any, block_bytes: int) -> list[int]:
    sizes = []
    for i, entry in enumerate(c.of_type(files, list, "files")):
        field = f"files[{i}]"
        c.of_type(entry, dict, field)
        name = entry.get("name")
        if not plain_file_name(name):
            raise c.fail(f"{field}.name", f"{name!r} is not a plain file name inside the checkpoint directory")
        size = c.count(entry.get("bytes"), f"{field}.bytes")
        crcs = c.of_type(entry.get("crc32"), list, f"{field}.crc32")
        if len(crcs) != -(-size // block_bytes):
            raise c.fail(f"{field}.crc32", f"has {len(crcs)} checksums for {size} bytes in blocks of {block_bytes}")
        for j, crc in enumerate(crcs):
            c.count(crc, f"{field}.crc32[{j}]", 0, 0xFFFFFFFF)
        sizes.append(size)
    return sizes


def _tensor(c: _Checker, key: str, entry: Any, sizes: list[int]) -> None:
    field = f"tensors[{key!r}]"
    c.of_type(entry, dict, field)
    if entry.get("dtype") not in DTYPES:
        raise c.fail(f"{field}.dtype", f"{entry.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    itemsize = _ITEM_BYTES[entry["dtype"]]
    numel = 1
    for j, s in enumerate(c.of_type(entry.get("shape"), list, f"{field}.shape")):
        numel *= c.count(s, f"{field}.shape[{j}]")
    spans = []
    for j, piece in enumerate(c.of_type(entry.get("pieces"), list, f"{field}.pieces")):
        where = f"{field}.pieces[{j}]"
        if not isinstance(piece, list) or len(piece) != 4:
            raise c.fail(where, "must be [file, first element, byte offset, elements]")
        file = c.count(piece[0], f"{where}[0] (file)", 0, len(sizes) - 1)
        first, offset, n = (c.count(v, f"{where}[{k}]") for k, v in enumerate(piece[1:], 1))
        if offset + n * itemsize > sizes[file]:
            raise c.fail(where, f"reads bytes {offset}..{offset + n * itemsize} of a {sizes[file]}-byte file")
        spans.append((first, n))
    covered = 0
    for first, n in sorted(spans):
        if first != covered:
            break
        covered += n
    if covered != numel or sum(n for _, n in spans) != numel:
        raise c.fail(f"{field}.pieces", f"do not cover the {numel} elements of shape {entry['shape']} exactly once")


def _bookkeeping(c: _Checker, meta: dict[str, Any]) -> None:
    tensors = meta["tensors"]
    for name, key in c.of_type(meta["model"], dict, "model").items():
        if key not in tensors:
            raise c.fail(f"model[{name!r}]", f"names tensor {key!r}, which the checkpoint does not hold")
    groups = c.of_type(meta.get("param_groups", []), list, "param_groups")
    for g, group in enumerate(groups):
        c.of_type(group, dict, f"param_groups[{g}]")
        for key in ("lr", "eps", "weight_decay"):
            if key in group:
                c.number(group[key], f"param_groups[{g}].{key}")
        if "betas" in group:
            betas = c.of_type(group["betas"], list, f"param_groups[{g}].betas")
            if len(betas) != 2:
                raise c.fail(f"param_groups[{g}].betas", "must hold two numbers")
            for b in betas:
                c.number(b, f"param_groups[{g}].betas")
    for i, p in enumerate(c.of_type(meta["params"], list, "params")):
        c.of_type(p, dict, f"params[{i}]")
        c.of_type(p.get("name"), str, f"params[{i}].name")
        c.count(p.get("group"), f"params[{i}].group", 0, max(len(groups) - 1, 0))
        c.of_type(p.get("trainable"), bool, f"params[{i}].trainable")
        c.count(p.get("step"), f"params[{i}].step")
    _loss_scaler(c, meta.get("loss_scaler"))
    if "skipped_steps" in meta:
        c.count(meta["skipped_steps"], "skipped_steps")
    for key in ("extra", "objects"):
        entry = meta.get(key)
        if entry is not None:
            c.of_type(entry, dict, key)
            c.count(entry.get("bytes"), f"{key}.bytes")
            c.count(entry.get("crc32"), f"{key}.crc32", 0, 0xFFFFFFFF)
    if not isinstance(meta.get("adam_w_mode", True), bool):
        raise c.fail("adam_w_mode", "must be true or false")
    dequantized = meta.get("dequantized", True)  # param group indices; true or false for all as first kept
    if not isinstance(dequantized, (bool, list)):
        raise c.fail("dequantized", "must be true, false or a list of param group indices")
    for i, g in enumerate([] if isinstance(dequantized, bool) else dequantized):
        c.count(g, f"dequantized[{i}]", 0, max(len(groups) - 1, 0))


def _loss_scaler(c: _Checker, scaler: Any) -> None:
    """The fp16 loss scaler's saved state, where there is one (in the metadata, or in ``objects.pt``)."""
    if scaler is not None:
        c.of_type(scaler, dict, "loss_scaler")
        c.number(scaler.get("scale"), "loss_scaler.scale")
        c.count(scaler.get("good_steps"), "loss_scaler.good_steps")
        c.count(scaler.get("hysteresis_left"), "loss_scaler.hysteresis_left")


def read_metadata(version: Path) -> dict[str, Any]:
    """Parse and check ``version/metadata.json``: format, version, and every field readers rely on.

    Args:
        version: a version directory.
    """
    path = version / METADATA
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CheckpointError(f"checkpoint: {path} cannot be read ({type(err).__name__}: {err})") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint: {path} is not a {FORMAT} metadata file")
    if meta.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"checkpoint: {version} has format version {meta.get('version')!r}; this zero_kernels reads "
            f"versions {', '.join(map(str, READABLE_VERSIONS))}"
        )
    if meta["version"] >= 2 and not isinstance(meta.get("objects"), dict):
        raise CheckpointError(f"checkpoint: {path} lacks objects (format version {meta['version']})")
    missing = [
        k for k in ("world_size", "stage", "block_bytes", "files", "tensors", "model", "params") if k not in meta
    ]
    if missing:
        raise CheckpointError(f"checkpoint: {path} lacks {', '.join(missing)}")
    c = _Checker(path)
    c.count(meta["world_size"], "world_size", 1)
    c.count(meta["stage"], "stage", 0, 3)
    block_bytes = c.count(meta["block_bytes"], "block_bytes", 1)
    sizes = _files(c, meta["files"], block_bytes)
    for key, entry in c.of_type(meta["tensors"], dict, "tensors").items():
        _tensor(c, key, entry, sizes)
    _bookkeeping(c, meta)
    _uncompiled_names(meta)
    return meta


def uncompiled(key: str) -> str:
    """``key`` without the ``_orig_mod`` steps that ``torch.compile``'s wrapper puts in its ``state_dict`` keys: a
    checkpoint names a tensor alike whether the model or any of its modules was compiled or not."""
    return ".".join(part for part in key.split(".") if part != "_orig_mod")


def _uncompiled_names(meta: dict[str, Any]) -> None:
    """The model's names in ``meta`` as ``uncompiled`` gives them: a checkpoint saved from a compiled model by a
    version that kept ``_orig_mod.`` in them loads as one saved now."""

    def key(k: str) -> str:
        return "model/" + uncompiled(k[len("model/") :]) if k.startswith("model/") else k

    meta["tensors"] = {key(k): entry for k, entry in meta["tensors"].items()}
    meta["model"] = {uncompiled(name): key(k) for name, k in meta["model"].items()}
    for p in meta["params"]:
        p["name"] = uncompiled(p["name"])


def check_objects(book: Any, meta: dict[str, Any], where: Path) -> dict[str, Any]:
    """Check what ``objects.pt`` (or a version-1 metadata file) holds: the fields ``checkpoint.load`` reads.

    Args:
        book: the decoded objects: ``param_groups``, ``lr_scheduler``, ``loss_scaler``, ``window``.
        meta: the checked metadata.
        where: the file, for messages.
    """
    c = _Checker(where)
    c.of_type(book, dict, "objects")
    groups = c.of_type(book.get("param_groups"), list, "param_groups")
    if len(groups) != len(meta.get("param_groups", groups)):
        raise c.fail("param_groups", f"has {len(groups)} groups, the metadata {len(meta['param_groups'])}")
    for g, group in enumerate(groups):
        c.of_type(group, dict, f"param_groups[{g}]")
        for key in ("lr", "eps", "weight_decay"):
            if key in group:
                c.number(_plain(group[key]), f"param_groups[{g}].{key}")
        if "betas" in group:
            betas = group["betas"]
            if not isinstance(betas, (list, tuple)) or len(betas) != 2:
                raise c.fail(f"param_groups[{g}].betas", "must hold two numbers")
            for b in betas:
                c.number(_plain(b), f"param_groups[{g}].betas")
    if book.get("lr_scheduler") is not None:
        c.of_type(book["lr_scheduler"], dict, "lr_scheduler")
    if book.get("lr_scheduler_class") is not None:
        c.of_type(book["lr_scheduler_class"], str, "lr_scheduler_class")
    _loss_scaler(c, book.get("loss_scaler"))
    if book.get("window") is not None:
        _window(c, book["window"], meta["world_size"])
    return book


def read_book(version: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's objects, checked: ``objects.pt``, or a version-1 checkpoint's JSON (its param groups, no
    window), for the readers that need no scheduler (``consolidate``, ``inspect``).

    Args:
        version: the version directory.
        meta: its checked metadata.
    """
    if meta["version"] >= 2:
        return check_objects(read_file(version, OBJECTS, meta["objects"]), meta, version / OBJECTS)
    groups = [{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()} for g in meta["param_groups"]]
    return {"param_groups": groups, "window": None}


def _plain(value: Any) -> Any:
    """A one-element tensor (an ``lr`` given as a tensor) as its number, for the checks."""
    if hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1:
        return value.item()
    return value


def _window(c: _Checker, window: Any, world_size: int) -> None:
    """Check the saved accumulation window; keys absent from checkpoints of earlier versions (``owed``, ``sums``)
    get their defaults here, so readers of the window find every key."""
    c.of_type(window, dict, "window")
    c.count(window.get("micro_step"), "window.micro_step")
    c.of_type(window.get("layout"), list, "window.layout")
    ranks = c.of_type(window.get("ranks"), list, "window.ranks")
    if len(ranks) != world_size:
        raise c.fail("window.ranks", f"has {plural(len(ranks), 'entry', 'entries')} for {plural(world_size, 'rank')}")
    for r, flags in enumerate(ranks):
        field = f"window.ranks[{r}]"
        c.of_type(flags, dict, field)
        c.of_type(flags.get("synced"), bool, f"{field}.synced")
        c.of_type(flags.setdefault("owed", False), bool, f"{field}.owed")
        flags.setdefault("sums", [])
        for key in ("has_grad", "stepped_with", "grads", "shards", "sums"):
            for j, i in enumerate(c.of_type(flags.get(key), list, f"{field}.{key}")):
                c.count(i, f"{field}.{key}[{j}]")
        for b, written in enumerate(c.of_type(flags.get("written"), list, f"{field}.written")):
            for j, k in enumerate(c.of_type(written, list, f"{field}.written[{b}]")):
                c.count(k, f"{field}.written[{b}][{j}]")
