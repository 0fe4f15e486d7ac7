"""The gradient accumulation window in a checkpoint: saved where it is open, honoured or refused on load.

A checkpoint saved between the backward passes of one step (micro-steps under ``no_sync`` or
``gradient_accumulation_steps``, or repeated backward) must not resume as if they never happened.
So each rank whose window is open (``stages.window``) writes the gradients it holds into its rank
file (``window/RANK/grad/INDEX``, ``window/RANK/shard/BUFFER``, and with a wider ``grad_accum_dtype`` at stages 0-1
``window/RANK/sum/INDEX``, in that dtype), and ``objects.pt`` keeps the
micro-step count, the layout and each rank's flags. Loading puts every rank's window back exactly
when the layout is the same (world size, stage, bucket size, model: ``stages.state_door.layout_signature``);
a rank's gradients mean nothing under another layout, so an open window there is a
``CheckpointError`` that says to save at a window boundary (after ``opt.step()``, or ``opt.zero_grad()`` where no
step uses what is held), and ``save`` says it at WARNING when it writes one. A checkpoint
saved at a boundary, or by an earlier version, loads with an empty window (as after ``zero_grad()``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from ..stages import Pipeline
from ..stages import state_door as zstate
from ..stages import window as zwindow
from ..wording import plural
from .format import CheckpointError, TensorSource, dtype_name

log = logging.getLogger("zero_kernels")

Piece = tuple[str, int, torch.Tensor]  # (tensor key, first element, source view)


@dataclass
class Held:
    """This rank's window as ``save`` writes it: pieces for the rank file, their specs, the flags."""

    pieces: list[Piece] = field(default_factory=list)
    specs: dict[str, dict[str, Any]] = field(default_factory=dict)
    flags: Optional[dict[str, Any]] = None  # None: the window is closed


def _grad_key(rank: int, index: int) -> str:
    return f"window/{rank}/grad/{index}"


def _shard_key(rank: int, b: int) -> str:
    return f"window/{rank}/shard/{b}"


def _sum_key(rank: int, index: int) -> str:
    return f"window/{rank}/sum/{index}"


def capture(optimizer: Any, pipeline: Pipeline) -> Held:
    """What this rank saves of its window (nothing when it is closed)."""
    if optimizer.micro_step == 0 and not pipeline.window_open:
        return Held()
    window = zwindow.capture(pipeline)
    lists = {"grads": sorted(window.grads), "shards": sorted(window.shards), "sums": sorted(window.sums)}
    held = Held(flags={**window.flags, **lists})
    rank = pipeline.rank
    tensors = [(_grad_key(rank, i), g) for i, g in window.grads.items()]
    tensors += [(_shard_key(rank, b), s) for b, s in window.shards.items()]
    tensors += [(_sum_key(rank, i), s) for i, s in window.sums.items()]
    for key, t in tensors:
        held.pieces.append((key, 0, t.reshape(-1)))
        held.specs[key] = {"shape": list(t.shape), "dtype": dtype_name(t.dtype)}
    return held


def book(results: list[dict[str, Any]], optimizer: Any, pipeline: Pipeline) -> Optional[dict[str, Any]]:
    """The window entry of ``objects.pt`` from every rank's ``Held.flags`` (None: closed on every rank)."""
    flags = [r["window"] for r in results]
    if all(f is None for f in flags):
        return None
    empty = {"synced": False, "owed": False, "has_grad": [], "stepped_with": [],
             "written": [[] for _ in pipeline.buffers], "grads": [], "shards": [], "sums": []}  # fmt: skip
    return {
        "micro_step": optimizer.micro_step,
        "layout": zstate.layout_signature(pipeline),
        "ranks": [empty if f is None else f for f in flags],
        "edits": optimizer.grad_edits(),  # clips and scales asked of the coming step
    }


_REMEDY = (
    "Save at a window boundary to resume elsewhere: after opt.step(), or after opt.zero_grad() where no step uses the "
    "gradients held (a GAN generator's backward through its discriminator leaves gradients in the discriminator's "
    "optimizer, which its next iteration clears)"
)


def warn_saved(entry: Optional[dict[str, Any]], version: Path) -> None:
    """Say at WARNING that ``version`` was saved inside a window (``entry``; None: at a boundary, nothing said): its
    load is refused under another layout, which a user otherwise learns only when resuming elsewhere."""
    if entry is not None:
        stage_, world, _ = entry["layout"]
        log.warning(
            "checkpoint: %s was saved inside a gradient accumulation window (%s): it resumes only at stage %d on %s, "
            "with the same bucket size and model. %s",
            version,
            describe(entry),
            stage_,
            plural(world, "rank"),
            _REMEDY,
        )


def describe(entry: Optional[dict[str, Any]]) -> Optional[str]:
    """What a saved window (``entry``; None: none) holds, in words, for the readers that drop it."""
    if entry is None:
        return None
    holding = sum(1 for flags in entry["ranks"] if flags["grads"] or flags["shards"] or flags["sums"])
    return (
        f"open at micro-step {entry['micro_step']} of the step; {plural(holding, 'rank')} of {len(entry['ranks'])} "
        "held gradients of its earlier backward passes"
    )


def check(entry: Optional[dict[str, Any]], optimizer: Any, pipeline: Pipeline, version: Path) -> None:
    """Raise unless a saved window (``entry``; None: none) can be honoured here."""
    if entry is None:
        return
    here = zstate.layout_signature(pipeline)
    if entry["layout"] != here:
        stage_, world, _ = entry["layout"]
        raise CheckpointError(
            f"checkpoint: {version} was saved inside a gradient accumulation window (micro-step "
            f"{entry['micro_step']} of the step, gradients of earlier backward passes held) by stage {stage_} on "
            f"{plural(world, 'rank')}; those gradients resume only at the same world size, stage, bucket size and "
            f"model (here: stage {pipeline.stage} on {plural(pipeline.world_size, 'rank')}, or another layout). "
            f"{_REMEDY}; this checkpoint resumes at its own layout (load it there, call opt.zero_grad() where no step "
            "uses those gradients, and save again)"
        )
    if not entry["micro_step"] < optimizer.gradient_accumulation_steps:
        raise CheckpointError(
            f"checkpoint: {version} was saved at accumulation micro-step {entry['micro_step']}, but this optimizer "
            f"takes gradient_accumulation_steps={optimizer.gradient_accumulation_steps}"
        )
    _check_indices(entry["ranks"][pipeline.rank], pipeline, version)


def stage(
    src: TensorSource, entry: Optional[dict[str, Any]], pipeline: Pipeline, version: Path
) -> Optional[zwindow.Window]:
    """This rank's part of a saved window, read (``check`` it first); None when there is none."""
    if entry is None:
        return None
    flags = entry["ranks"][pipeline.rank]
    window = zwindow.Window({k: flags[k] for k in ("synced", "has_grad", "stepped_with", "written")})
    window.flags["owed"] = flags["owed"]
    sizes = zstate.param_numels(pipeline)
    for i in flags["grads"]:
        window.grads[i] = _read(src, _grad_key(pipeline.rank, i), sizes[i], version)
    for b in flags["shards"]:
        window.shards[b] = _read(src, _shard_key(pipeline.rank, b), zstate.shard_numels(pipeline)[b], version)
    for i in flags["sums"]:
        window.sums[i] = _read(src, _sum_key(pipeline.rank, i), sizes[i], version)
    return window


def _check_indices(flags: dict[str, Any], pipeline: Pipeline, version: Path) -> None:
    trainable = set(pipeline.has_grad)
    for key in ("has_grad", "stepped_with", "grads", "sums"):
        unknown = sorted(set(flags[key]) - trainable)
        if unknown:
            raise CheckpointError(f"checkpoint: {version}: the window names parameter {unknown[0]}, not trained here")
    count = len(pipeline.buffers)
    if len(flags["written"]) != count or any(not 0 <= b < count for b in flags["shards"]):
        raise CheckpointError(f"checkpoint: {version}: the window does not match the {count} flat buffers here")
    if flags["shards"] and any(buf.grad_flat is not None for buf in pipeline.buffers):
        raise CheckpointError(f"checkpoint: {version}: the window holds gradient shards, which stage 0-1 keep none of")
    if flags["sums"] and not pipeline.wide_local:
        raise CheckpointError(
            f"checkpoint: {version}: the window holds gradients added up in a wider grad_accum_dtype, which this "
            "optimizer does not keep (another grad_accum_dtype); save at a window boundary (after opt.step())"
        )


def _read(src: TensorSource, key: str, numel: int, version: Path) -> torch.Tensor:
    entry = src.entry(key)
    if torch.Size(entry["shape"]).numel() != numel:
        raise CheckpointError(f"checkpoint: {version}: {key} has shape {entry['shape']}, not {numel} elements")
    return src.full(key)


def apply(
    window: Optional[zwindow.Window], entry: Optional[dict[str, Any]], optimizer: Any, pipeline: Pipeline
) -> None:
    """Put the staged window back (None: start with an empty one), the micro-step count and the clips and scales
    asked of the coming step (``entry``: the saved window's entry)."""
    if window is None or entry is None:
        zwindow.clear(pipeline)
        optimizer.micro_step = 0
        optimizer.load_grad_edits(None)
        return
    zwindow.restore(pipeline, window)
    optimizer.micro_step = entry["micro_step"]
    optimizer.load_grad_edits(entry.get("edits"))  # absent from checkpoints of before it was kept
