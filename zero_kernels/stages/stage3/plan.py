"""Stage 3: which module gathers which parameters, from the module tree and the hints of ``model_hints``.

- ``holders(root)``: the module whose buffer (unit) each parameter joins: the first module in
  ``root.modules()`` order that holds it directly, or, inside a leaf module, the outermost leaf.
- ``plan(root, owner)``: per module that runs hooks, the units it needs: the units of the parameters
  it holds directly (a leaf: of every parameter in its subtree) and of its external parameters. The
  sub-modules of a leaf module get no hooks; a leaf's external parameters include those registered
  on its sub-modules. ``check_externals(root)`` refuses external parameters the model does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Container, Iterator, Optional

from torch import nn

from .model_hints import external_parameters, is_leaf


@dataclass(frozen=True)
class ModulePlan:
    """What one module gathers around its forward (and its backward)."""

    module: nn.Module
    name: str  # qualified name in the model ('' for the root)
    needs: tuple[int, ...]  # indices of the units, sorted
    leaf: bool
    params: tuple[nn.Parameter, ...] = ()  # what it uses: held directly (a leaf: in its subtree) and external


_CALLED_BY_PARENT = (nn.ParameterDict, nn.ParameterList)  # never called: their parameters serve the parent's forward


def _walk(root: nn.Module) -> Iterator[tuple[str, nn.Module, Optional[nn.Module]]]:
    """(name, module, outermost leaf containing it or None), in ``root.modules()`` order; a ``ParameterDict`` or
    ``ParameterList`` (never called) gets its parent as its leaf: the parent's forward uses its parameters (PEFT's
    ``lora_A``, ``lora_embedding_A``)."""
    seen: set[int] = set()

    def visit(name: str, module: nn.Module, leaf: Optional[nn.Module]) -> Iterator:
        if id(module) in seen:
            return
        seen.add(id(module))
        if leaf is None and is_leaf(module):
            leaf = module
        yield name, module, leaf
        for child_name, child in module.named_children():
            inner = module if leaf is None and isinstance(child, _CALLED_BY_PARENT) else leaf
            yield from visit(f"{name}.{child_name}" if name else child_name, child, inner)

    yield from visit("", root, None)


def holders(root: nn.Module) -> dict[int, int]:
    """id(parameter) -> index in ``root.modules()`` of the module whose unit the parameter joins."""
    index = {id(m): i for i, m in enumerate(root.modules())}
    holder: dict[int, int] = {}
    for _, module, leaf in _walk(root):
        for p in module.parameters(recurse=False):
            holder.setdefault(id(p), index[id(leaf if leaf is not None else module)])
    return holder


def check_externals(root: nn.Module, trained: Container[int] = ()) -> None:
    """Raise ``ValueError`` if a module of ``root`` registered an external parameter that ``root`` does not hold.

    Args:
        root: the model.
        trained: ``id`` of parameters the optimizer holds: one of them no longer in the model was tied away since
            (``model.head.weight = model.embed.weight``), its registration stale, not wrong.
    """
    known = {id(p) for p in root.parameters()}
    for name, module, _ in _walk(root):
        for p in external_parameters(module):
            if id(p) not in known and id(p) not in trained:
                raise ValueError(
                    f"register_external_parameter: a parameter of shape {tuple(p.shape)} registered on module "
                    f"'{name}' ({type(module).__name__}) is not a parameter of the model"
                )


def plan(root: nn.Module, owner: dict[int, int]) -> list[ModulePlan]:
    """The modules of ``root`` that need units (``owner``: id(parameter) -> unit), and the root, first.

    Args:
        root: the model.
        owner: the unit of each parameter that has one (frozen parameters have none).
    """
    check_externals(root, owner)
    known = {id(p) for p in root.parameters()}  # an external parameter tied away since is read by no module
    needs: dict[int, set[int]] = {}
    params: dict[int, dict[int, nn.Parameter]] = {}
    names: dict[int, tuple[str, nn.Module, bool]] = {}
    for name, module, leaf in _walk(root):
        target = leaf if leaf is not None else module
        if target is module:
            names[id(module)] = (name, module, leaf is not None)
        externals = [p for p in external_parameters(module) if id(p) in known]
        used = [p for p in (*module.parameters(recurse=False), *externals) if id(p) in owner]
        needs.setdefault(id(target), set()).update(owner[id(p)] for p in used)
        params.setdefault(id(target), {}).update((id(p), p) for p in used)
    return [
        ModulePlan(module, name, tuple(sorted(needs[key])), leaf, tuple(params[key].values()))
        for key, (name, module, leaf) in names.items()
        if needs[key] or module is root
    ]
