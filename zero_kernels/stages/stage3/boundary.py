"""Stage 3: a module's outputs routed through one autograd node of that module, where its backward starts.

The gathers of a module's units for its backward must come at the same point of the backward on every
rank, and before the reduction of those units (``stage3.uses``, which fires from hooks on the module's
inputs). The node that made an output is not such a point: where a rank's output is the module's input
(``return h + h @ self.w2 if use else h``) that node lies outside the module and runs after the input's
hooks, and where it is a child module's output the node is the child's too; the other ranks, whose
output the module made itself, would issue their gathers and reductions in another order. So every
tensor output that requires grad goes through one node made when the module's forward returns: its
backward (calling ``on_backward``) runs before any node the forward created, and after the hooks on the
outputs (the next module's inputs), on every rank alike.

The node copies nothing and saves nothing. An output the caller cannot reach another way (made inside
the forward, or a view of such a tensor) comes out as an alias that is no view, so in-place operations on
it work as on the output itself. An output that shares its storage with an input or with another output,
or that is a leaf, comes out as a view of it (autograd's rule for a tensor a custom function returns
as is): modifying it in place then raises autograd's error (clone it first) instead of giving gradients
that miss the modification.

An output that views a gathered parameter of the module (``return self.pos[:n]``, or is the parameter) would read
freed memory once the module's units are freed at its exit: it comes out as a copy (``copy_views``).

Both run in the module's first forward hook, so the module's other forward hooks (a user's) see and keep what
the caller gets; where one of them replaces the output, the replacement is routed again in the module's last
hook (``stage3.hooks``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Container, Mapping, Optional, Sequence

import torch
from torch import nn

from . import nested
from .uses import grad_tensors


class ModuleOutput(torch.autograd.Function):
    """Identity on a module's outputs; its backward calls ``on_backward`` first."""

    @staticmethod
    def forward(ctx: Any, on_backward: Callable[[], Any], as_is: tuple[bool, ...], *tensors: torch.Tensor) -> Any:
        ctx.set_materialize_grads(False)
        ctx.on_backward = on_backward
        return tuple(t if keep else t.detach() for keep, t in zip(as_is, tensors))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.on_backward()
        return (None, None, *grads)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def copy_views(output: Any, params: Sequence[nn.Parameter], managed: Container[int] = ()) -> Any:
    """``output`` with each tensor that shares the storage of ``params`` (gathered parameters that will be freed:
    ``return self.pos[:n]``, ``return self.pos``), or is a parameter whose id is in ``managed`` (one stage 3 may
    free, such as a child's: its copy gathers it first), replaced by a copy, through autograd (gradients reach
    the parameter as through the view), where it would read freed memory."""
    storages = {_storage(p) for p in params} - {0}
    views = [t for t in nested.tensors(output) if id(t) in managed or _storage(t) in storages]
    return nested.replace(output, {id(t): t.clone() for t in views}) if views else output


def route_outputs(
    output: Any, inputs: Any, on_backward: Callable[[], Any], routed: Optional[Mapping[int, torch.Tensor]] = None
) -> Any:
    """``output`` with its tensors that require grad routed through one ``ModuleOutput`` node (``output`` itself
    where none does), except those in ``routed`` (by id: the outputs of an earlier node of the same call);
    ``inputs``: the module's arguments."""
    routed = routed or {}
    tensors = [t for t in {id(t): t for t in grad_tensors(output)}.values() if routed.get(id(t)) is not t]
    if not tensors:
        return output
    taken = {_storage(t) for t in nested.tensors(inputs)}
    shared = Counter(_storage(t) for t in tensors)
    as_is = tuple(
        (t._base if t._is_view() else t).grad_fn is None or _storage(t) in taken or shared[_storage(t)] > 1
        for t in tensors
    )
    routed_now = ModuleOutput.apply(on_backward, as_is, *tensors)
    return nested.replace(output, {id(t): r for t, r in zip(tensors, routed_now)})
