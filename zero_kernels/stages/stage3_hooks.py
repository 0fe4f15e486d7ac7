"""When stage 3 gathers, frees, prefetches and reduces: module hooks driving abstract parameter units.

This module decides *when*; how a unit's parameters are laid out, gathered and reduced belongs to
the unit object (see ``Unit``). A unit owns a disjoint set of parameters; the stage-3 pipeline
builds one per module with direct parameters (``recurse=False``), so a module's forward needs the
units owning its direct parameters (several with weight tying: a tied parameter belongs to the
first module that lists it and is needed by every module that lists it).

Schedule, per module ``m`` that needs units:

- forward pre-hook: gather ``m``'s units (wait for them), then start gathers of the units that come
  next in the previous forward's order, up to ``prefetch_numel`` elements ahead;
- forward post-hook: free ``m``'s units once no running module uses them; when autograd records
  the forward, hook ``m``'s outputs so that the first gradient reaching them gathers ``m``'s units
  again (before ``m``'s backward runs), prefetching along the previous backward's order;
- post-accumulate-grad hook on each trainable parameter: once every trainable parameter of a unit
  has its gradient, ``reduce_grads()`` the unit and free it;
- end of backward (an autograd-engine callback): units whose trainable parameters did not all get
  a gradient are reduced then, in unit order (every rank issues the same collectives in the same
  order as long as every rank runs the same graph), and everything still gathered is freed.

Persistent units are never gathered or freed here (they stay full); their gradients are reduced
like any other's. ``hold()`` keeps every unit gathered until ``release()`` (``gathered_params``).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

_FREE, _IN_FLIGHT, _READY = "free", "in-flight", "ready"


class Unit(Protocol):
    """The parameters the scheduler gathers, frees and reduces together."""

    params: Sequence[nn.Parameter]  # owned parameters; no parameter belongs to two units
    numel: int  # elements one gather brings in; counted against the prefetch budget
    persistent: bool  # always gathered: the scheduler never gathers nor frees it

    def start_gather(self) -> None:
        """Issue the gather of the full parameters (may return before it completes)."""

    def finish_gather(self) -> None:
        """Wait for the gather started last and give each parameter its full value."""

    def free(self) -> None:
        """Drop the full parameters (each keeps its ``Parameter`` object)."""

    def reduce_grads(self) -> None:
        """Reduce the gradients of the parameters into this rank's shard; a missing ``.grad`` is no gradient."""


class _Pass:
    """Order of unit uses in one forward or backward pass, and the order expected from the last one."""

    def __init__(self) -> None:
        self.expected: list[int] = []
        self.recorded: list[int] = []
        self.on_track = True

    def begin(self, guess: Optional[list[int]] = None) -> None:
        if guess is not None and not self.expected:
            self.expected = guess
        self.recorded = []
        self.on_track = True

    def record(self, index: int) -> list[int]:
        """Record a use of unit ``index``; return the units expected to follow (empty once off track)."""
        pos = len(self.recorded)
        self.recorded.append(index)
        self.on_track = self.on_track and pos < len(self.expected) and self.expected[pos] == index
        return self.expected[pos + 1 :] if self.on_track else []

    def end(self) -> None:
        self.expected = self.recorded
        self.recorded = []


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors requiring grad inside nested tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _grad_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _grad_tensors(item)]
    return []


class Stage3Scheduler:
    """Installs the hooks on ``root`` and its sub-modules; ``remove()`` takes them off again.

    Args:
        root: the model; its forward marks the start and end of a forward pass.
        units: parameter units; parameters of ``root`` that no unit owns are left alone.
        prefetch_numel: how many elements may be gathered ahead of use (0 disables prefetch).
    """

    def __init__(self, root: nn.Module, units: Sequence[Unit], *, prefetch_numel: int) -> None:
        if prefetch_numel < 0:
            raise ValueError(f"stage3_prefetch_bucket_size must be >= 0, got {prefetch_numel}")
        self.units = list(units)
        self.prefetch_numel = prefetch_numel
        self._owner = self._owners(self.units)
        self._state = [_READY if u.persistent else _FREE for u in self.units]
        self._in_use = [0] * len(self.units)
        self._used = [False] * len(self.units)  # the gathered copy served a module since its gather
        self._ready_grads: list[set[int]] = [set() for _ in self.units]
        self._reduced: set[int] = set()
        self._forward, self._backward = _Pass(), _Pass()
        self._in_forward = self._in_backward = self._held = False
        self._handles: list[RemovableHandle] = []
        self._install(root)

    @staticmethod
    def _owners(units: Sequence[Unit]) -> dict[int, int]:
        owner: dict[int, int] = {}
        for i, unit in enumerate(units):
            for p in unit.params:
                if id(p) in owner:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} belongs to units {owner[id(p)]} and {i}")
                owner[id(p)] = i
        return owner

    def _install(self, root: nn.Module) -> None:
        for module in root.modules():
            owned = [self._owner[id(p)] for p in module.parameters(recurse=False) if id(p) in self._owner]
            needs = tuple(sorted(set(owned)))
            if needs:
                self._handles.append(module.register_forward_pre_hook(self._pre_forward_hook(needs)))
                self._handles.append(module.register_forward_hook(self._post_forward_hook(needs)))
        self._handles.append(root.register_forward_pre_hook(self._root_pre_forward, prepend=True))
        self._handles.append(root.register_forward_hook(self._root_post_forward))
        for i, unit in enumerate(self.units):
            for p in unit.params:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready_hook(i)))

    def remove(self) -> None:
        """Take every hook off; parameters stay as they are."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- gather / free bookkeeping ------------------------------------------------------------

    def _start(self, i: int) -> None:
        if self._state[i] == _FREE:
            self.units[i].start_gather()
            self._state[i] = _IN_FLIGHT

    def _finish(self, i: int) -> None:
        self._start(i)
        if self._state[i] == _IN_FLIGHT:
            self.units[i].finish_gather()
            self._state[i] = _READY

    def _free(self, i: int) -> None:
        if self.units[i].persistent or self._held or self._in_use[i] or self._state[i] == _FREE:
            return
        self._finish(i)
        self.units[i].free()
        self._state[i] = _FREE
        self._used[i] = False

    def _gather(self, needs: tuple[int, ...], step: _Pass, active: bool) -> None:
        """Gather ``needs`` now and prefetch what ``step`` expects next (only inside a pass)."""
        ahead: list[int] = []
        for i in needs:
            if self.units[i].persistent:
                continue
            if active and not self._used[i]:
                ahead = step.record(i)
            self._start(i)
        self._prefetch(ahead)
        for i in needs:
            self._finish(i)
            self._used[i] = True

    def _prefetch(self, ahead: list[int]) -> None:
        budget = self.prefetch_numel
        for j in ahead:
            if self.units[j].numel > budget:
                return
            budget -= self.units[j].numel
            if not self._in_use[j]:
                self._start(j)

    def _free_all(self) -> None:
        for i in range(len(self.units)):
            self._free(i)

    # -- forward ------------------------------------------------------------------------------

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if not self._in_forward:
            self._in_forward = True
            self._forward.begin()

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._in_forward:
            self._in_forward = False
            self._forward.end()
            self._free_all()

    def _pre_forward_hook(self, needs: tuple[int, ...]):
        def hook(module: nn.Module, args: Any) -> None:
            self._gather(needs, self._forward, self._in_forward)
            for i in needs:
                self._in_use[i] += 1

        return hook

    def _post_forward_hook(self, needs: tuple[int, ...]):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for i in needs:
                self._in_use[i] -= 1
                self._free(i)
            tensors = _grad_tensors(output)
            if tensors and torch.is_grad_enabled():
                torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward_hook(needs), mode="any")

        return hook

    # -- backward -----------------------------------------------------------------------------

    def _begin_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            self._backward.begin(guess=self._forward.expected[::-1])
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _pre_backward_hook(self, needs: tuple[int, ...]):
        def hook(grads: Any) -> None:
            self._begin_backward()
            self._gather(needs, self._backward, True)

        return hook

    def _grad_ready_hook(self, i: int):
        def hook(param: nn.Parameter) -> None:
            self._begin_backward()
            ready = self._ready_grads[i]
            ready.add(id(param))
            if i not in self._reduced and all(id(p) in ready for p in self.units[i].params if p.requires_grad):
                self._reduce(i)

        return hook

    def _reduce(self, i: int) -> None:
        self._reduced.add(i)
        self.units[i].reduce_grads()
        self._free(i)

    def _end_backward(self) -> None:
        for i, unit in enumerate(self.units):
            if i not in self._reduced and any(p.requires_grad for p in unit.params):
                self._reduce(i)
        self._free_all()
        self._backward.end()
        self._reduced = set()
        self._ready_grads = [set() for _ in self.units]
        self._in_backward = False

    # -- whole-model access -------------------------------------------------------------------

    def hold(self) -> None:
        """Gather every unit and keep it gathered until ``release()``."""
        for i in range(len(self.units)):
            if not self.units[i].persistent:
                self._start(i)
        for i in range(len(self.units)):
            if not self.units[i].persistent:
                self._finish(i)
        self._held = True

    def release(self) -> None:
        """End ``hold()``: free every unit no running module uses."""
        self._held = False
        self._free_all()

    @property
    def gathered(self) -> list[bool]:
        """Per unit: whether its full parameters are present (persistent units always are)."""
        return [state == _READY for state in self._state]
