"""Stage 3 and the model's state dicts: a state dict of shards, or a load into them, is refused with what to call.

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

``model.load_state_dict(...)`` (or a sub-module's) into emptied parameters would fail with torch's
"size mismatch ... torch.Size([0])", or with ``assign=True`` replace them: a load-state-dict
pre-hook on every module raises first, before anything is copied, naming the first emptied
parameter the state dict holds and what to do (on every rank: load inside ``gathered_params()``,
whose exit writes the values back to the shards and the fp32 masters, or
``zero_kernels.checkpoint.load`` for a checkpoint). Once the optimizer is deleted (its pipeline collected), a model
it left emptied takes ``model.load_state_dict(state_dict)`` as an ordinary model does (``_refill``), to be trained
again by another optimizer.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import guard

if TYPE_CHECKING:
    from ..base import Pipeline

WHAT_TO_CALL = (
    "on every rank, call zero_kernels.save_pretrained(model, optimizer, directory) for full weights (a Hugging "
    "Face model's save_pretrained, or a plain state dict file), or take the state dict inside "
    "`with optimizer.gathered_params():`; zero_kernels.checkpoint.save(directory, model, optimizer) writes a "
    "sharded checkpoint"
)


def _freed(pipeline: "Pipeline", p: nn.Parameter, value: Any) -> bool:
    return value.numel() == 0 and pipeline.param_shape(p).numel() != 0


class _PipelineHook:
    """A hook of ``guard_state_dict`` holding its pipeline weakly: a class, so that a model carrying it can still be
    copied or pickled; a copy holds no pipeline (its guard is inert)."""

    def __init__(self, pipeline: "Pipeline") -> None:
        self._pipeline = weakref.ref(pipeline)

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._pipeline = lambda: None


class _StateDictGuard(_PipelineHook):
    """The state-dict post-hook of ``guard_state_dict``."""

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        owner = self._pipeline()
        if owner is None:
            _refuse_orphaned(module, prefix)
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


def _refuse_orphaned(module: nn.Module, prefix: str) -> None:
    """The pipeline is gone: a parameter it emptied holds no values any more (``guard.ORPHANED``)."""
    for name, p in module.named_parameters(remove_duplicate=False):
        if guard.freed_by(p) is False:
            raise RuntimeError(
                f"ZeRO stage 3: model.state_dict() would hold an empty tensor for {prefix + name!r}: {guard.ORPHANED}"
            )


class _LoadGuard(_PipelineHook):
    """The load-state-dict pre-hook of ``guard_state_dict`` on one module: checks the loaded module's subtree once,
    where the load starts (``prefix`` empty: the module ``load_state_dict`` was called on); inert in a copy."""

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        owner = self._pipeline()
        if owner is None or prefix:
            return
        params = module.named_parameters(remove_duplicate=False)
        empty = [n for n, p in params if n in state_dict and _freed(owner, p, p)]
        if empty:
            more = f" and {len(empty) - 1} more" if len(empty) > 1 else ""
            raise RuntimeError(
                f"load_state_dict() at ZeRO stage 3 would copy into {empty[0]!r}{more}, which each rank holds only a "
                "shard of between uses (an empty tensor): nothing was loaded. On every rank, load inside `with "
                "optimizer.gathered_params(): model.load_state_dict(state_dict)` (the values go back to each rank's "
                "shard and fp32 master when the block ends), or load a zero_kernels checkpoint with "
                "zero_kernels.checkpoint.load(directory, model, optimizer)"
            )


class _Handles:
    """The hooks ``guard_state_dict`` put on a model; ``remove()`` takes them off. When the pipeline is collected
    (its optimizer deleted) the load guards come off, and the state-dict guard too unless a parameter of the model is
    still emptied (it refuses ``state_dict()`` of those): left on, a model trained by one stage-3 optimizer after
    another gathered a set of guards per optimizer."""

    def __init__(self, pipeline: "Pipeline", saving: RemovableHandle, loading: list[RemovableHandle]) -> None:
        self._saving, self._loading = [saving], loading
        self._end = weakref.finalize(pipeline, _drop_inert, self._saving, self._loading, weakref.ref(pipeline.module))
        self._end.atexit = False

    def remove(self) -> None:
        self._end.detach()
        for handle in self._saving + self._loading:
            handle.remove()
        self._saving.clear()
        self._loading.clear()


# id(model) -> (the model, its state-dict guards kept by ``_drop_inert`` and the ``_refill`` hook): they are dropped
# once no parameter of its model is left emptied (``p.data = value`` or ``model.load_state_dict`` put the values back);
# each stage-3 optimizer built again on one model left its guard there
_kept: dict[int, tuple[weakref.ref, list[RemovableHandle]]] = {}


def _drop_inert(saving: list[RemovableHandle], loading: list[RemovableHandle], model_ref: weakref.ref) -> None:
    for handle in loading:
        handle.remove()
    loading.clear()
    model = model_ref()
    if model is None or all(guard.freed_by(p) is None for p in model.parameters()):
        _remove(saving)
    else:
        kept = _kept.get(id(model))
        if kept is None or kept[0]() is not model:  # (or the entry of a collected model whose id was reused)
            kept = _kept[id(model)] = (model_ref, [model.register_load_state_dict_pre_hook(_refill)])
        kept[1].extend(saving)


def _refill(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """The load-state-dict pre-hook of a model left emptied by a collected pipeline: each emptied parameter the state
    dict holds takes its shape (uninitialised) first, so ``model.load_state_dict(state_dict)`` fills it as it fills an
    ordinary model (torch refused the load as a size mismatch with ``torch.Size([0])``)."""
    for name, p in module.named_parameters(remove_duplicate=False):
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and guard.freed_by(p) is False:
            p.data = torch.empty(value.shape, dtype=p.dtype, device=p.device)


def _drop_adopted() -> None:
    """Remove the kept guards of models that no longer hold an emptied parameter of a collected pipeline."""
    for key, (model_ref, handles) in list(_kept.items()):
        model = model_ref()
        if model is None or all(guard.freed_by(p) is not False for p in model.parameters()):
            _remove(handles)
            del _kept[key]


def _remove(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def guard_state_dict(pipeline: "Pipeline") -> _Handles:
    """Refuse ``state_dict()`` of ``pipeline.module`` while it would hold emptied stage-3 parameters, and
    ``load_state_dict()`` of it or of any of its modules into emptied parameters.

    Args:
        pipeline: the stage-3 pipeline (its ``module`` and sub-modules get the hooks).
    """
    _drop_adopted()
    saving = pipeline.module.register_state_dict_post_hook(_StateDictGuard(pipeline))
    load_guard = _LoadGuard(pipeline)
    loading = [m.register_load_state_dict_pre_hook(load_guard) for m in pipeline.module.modules()]
    return _Handles(pipeline, saving, loading)
