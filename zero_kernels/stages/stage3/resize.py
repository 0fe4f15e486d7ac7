"""Stage 3: Hugging Face's ``resize_token_embeddings`` called on the model between uses says what to do.

Between uses the input embedding holds an empty tensor of shape ``(0,)``, so Hugging Face's resize fails in its own
code with ``ValueError: not enough values to unpack (expected 2, got 1)``, which names neither the parameter nor the
cause. ``guard_resize`` gives each module of the model whose class has ``resize_token_embeddings`` one (a method
bound to that module) that raises first, where the input embedding's weight is freed, a ``ValueError`` naming it and
the remedy: resize before building the optimizer. Inside ``gathered_params()`` the weight is whole and the class's
own method runs (the block then refuses the shape change itself). ``restore`` takes it off (the pipeline's ``close``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ... import live
from . import module_methods
from .guard import ORPHANED


def resize_token_embeddings(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The class's ``resize_token_embeddings``, refused with advice where the input embedding is freed."""
    embedding = self.get_input_embeddings()
    weight = getattr(embedding, "weight", None)
    if weight is not None and weight.numel() == 0 and getattr(weight, "ds_numel", 0) > 0:
        if id(weight) not in live.owners():  # ``del opt`` took the values: this method stays on the model
            raise ValueError(f"resize_token_embeddings: the input embedding's weight is freed: {ORPHANED}")
        raise ValueError(
            f"resize_token_embeddings at ZeRO stage 3 after the optimizer was built: the input embedding's weight "
            f"(full shape {tuple(weight.ds_shape)}) is freed between uses on every rank, and a built optimizer "
            "cannot follow a change of its shape; resize the model before building the optimizer (zk.initialize / "
            "ShardedFusedAdam)"
        )
    return type(self).resize_token_embeddings(self, *args, **kwargs)


def guard_resize(model: nn.Module) -> list[nn.Module]:
    """Give the modules of ``model`` whose class resizes token embeddings the guarded method, where they have none of
    their own yet (``module_methods.put_on``); returns them."""
    return module_methods.put_on(model, "resize_token_embeddings", resize_token_embeddings, _resizes)


def _resizes(module: nn.Module) -> bool:
    return callable(getattr(type(module), "resize_token_embeddings", None))


def restore(modules: list[nn.Module]) -> None:
    """Take the guarded method off ``modules`` (where it is still the one ``guard_resize`` gave)."""
    module_methods.take_off(modules, "resize_token_embeddings", resize_token_embeddings)
