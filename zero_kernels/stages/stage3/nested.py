"""Tensors inside what a module takes or returns: found (``tensors``) and replaced (``replace``).

Looked into: tuples and lists (their subclasses too: named tuples, ``PackedSequence``), dicts (``OrderedDict``,
Hugging Face's ``ModelOutput``, a dict that mirrors its keys as attributes) and dataclass instances. Any other
object is taken as it is: tensors kept in its attributes are not seen.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch


def _items(obj: Any) -> list[Any]:
    """What ``obj`` holds, as ``tensors`` looks into it (empty for a tensor or an object it does not open)."""
    if isinstance(obj, (tuple, list)):
        return list(obj)
    if isinstance(obj, dict):
        return list(obj.values())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return []


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside ``obj`` (``obj`` itself when it is one), in order, repeats included; a container
    inside itself is looked into once."""
    return _tensors(obj, frozenset())


def _tensors(obj: Any, inside: frozenset[int]) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if id(obj) in inside:
        return []
    return [t for item in _items(obj) for t in _tensors(item, inside | {id(obj)})]


def replace(obj: Any, new: dict[int, torch.Tensor]) -> Any:
    """``obj`` with each tensor that ``new`` holds (by ``id``) replaced by ``new[id(tensor)]``: containers are
    rebuilt as shallow copies of their own type (a dict's attributes that were its old values, and a tuple
    subclass's attributes, carried over), and returned untouched where nothing inside changed."""
    return _replace(obj, new, frozenset())


def _replace(obj: Any, new: dict[int, torch.Tensor], inside: frozenset[int]) -> Any:
    if isinstance(obj, torch.Tensor):
        return new.get(id(obj), obj)
    if id(obj) in inside:  # a container inside itself keeps pointing at the original
        return obj
    items = _items(obj)
    fresh = [_replace(item, new, inside | {id(obj)}) for item in items]
    if all(a is b for a, b in zip(fresh, items)):
        return obj
    if isinstance(obj, tuple):
        return _tuple(obj, fresh)
    out = copy.copy(obj)
    if isinstance(obj, list):
        out[:] = fresh
    elif isinstance(obj, dict):
        for key, value in zip(list(obj), fresh):
            out[key] = value
        _mirrored(out, new)
    else:
        for field, value in zip(dataclasses.fields(obj), fresh):
            object.__setattr__(out, field.name, value)  # a frozen dataclass too
    return out


def _tuple(obj: tuple, items: list[Any]) -> tuple:
    """A tuple of ``obj``'s type holding ``items``: a named tuple through its fields, another subclass without
    calling its constructor (which may take other arguments), with its attributes."""
    if type(obj) is tuple:
        return tuple(items)
    if hasattr(obj, "_fields"):
        return type(obj)(*items)
    out = tuple.__new__(type(obj), items)
    if hasattr(obj, "__dict__"):
        out.__dict__.update(obj.__dict__)
    return out


def _mirrored(out: dict, new: dict[int, torch.Tensor]) -> None:
    """The attributes of a dict subclass that still hold a replaced tensor (keys mirrored as attributes) get
    its replacement."""
    attributes = getattr(out, "__dict__", None)
    if attributes is None or attributes is out:
        return
    for name, value in list(attributes.items()):
        if isinstance(value, torch.Tensor) and id(value) in new:
            attributes[name] = new[id(value)]
