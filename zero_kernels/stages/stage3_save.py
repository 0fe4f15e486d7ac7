"""Stage 3 and ``model.state_dict()``: a state dict of shards is refused, with what to call instead.

Between uses a stage-3 parameter is an empty tensor and each rank holds only its shard, so
``model.state_dict()`` (and Hugging Face ``save_pretrained``, which calls it) would write empty
weights without a word. Gathering inside ``state_dict()`` is no way out: it is a collective, and
``state_dict()`` is commonly called on one rank only, where it would wait forever. So a
state-dict hook raises instead, naming the first emptied parameter and what to call (on every
rank): ``zero_kernels.save_pretrained(model, opt, directory)`` for full weights,
``with opt.gathered_params(): model.state_dict()``, or ``zero_kernels.checkpoint.save``.

Allowed: state dicts taken inside ``gathered_params()`` (every parameter is whole), and
``state_dict(keep_vars=True)``, which returns the ``Parameter`` objects themselves for code that
handles the sharded layout (``zero_kernels.checkpoint``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from .base import Pipeline

WHAT_TO_CALL = (
    "on every rank, call zero_kernels.save_pretrained(model, optimizer, directory) for full weights (a Hugging "
    "Face model's save_pretrained, or a plain state dict file), or take the state dict inside "
    "`with optimizer.gathered_params():`; zero_kernels.checkpoint.save(directory, model, optimizer) writes a "
    "sharded checkpoint"
)


def _freed(pipeline: "Pipeline", p: nn.Parameter, value: Any) -> bool:
    return value.numel() == 0 and pipeline.param_shape(p).numel() != 0


class _StateDictGuard:
    """The state-dict post-hook of ``guard_state_dict``: a class, so that a model carrying it can still be
    copied or pickled (a copy's guard is inert)."""

    def __init__(self, pipeline: "Pipeline") -> None:
        self._pipeline = weakref.ref(pipeline)

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._pipeline = lambda: None

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        owner = self._pipeline()
        if owner is None:
            return
        empty = []
        for name, p in module.named_parameters(remove_duplicate=False):
            value = state_dict.get(prefix + name)
            if isinstance(value, nn.Parameter):
                return  # keep_vars=True: the caller handles the sharded layout itself
            if value is not None and _freed(owner, p, value):
                empty.append(prefix + name)
        if empty:
            more = f" and {len(empty) - 1} more" if len(empty) > 1 else ""
            raise RuntimeError(
                f"model.state_dict() at ZeRO stage 3 would hold an empty tensor for {empty[0]!r}{more}: between "
                f"uses each rank keeps only its shard of the parameters. {WHAT_TO_CALL}"
            )


def guard_state_dict(pipeline: "Pipeline") -> RemovableHandle:
    """Refuse ``pipeline.module.state_dict()`` while it would hold emptied stage-3 parameters.

    Args:
        pipeline: the stage-3 pipeline (its ``module`` gets the hook).
    """
    return pipeline.module.register_state_dict_post_hook(_StateDictGuard(pipeline))
