"""What ZeRO stage 3 must know about a model that its module tree does not say: leaf modules and external parameters.

Stage 3 gathers the parameters a module holds just before the module runs and frees them after
(``stages/stage3/pipeline.py``). Two common shapes of model break that rule; these calls describe them:

- **Leaf modules** (``set_leaf_modules``; from a config's ``zero_optimization.leaf_module``,
  ``apply_leaf_config``): a module whose sub-modules run depending on the data, as a mixture of experts
  routes each rank's tokens to different experts. Every rank must gather the same parameters in the
  same order, so a leaf module's whole subtree is gathered when the leaf is entered, and its
  sub-modules get no hooks. Its gradients are reduced once the leaf's backward has ended.
- **External parameters** (``register_external_parameter``): a parameter that a module's forward reads
  although another module holds it, such as ``F.linear(h, self.embed.weight)`` in the root's forward
  (a tied output embedding). It is gathered with the reading module's own parameters. Stage 3 also
  finds such a use by itself the first time it happens inside a module's forward (and logs it once).

Both may be called before or after the optimizer is built; a stage-3 optimizer picks changes up at
the next forward of its model. Called before, a leaf module's parameters share one buffer (one
all-gather per bucket); called after, the leaf gathers the buffers of its sub-modules together.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from typing import Any, Iterable, Optional, Union

from torch import nn

from ...log import LOGGER_NAME

LEAF_ATTR = "_zero_kernels_leaf"
EXTERNAL_ATTR = "_zero_kernels_external"
logger = logging.getLogger(LOGGER_NAME)
_changes = itertools.count(1)
_generation = 0


def _changed() -> None:
    global _generation
    _generation = next(_changes)


def generation() -> int:
    """A number that changes whenever a hint is set anywhere (stage 3 re-reads the hints then)."""
    return _generation


_followed: dict[int, "weakref.ref[nn.Parameter]"] = {}
_assignments: Optional[Any] = None  # torch's global parameter-registration hook, once one parameter is followed


def follow_assignments(params: Iterable[nn.Parameter]) -> None:
    """Start a new generation whenever one of ``params`` is assigned to a module (``module.weight = p``): a weight
    tied (or untied, swapped) after the optimizer was built changes which modules read it, so stage 3 re-reads the
    plan before the next forward, as for a tie made before it was built (else the modules that now read it were
    not counted among its uses: its unit was reduced before their gradients came)."""
    global _assignments
    for p in params:
        key = id(p)
        _followed[key] = weakref.ref(p, lambda r, key=key: _followed.pop(key) if _followed.get(key) is r else None)
    if _assignments is None:
        _assignments = nn.modules.module.register_module_parameter_registration_hook(_assigned)


def _assigned(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
    ref = _followed.get(id(param)) if param is not None else None
    if ref is not None and ref() is param:
        _changed()


def set_leaf_modules(model: nn.Module, leaf_classes: Iterable[Union[type, str]]) -> list[nn.Module]:
    """Mark the modules of ``model`` (itself included) that are instances of ``leaf_classes`` as leaf modules.

    Args:
        model: the model (or any part of it).
        leaf_classes: ``nn.Module`` subclasses, or class names (matched against ``type(m).__name__``).

    Returns:
        The modules marked, in ``model.modules()`` order.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"set_leaf_modules: model must be an nn.Module, got {type(model).__name__}")
    classes = list(leaf_classes) if not isinstance(leaf_classes, (type, str)) else [leaf_classes]
    bad = [c for c in classes if not (isinstance(c, str) or (isinstance(c, type) and issubclass(c, nn.Module)))]
    if not classes or bad:
        raise ValueError(
            "set_leaf_modules: leaf_classes must be a non-empty list of nn.Module subclasses or class names, "
            f"got {bad or classes}"
        )
    types = tuple(c for c in classes if isinstance(c, type))
    names = {c for c in classes if isinstance(c, str)}
    marked = [m for m in model.modules() if isinstance(m, types) or type(m).__name__ in names]
    if not marked:
        present = sorted({type(m).__name__ for m in model.modules()})
        wanted = [c if isinstance(c, str) else c.__name__ for c in classes]
        raise ValueError(
            f"set_leaf_modules: no module of {type(model).__name__} is one of {wanted}; its classes: {present}"
        )
    return _mark_leaves(marked)


def apply_leaf_config(model: nn.Module, leaf: Any) -> list[nn.Module]:
    """Mark the modules ``zero_optimization.leaf_module`` names as leaf modules, as DeepSpeed's engine does: by
    class (``type(m).__name__`` or its ``module.QualifiedName``; by default Hugging Face's mixture-of-experts
    blocks), by name in ``model.named_modules()``, by the end of that name. An entry of a field the config gives
    (not its default) that matches no module is logged as a warning.

    Args:
        model: the model.
        leaf: a ``config.LeafModules``.

    Returns:
        The modules marked.
    """
    named = list(model.named_modules())
    found: dict[int, nn.Module] = {}
    missing = []
    defaults = type(leaf)()
    matchers = (
        ("classes", lambda entry, name, m: entry in (type(m).__name__, _qualified(m))),
        ("names", lambda entry, name, m: name == entry),
        ("name_suffixes", lambda entry, name, m: name.endswith(entry)),
    )
    for key, matches in matchers:
        entries = getattr(leaf, key)
        for entry in entries:
            hits = [m for name, m in named if matches(entry, name, m)]
            found.update((id(m), m) for m in hits)
            if not hits and entries != getattr(defaults, key):
                missing.append(f"{key} {entry!r}")
    if missing:
        logger.warning("zero_kernels: zero_optimization.leaf_module: no module of %s matches %s", type(model).__name__,
                       ", ".join(missing))  # fmt: skip
    return _mark_leaves(list(found.values()))


def mark_adapter_variants(model: nn.Module) -> list[nn.Module]:
    """Mark PEFT LoRA layers that run a variant of LoRA (DoRA: ``use_dora=True``) as leaf modules, with one log line.

    Their forward computes with their sub-modules' weights directly (DoRA reads ``lora_A.weight.shape`` and the base
    layer's weight for its norm), which a stage-3 module gathers only for itself: as a leaf, the layer gathers its
    whole subtree when it runs. Recognised without importing peft: a module of a ``peft`` package with a non-empty
    ``lora_variant`` (or a ``use_dora`` that says True for some adapter)."""
    marked = [m for m in model.modules() if _runs_adapter_variant(m) and not is_leaf(m)]
    if marked:
        logger.info(
            "ZeRO stage 3: %d PEFT LoRA layer(s) with a LoRA variant (DoRA) gathered as leaf modules (%s, ...)",
            len(marked),
            type(marked[0]).__name__,
        )
    return _mark_leaves(marked)


def register_position_tables(model: nn.Module) -> list[nn.Module]:
    """Register the position table of each Hugging Face ``*Embeddings`` module that reads its shape in its forward as
    an external parameter of that module, with one log line.

    CLIP's, SigLIP's, BLIP's and their kin's text and vision embeddings take ``self.position_embedding.weight.shape[0]``
    as the longest sequence before they call the table: a freed table has shape ``(0,)``, and the forward refused every
    sequence ("Sequence length must be less than max_position_embeddings ... 0"). Recognised without importing
    transformers: a module of a ``transformers`` package whose class name ends in ``Embeddings`` and whose
    ``position_embedding`` is an ``nn.Embedding``. Returns the modules registered for."""
    found = [m for m in model.modules() if _reads_position_table(m)]
    for m in found:
        register_external_parameter(m, m.position_embedding.weight)
    if found:
        logger.info(
            "ZeRO stage 3: the position tables of %d Hugging Face embedding module(s) (%s, ...), whose forward reads "
            "the table's shape, gathered with them",
            len(found),
            type(found[0]).__name__,
        )
    return found


def _reads_position_table(module: nn.Module) -> bool:
    kind = type(module)
    if not (kind.__module__.startswith("transformers.") and kind.__name__.endswith("Embeddings")):
        return False
    table = module._modules.get("position_embedding")
    return isinstance(table, nn.Embedding) and not any(p is table.weight for p in external_parameters(module))


def _runs_adapter_variant(module: nn.Module) -> bool:
    if not type(module).__module__.startswith("peft."):
        return False
    variants, dora = getattr(module, "lora_variant", None), getattr(module, "use_dora", None)
    return bool(isinstance(variants, dict) and variants) or bool(isinstance(dora, dict) and any(dora.values()))


def _mark_leaves(modules: list[nn.Module]) -> list[nn.Module]:
    """Mark ``modules`` as leaf modules (stage 3 reads the hints again when some were); return them."""
    for m in modules:
        setattr(m, LEAF_ATTR, True)
    if modules:
        _changed()
    return modules


def _qualified(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def is_leaf(module: nn.Module) -> bool:
    """Whether ``set_leaf_modules`` marked ``module``."""
    return bool(getattr(module, LEAF_ATTR, False))


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Say that ``module``'s forward reads ``parameter``, held by another module: stage 3 gathers it for ``module`` too.

    Args:
        module: the module whose forward reads the parameter (the model itself for code in its forward).
        parameter: a parameter of the same model, held by another module.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"register_external_parameter: module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, nn.Parameter):
        raise ValueError(
            f"register_external_parameter: parameter must be an nn.Parameter, got {type(parameter).__name__}"
        )
    registered = module.__dict__.setdefault(EXTERNAL_ATTR, [])
    if not any(p is parameter for p in registered):
        registered.append(parameter)
        _changed()


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters registered for ``module`` with ``register_external_parameter``."""
    return list(module.__dict__.get(EXTERNAL_ATTR, ()))
