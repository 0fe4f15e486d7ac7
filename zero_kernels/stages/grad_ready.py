"""When a parameter's gradient is handed to its pipeline (stages 0-2): after every hook on the parameter has run.

Autograd writes ``p.grad`` in ``p``'s gradient accumulator (its ``AccumulateGrad`` node), then runs the hooks on
``p`` itself (``register_post_accumulate_grad_hook``) in the order they were put on, then the node's own post hooks.
The pipeline takes the gradient away (stage 2 copies it into a bucket and drops ``p.grad``; stage 0 starts the
all-reduce of the buffer ``p.grad`` views), so it must come last: a hook on ``p`` put on after the optimizer was
built (one that adds noise to ``p.grad`` or scales it) would find nothing, or write into a gradient being reduced.
``GradReady`` therefore hands the gradient on from a post hook of the node, as DDP's reducer does.

The node belongs to the parameter only while its data keeps its dtype and device: giving ``p.data`` another one
makes autograd build a new node on the next backward. A hook on ``p`` itself stays through that, so one is kept
too: when it finds a node that is not the watched one, it watches the new node, whose post hooks run once the hooks
on ``p`` have (a gradient not handed on is taken from ``p.grad`` at the end of backward all the same: the round's
``_take_unreported``).

``owners`` says which pipeline handles a parameter (the one built last); the others' hooks do nothing.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch.autograd.graph import get_gradient_edge

owners: dict[int, weakref.ref] = {}  # id(param) -> the pipeline whose hooks handle it (the latest)


class GradReady:
    """Hands ``p``'s gradient to the pipeline ``ref`` points to (``_on_grad_ready``) after every hook on ``p``
    (see the module docstring); ``remove()`` takes both hooks off."""

    def __init__(self, p: torch.Tensor, ref: weakref.ref):
        self._ref = ref
        self._node: Optional[Any] = None
        self._node_handle: Optional[Any] = None
        me = weakref.ref(self)  # the hooks hold no strong reference to this object: the node would keep it alive
        self._param_handle = p.register_post_accumulate_grad_hook(lambda param: _on_accumulated(me, param))
        self._watch(p)

    def _watch(self, p: torch.Tensor) -> None:
        if self._node_handle is not None:
            self._node_handle.remove()
        me = weakref.ref(self)
        self._node = get_gradient_edge(p).node
        self._node_handle = self._node.register_hook(lambda grad_inputs, grad_outputs: _hand_on(me, p))

    def hand_on(self, p: torch.Tensor) -> None:
        pipeline = self._ref()
        if pipeline is not None and owners.get(id(p)) is self._ref:
            pipeline._on_grad_ready(p)

    def remove(self) -> None:
        self._param_handle.remove()
        if self._node_handle is not None:
            self._node_handle.remove()
        self._node = self._node_handle = None


def _on_accumulated(me: weakref.ref, p: torch.Tensor) -> None:
    ready = me()
    if ready is not None and get_gradient_edge(p).node is not ready._node:
        ready._watch(p)  # a new node, running now: its post hook hands the gradient on after the hooks on ``p``


def _hand_on(me: weakref.ref, p: torch.Tensor) -> None:
    ready = me()
    if ready is not None:
        ready.hand_on(p)
