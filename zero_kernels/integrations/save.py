"""Saving full weights from a sharded optimizer; the Hugging Face Trainer (``integrations.hf``) and
Accelerate (``integrations.accelerate``).

``save_pretrained(model, optimizer, directory)`` is what to call, on every rank, where a plain loop
would call ``model.save_pretrained(directory)`` or ``torch.save(model.state_dict(), path)``: at stage
3 it gathers the parameters one unit at a time into a state dict in rank 0's host memory (each rank holds only
its shard between uses, and a model that fits only at stage 3 does not fit whole: ``stage3.consolidated``), rank 0
writes, and every rank returns once the files are there. The ranks agree on the outcome, so a failed write on rank 0
raises on every rank instead of leaving the others waiting.

``integrations.hf`` needs ``transformers``, ``integrations.accelerate`` needs ``accelerate`` (both in
``pip install 'zero_kernels[hf]'``); this module needs neither.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..stages.stage3.consolidated import model_state_dict
from ..stages.stage3.pipeline import Stage3Pipeline
from ..wording import plural

STATE_DICT_FILE = "model_state_dict.pt"


def agree(optimizer: Any, ok: bool, what: str) -> None:
    """Every rank learns whether every rank succeeded at ``what``; RuntimeError on all of them if not.

    Args:
        optimizer: the ``ShardedFusedAdam`` whose ranks take part.
        ok: whether this rank succeeded.
        what: what was done, for the message.
    """
    engine = optimizer.pipeline.engine
    failed = torch.tensor([0.0 if ok else 1.0], dtype=torch.float64)
    if engine.world_size > 1:
        device = optimizer.pipeline.buffers[0].device if optimizer.pipeline.buffers else failed.device
        failed = failed.to(device)
        engine.all_reduce(failed, op="sum", name="save.outcome").wait()
    if failed.item() and ok:
        raise RuntimeError(f"{what} failed on {plural(int(failed.item()), 'other rank')}; see their error")


def save_pretrained(model: nn.Module, optimizer: Any, save_directory: str | os.PathLike, **kwargs: Any) -> None:
    """Write ``model``'s full weights to ``save_directory`` at any stage (a collective: call it on every rank).

    A Hugging Face model is written by its own ``save_pretrained(save_directory, **kwargs)`` (so
    ``from_pretrained(save_directory)`` loads it); any other module as ``model_state_dict.pt``,
    loadable with ``model.load_state_dict(torch.load(path))``. Rank 0 writes.

    Args:
        model: the model ``optimizer`` trains.
        optimizer: its ``ShardedFusedAdam``.
        save_directory: the output directory (created by rank 0).
        **kwargs: passed to the model's ``save_pretrained`` (e.g. ``safe_serialization``).
    """
    rank = optimizer.pipeline.engine.rank
    ok = True
    try:
        if sharded_params(optimizer) and "state_dict" not in kwargs:
            state = model_state_dict(optimizer.pipeline, model, keep=rank == 0)
            if rank == 0:
                _write(model, save_directory, kwargs, state)
        else:
            with optimizer.gathered_params():
                if rank == 0:
                    _write(model, save_directory, kwargs)
    except Exception:
        ok = False
        agree(optimizer, ok, "save_pretrained")
        raise
    agree(optimizer, ok, "save_pretrained")


def sharded_params(optimizer: Any) -> bool:
    """Whether ``optimizer`` shards the parameters (stage 3): full weights are then gathered a unit at a time
    (``stages.stage3.consolidated``), not all at once."""
    return isinstance(optimizer.pipeline, Stage3Pipeline)


def _write(
    model: nn.Module,
    save_directory: str | os.PathLike,
    kwargs: dict[str, Any],
    state: Optional[dict[str, Any]] = None,
) -> None:
    """Rank 0's write: ``state`` (None: the model's own state dict, whole at the time)."""
    os.makedirs(save_directory, exist_ok=True)
    if hasattr(model, "save_pretrained"):
        with _writes_here(model):
            model.save_pretrained(save_directory, **kwargs, **({} if state is None else {"state_dict": state}))
    else:
        torch.save(model.state_dict() if state is None else state, os.path.join(save_directory, STATE_DICT_FILE))


@contextlib.contextmanager
def _writes_here(model: nn.Module) -> Iterator[None]:
    """Transformers 5's ``save_pretrained`` writes only on the world's rank 0 (``should_save_on_this_rank``); the
    writer is rank 0 of the optimizer's process group, another rank where that group is not the world (which
    wrote nothing, silently): inside, ``model`` writes on this rank. On the world's rank 0 the model's own rule
    stands (a class of its own may decline)."""
    elsewhere = torch.distributed.is_initialized() and torch.distributed.get_rank() != 0
    if not elsewhere or not hasattr(model, "should_save_on_this_rank"):
        yield
        return
    own = vars(model).get("should_save_on_this_rank")
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        yield
    finally:
        if own is None:
            del model.should_save_on_this_rank
        else:
            model.should_save_on_this_rank = own
