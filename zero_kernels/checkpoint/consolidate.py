"""``consolidate``: a sharded checkpoint -> one ``torch.save`` file, written tensor by tensor.

The output is ``{"model": state_dict, "optimizer": torch.optim.AdamW state_dict}``, readable by
``torch.load(path, weights_only=True)`` and loadable with ``model.load_state_dict(out["model"])``
and ``torch.optim.AdamW(model.parameters(), ...).load_state_dict(out["optimizer"])``. A bf16/fp16
parameter is written as its fp32 master (as DeepSpeed's ``zero_to_fp32.py`` does; loading it into
a bf16 model rounds it to the trained bf16 values), and its optimizer entry also holds it as
``master`` (the same storage, written once), so a ``ShardedFusedAdam`` resumes from the file bit
for bit (the fp16 loss scale and ``skipped_steps`` ride along under ``zero_kernels.sharded``, which AdamW ignores).

Streaming. ``torch.save`` needs every tensor in memory. Here the pickle of the structure is
written first, with each tensor a placeholder that names its storage record; then each record is
filled by reading that one tensor from the rank files, so memory stays at one tensor at a time.
The archive is the one ``torch.save`` writes (same records, written by the same zip writer).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import torch

from ..stages.state_door import STATE_DICT_KEY
from . import accumulation
from .format import DTYPES, PathLike, TensorSource, fsync_dir, resolve
from .metadata import read_book, read_metadata

Producer = Callable[[], torch.Tensor]
log = logging.getLogger("zero_kernels")


class _StorageRef:
    """A storage record of the output, filled later by ``producer``."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _Placeholder:
    """Pickles as a CPU tensor whose storage is the record ``ref`` (contiguous, offset 0)."""

    def __init__(self, ref: _StorageRef, shape: tuple[int, ...]):
        self.ref, self.shape = ref, shape

    def __reduce__(self) -> tuple:
        stride, acc = [], 1
        for size in reversed(self.shape):
            stride.insert(0, acc)
            acc *= size
        args = (self.ref, 0, torch.Size(self.shape), tuple(stride), False, OrderedDict())
        return (torch._utils._rebuild_tensor_v2, args)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            storage_type = getattr(
                torch, torch.storage.TypedStorage(dtype=obj.dtype, _internal=True)._pickle_storage_type()
            )
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


class _Records:
    """The placeholders of one output file and how to produce each one's data."""

    def __init__(self) -> None:
        self.producers: list[tuple[_StorageRef, Producer]] = []

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype, producer: Producer) -> _Placeholder:
        numel = 1
        for s in shape:
            numel *= s
        ref = _StorageRef(str(len(self.producers)), dtype, numel)
        self.producers.append((ref, producer))
        return _Placeholder(ref, tuple(shape))


def _structure(src: TensorSource, records: _Records, book: dict[str, Any]) -> dict[str, Any]:
    """The output object, every tensor a placeholder (tied model tensors share one); the optimizer's state carries the
    fp16 loss scale and ``skipped_steps`` under ``STATE_DICT_KEY``, as ``full_state_dict()`` does (AdamW ignores it)."""
    meta = src.meta
    shared: dict[str, _Placeholder] = {}

    def lazy(key: str) -> _Placeholder:
        if key not in shared:
            entry = src.entry(key)
            shared[key] = records.tensor(tuple(entry["shape"]), DTYPES[entry["dtype"]], lambda: src.full(key))
        return shared[key]

    masters = {f"model/{p['name']}": f"optim/{i}/master" for i, p in enumerate(meta["params"])}
    masters = {key: master for key, master in masters.items() if master in meta["tensors"]}
    model = OrderedDict((name, lazy(masters.get(key, key))) for name, key in meta["model"].items())
    state = {}
    for index, param in enumerate(meta["params"]):
        if param["trainable"] and param["step"] > 0:
            step = float(param["step"])
            state[index] = {
                "step": records.tensor((), torch.float32, lambda step=step: torch.tensor(step, dtype=torch.float32)),
                "exp_avg": lazy(f"optim/{index}/exp_avg"),
                "exp_avg_sq": lazy(f"optim/{index}/exp_avg_sq"),
            }
            for kind in ("max_exp_avg_sq", "master"):  # AMSGrad groups; bf16/fp16 parameters (the model's tensor)
                if f"optim/{index}/{kind}" in meta["tensors"]:
                    state[index][kind] = lazy(f"optim/{index}/{kind}")
    carried = {"whole": True, "loss_scaler": book["loss_scaler"], "skipped_steps": meta.get("skipped_steps")}
    optimizer = {"state": state, "param_groups": _adamw_groups(meta, book["param_groups"]), STATE_DICT_KEY: carried}
    return {"model": model, "optimizer": optimizer}


def _adamw_groups(meta: dict[str, Any], saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The saved param groups completed with ``torch.optim.AdamW``'s own defaults for the other keys."""
    defaults = torch.optim.AdamW([torch.zeros(1)]).param_groups[0]
    out, first = [], 0
    for g, hyper in enumerate(saved):
        group = {k: v for k, v in defaults.items() if k != "params"}
        group.update({k: v.item() if isinstance(v, torch.Tensor) else v for k, v in hyper.items()})  # lr tensors
        if "decoupled_weight_decay" in defaults:
            group["decoupled_weight_decay"] = bool(meta.get("adam_w_mode", True))
        count = sum(1 for p in meta["params"] if p["group"] == g)
        group["params"] = list(range(first, first + count))
        first += count
        out.append(group)
    return out


def _write(path: Path, obj: Any, records: _Records) -> None:
    data = io.BytesIO()
    _Pickler(data, protocol=2).dump(obj)
    pickled = data.getvalue()
    alignment = str(torch.serialization._get_storage_alignment())
    with torch.serialization._open_zipfile_writer(str(path)) as writer:
        writer.write_record("data.pkl", pickled, len(pickled))
        writer.write_record(".format_version", "1", 1)
        writer.write_record(".storage_alignment", alignment, len(alignment))
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for ref, producer in records.producers:
            t = producer().to(ref.dtype).contiguous().clone()
            writer.write_record(f"data/{ref.key}", t.untyped_storage(), t.nbytes)


def consolidate(directory: PathLike, out_path: PathLike) -> Path:
    """Write the model ``state_dict`` and the ``torch.optim.AdamW`` state of a checkpoint to one file.

    Runs in one process (no process group needed), holding one tensor at a time.

    Args:
        directory: a checkpoint root (its newest complete version) or a version directory.
        out_path: the ``.pt`` file to write (replaced atomically: written to ``OUT.tmp`` first, which a failure
            removes); a directory, or a file in a directory that does not exist, is a ValueError.

    Returns:
        ``out_path`` as a Path.
    """
    out = _check_out(Path(out_path))
    version = resolve(directory)
    meta = read_metadata(version)
    tmp = out.with_name(out.name + ".tmp")
    records = _Records()
    try:
        book = read_book(version, meta)
        with TensorSource(version, meta) as src:
            _write(tmp, _structure(src, records, book), records)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(out.parent)
    _warn_window(version, book["window"], out)
    return out


def _warn_window(version: Path, window: Any, out: Path) -> None:
    """A checkpoint saved inside an accumulation window: its gradients are not in ``out`` (a WARNING)."""
    what = accumulation.describe(window)
    if what is not None:
        log.warning(
            "consolidate: %s was saved inside a gradient accumulation window (%s); those gradients are not in %s, "
            "which holds the state after the last opt.step(): a run resumed from it redoes that window's backward "
            "passes",
            version,
            what,
            out,
        )


def _check_out(out: Path) -> Path:
    """``out`` names a file that can be written: not a directory (DeepSpeed's ``zero_to_fp32.py`` takes one), in a
    directory that exists; a ValueError otherwise."""
    if out.is_dir():
        raise ValueError(
            f"consolidate: OUT {str(out)!r} is a directory; give the file to write, such as "
            f"{str(out / 'model_and_adamw.pt')!r}"
        )
    if not out.parent.is_dir():
        raise ValueError(f"consolidate: the directory of OUT {str(out)!r} does not exist; create it first")
    return out
