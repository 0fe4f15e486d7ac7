"""When a parameter's gradient is handed to its pipeline (stages 0-2): after every hook on the parameter has run.

Autograd writes ``p.grad`` in ``p``'s gradient accumulator (its ``AccumulateGrad`` node), then runs the hooks on
``p`` itself (``register_post_accumulate_grad_hook``) in the order they were put on, then the node's own post hooks.
The pipeline takes the gradient away (stage 2 copies it into a bucket and drops ``p.grad``; stage 0 starts the
all-reduce of the buffer ``p.grad`` views), so it must come last: a hook on ``p`` put on after the optimizer was
built (one that adds noise to ``p.grad``, scales it or drops it) would find nothing, or write into a gradient being
reduced.

``GradReady`` puts a hook on ``p`` that keeps itself last. Each time it runs it looks at the hooks after it (a walk
from the end of ``p``'s hook table that stops at once where it is last, as it is but for the first backward after a
user's hook came): where a user's hook follows, it moves itself to the end of the table for the backwards to come,
and this once hands the gradient on from a post hook of the running node (``get_gradient_edge``), which the engine
runs after every hook on ``p`` (those put on while the node ran included). No node is kept: autograd makes a new one
for each graph, with the parameter's shape of that moment (a node kept across ``p.data = <another shape>``, as
``resize_token_embeddings`` assigns, would make torch refuse the next backward before the optimizer could say what
happened). A parameter whose hook dropped its gradient (``p.grad = None``) has none this round, as for AdamW. After a
user's hook returned a value torch runs the hooks left with ``p``'s hook table unset and then fails the backward
saying hooks return None: nothing is handed on then.

``owners`` says which pipeline handles a parameter (the one built last; where that one is gone, closed or collected,
the first live one whose hook runs takes it back); the others' hooks do nothing. Only pipelines that leave the
gradient in ``p.grad`` share parameters (``stages.ownership.check_step`` refuses the older one's step otherwise).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch.autograd.graph import get_gradient_edge

from .eager import weakly

owners: dict[int, weakref.ref] = {}  # id(param) -> the pipeline whose hooks handle it (the latest)
_OURS = "zero_kernels_grad_ready"  # an attribute of the hooks GradReady puts on


class GradReady:
    """Hands ``p``'s gradient to the pipeline ``ref`` points to (``_on_grad_ready``) after every hook on ``p``
    (see the module docstring); ``remove()`` takes its hook off."""

    def __init__(self, p: torch.Tensor, ref: weakref.ref):
        self._ref = ref
        hook = weakly(self._accumulated)  # no strong reference to this object; eager under a compiled train step
        setattr(hook, _OURS, True)
        self._handle = p.register_post_accumulate_grad_hook(hook)

    def hand_on(self, p: torch.Tensor) -> None:
        pipeline = self._ref()
        if pipeline is None or p.grad is None:
            return
        owner = owners.get(id(p))
        if owner is not self._ref and (owner is None or owner() is None):
            owners[id(p)] = owner = self._ref  # the pipeline built later on it is gone: this one takes it back
        if owner is self._ref:
            pipeline._on_grad_ready(p)

    def _accumulated(self, p: torch.Tensor) -> None:
        _on_accumulated(weakref.ref(self), p)

    def remove(self) -> None:
        self._handle.remove()


def _on_accumulated(me: weakref.ref, p: torch.Tensor) -> None:
    ready = me()
    if ready is None:
        return
    hooks: OrderedDict[int, Callable[..., Any]] = p._post_accumulate_grad_hooks
    if hooks is None:  # unset by torch after a hook returned a value: torch raises saying so once all have run
        return
    key = ready._handle.id
    if not _user_hook_after(hooks, key):
        ready.hand_on(p)
        return
    hooks[key] = hooks.pop(key)  # last from the next backward on
    handed: list[bool] = []

    def after_hooks(grad_inputs: Any, grad_outputs: Any) -> None:
        later = me()
        if later is not None and not handed:
            handed.append(True)
            later.hand_on(p)

    get_gradient_edge(p).node.register_hook(after_hooks)


def _user_hook_after(hooks: OrderedDict[int, Callable[..., Any]], key: int) -> bool:
    """Whether a hook that is not one of ``GradReady``'s comes after the one under ``key``."""
    for k in reversed(hooks):
        if k == key:
            return False
        if not getattr(hooks[k], _OURS, False):
            return True
    return False
