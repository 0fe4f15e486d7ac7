"""Stage 3 on several ranks: Hugging Face's ``generate`` keeps every rank running forwards until all are done.

Each new token is a forward, which gathers: a rank whose generation ends first (an end-of-text token, a shorter
``max_new_tokens``) must go on running forwards until every rank is done, or the ranks' gathers fall out of step
(a hang, or an abort inside the backend). ``generate(..., synced_gpus=True)`` does that; Hugging Face turns it on
by itself only under DeepSpeed's ZeRO-3 or FSDP, and trainers that generate (TRL's GRPO, a ``Seq2SeqTrainer``'s
``predict_with_generate``) do not pass it. ``sync_generate`` gives each module of the model whose class has Hugging
Face's ``generate`` (``GenerationMixin`` among its bases) a ``generate`` whose ``synced_gpus`` is True unless the
caller gives a value (``None`` counts as none), as DeepSpeed's ZeRO-3 makes it: an attribute of that module, a
method bound to it. Only the modules ``sync_generate`` gave it to (held weakly) default so: a deep copy of the model
(an unsharded copy, generating on one rank) or one loaded from a pickle generates as Hugging Face's own, unless an
optimizer of its own syncs it. ``restore`` takes it off (the pipeline's ``close``).
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from . import module_methods

_synced: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # the modules a stage-3 pipeline syncs now


def generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The class's ``generate``, with ``synced_gpus=True`` unless given where this module is synced."""
    if self in _synced and kwargs.get("synced_gpus") is None:
        kwargs["synced_gpus"] = True
    return type(self).generate(self, *args, **kwargs)


def _generates(module: nn.Module) -> bool:
    return any(c.__name__ == "GenerationMixin" for c in type(module).__mro__)


def sync_generate(model: nn.Module) -> list[nn.Module]:
    """Give the modules of ``model`` that generate (see the module docstring) the synced ``generate``, where they have
    none of their own yet (``module_methods.put_on``); returns them."""
    synced = module_methods.put_on(model, "generate", generate, _generates)
    _synced.update(synced)
    return synced


def generates_synced(model: nn.Module) -> bool:
    """Whether a module of ``model`` has the synced ``generate`` (a live stage-3 pipeline on several ranks)."""
    return any(module in _synced for module in model.modules())


def restore(modules: list[nn.Module]) -> None:
    """Take the synced ``generate`` off ``modules`` (where it is still the one ``sync_generate`` gave)."""
    for module in modules:
        _synced.discard(module)
    module_methods.take_off(modules, "generate", generate)
