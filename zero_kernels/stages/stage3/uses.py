"""Stage 3: when a unit's gradients are reduced, decided at the same point on every rank.

Reducing a unit is a collective, and the collectives of all ranks pair up in issue order, so the
point where a unit is reduced must not depend on a rank's data. "Once every parameter of the unit
has its gradient" does: a module that every rank runs may use one of its parameters only on some
ranks (``if cond: y = y + x @ self.w2``), and a rank without that gradient would reduce later,
after gathers the others issue first. Instead a unit is reduced once the backward of every forward
use of it has ended, or at the end of backward; a parameter without a gradient then counts as zero.

The end of a use's backward. When a module that needs units is called with autograd recording
(``begin``), a hook goes on each of its inputs that requires grad and was computed (has a
``grad_fn``). A tensor's hook runs once its gradient is complete, just before the node that
produced it runs. Among the nodes that are ready the autograd engine runs the one created last
first, and a parameter's gradient accumulation before any other; the input was created before
the module ran, so when its hook runs, every node the module's forward created and every gradient
accumulation of its parameters has run, whatever the data made the module do inside. The hooks of
one use are counted down: the last one ends the use. That point depends only on the graph around
the module, which every rank has in common.

Late units, reduced at the end of backward (the same point on every rank too): the units of a call
whose inputs need no gradient or are all leaf tensors (the first layer, an embedding: the end of
its backward is not seen), units with a use that never ends (a forward whose output is never
backpropagated holds its units' reductions until the end of the next backward), and every unit in a
backward that follows another without a forward between (a second backward through a graph kept with
``retain_graph=True``: the forward's uses ended in the first, and segments that activation checkpointing
recomputes would otherwise end a unit's uses before its other uses' gradients arrive). Whether a call's
inputs are computed may depend on the data (``x * self.scale if use else x``): a unit late on one rank
and not on another would be reduced before a gather of the backward on one and after it on the other.
So as a backward begins the ranks exchange the units each holds late (``late``, one small all-reduce:
``Stage3Pipeline._late_on_any_rank``), and every rank reduces at the end those late on any rank; again
as each reentrant checkpoint segment's own backward begins, after the calls it recomputed.

Recomputation (activation checkpointing). A forward that runs while backward runs is recomputing a
segment: with ``use_reentrant=False`` its graph is never backpropagated (the uses recorded by the
original forward end instead); with reentrant checkpointing the original forward ran without
autograd, and the recomputed segment's backward ends the uses. So a unit with a use recorded by a
forward waits for those uses only, and a unit used only in recomputed segments waits for them. A unit
that a reentrant segment's original forward used (a module called without autograd inside a forward
that records) waits, besides the uses recorded by the forward, for as many recomputed calls to end as
the segments made: a unit shared by several segments, or by a segment and the rest of the model (stage
3 pools the parameters under ``stage3_param_persistence_threshold`` of all modules into one unit),
is reduced after the last of them. A reentrant segment's recomputed call ends inside the segment's own
backward (another graph task than the one that recomputed it); a non-reentrant segment's recomputed call
"ends" in the backward that recomputed it, through the original inputs it was given, and does not count as a
reentrant segment's (a module in a reentrant segment and later in a non-reentrant one was reduced before the
reentrant segment's backward, whose gradient then raised).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from . import nested


def grad_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors requiring grad inside ``obj`` (``stage3.nested``: tuples, lists, dicts, dataclasses)."""
    return [t for t in nested.tensors(obj) if t.requires_grad]


def _watchable(obj: Any) -> list[torch.Tensor]:
    """The computed tensors requiring grad inside ``obj``, once each (a hook on each ends a use)."""
    seen: set[int] = set()
    out = []
    for t in grad_tensors(obj):
        if t.grad_fn is not None and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


class _Use:
    """One call of a module: its watched inputs count down to the end of its backward."""

    def __init__(self, tracker: "UseTracker", needs: tuple[int, ...], recomputed: bool, pending: int):
        self.tracker, self.needs, self.recomputed, self.pending = tracker, needs, recomputed, pending
        self.round = tracker.round
        self.task = torch._C._current_graph_task_id()  # the backward that recomputes it (-1: a forward)


@torch._disable_dynamo  # one function, disabled once (``eager``): a backward inside a compiled function calls it
def _count_down(use: _Use, grad: torch.Tensor) -> None:
    """A watched input's gradient is complete: the last one ends the use."""
    use.pending -= 1
    if use.pending == 0:
        use.tracker._ended(use)


class UseTracker:
    """Counts, per unit, the uses whose backward has not ended; ``on_ready(units)`` gets the units whose
    every use has ended (in ascending order), called from inside backward.

    Args:
        count: number of units.
        on_ready: called with the units that may be reduced now.
    """

    def __init__(self, count: int, on_ready: Callable[[list[int]], None]) -> None:
        self._count = count
        self._on_ready = on_ready
        self.round = 0
        self.reset()

    def reset(self) -> None:
        """Forget every use (at the end of backward): hooks of earlier uses that still run are ignored."""
        self.round += 1
        self._open = [0] * self._count  # uses recorded by a forward whose backward has not ended
        self._open_recomputed = [0] * self._count  # the same for uses recorded while backward runs
        self._used: set[int] = set()
        self._used_recomputed: set[int] = set()
        self._unrecorded = [0] * self._count  # calls without autograd inside a recording forward (reentrant segments)
        self._recomputed_ended = [0] * self._count  # recomputed calls whose backward has ended
        self.late: set[int] = set()  # reduced at the end of backward
        self._forward_seen = False  # a forward recorded a use since the last backward ended

    def unrecorded(self, needs: Sequence[int]) -> None:
        """A module that needs the units ``needs`` ran without autograd inside a forward that records (a reentrant
        checkpoint's segment): its recomputation in backward will use them once more."""
        for i in set(needs):  # once per call, as ``_ended`` counts a recomputed call
            self._unrecorded[i] += 1

    def begin(self, needs: Sequence[int], args: Any, kwargs: Any, given: Any = None) -> None:
        """A module that needs the units ``needs`` is called with autograd recording: watch its inputs. ``given``:
        the inputs its caller gave, where forward pre-hooks ran since; when those made inputs of their own (from
        the given ones and perhaps the module's parameters, whose gradients arrive after the module's inputs'), the
        given inputs are watched too, and the use is late when none of them can be."""
        recomputed = torch._C._current_graph_task_id() != -1
        self._forward_seen = self._forward_seen or not recomputed
        watched = _watchable((args, kwargs))
        if given is not None:
            original = _watchable(given)
            if {id(t) for t in watched} - {id(t) for t in original}:  # the pre-hooks made inputs of their own
                watched = _watchable((args, kwargs, given)) if original else []
        if not watched:
            self.late.update(needs)
            return
        use = _Use(self, tuple(needs), recomputed, len(watched))
        opened, used = (self._open_recomputed, self._used_recomputed) if recomputed else (self._open, self._used)
        for i in needs:
            opened[i] += 1
            used.add(i)
        for t in watched:
            t.register_hook(functools.partial(_count_down, use))

    def _ended(self, use: _Use) -> None:
        if use.round != self.round:
            return
        opened = self._open_recomputed if use.recomputed else self._open
        for i in use.needs:
            opened[i] -= 1
        if use.recomputed and torch._C._current_graph_task_id() != use.task:
            for i in set(use.needs):  # a reentrant segment's backward (its own graph task) ended the call
                self._recomputed_ended[i] += 1
        self._on_ready([i for i in sorted(set(use.needs)) if self._all_ended(i)])

    def _all_ended(self, i: int) -> bool:
        if i in self.late or not self._forward_seen:  # a second backward through a kept graph: at its end
            return False
        if self._unrecorded[i]:  # every segment that used it must be recomputed and its backward ended
            return self._open[i] == 0 and self._recomputed_ended[i] >= self._unrecorded[i]
        if i in self._used:
            return self._open[i] == 0
        return i in self._used_recomputed and self._open_recomputed[i] == 0
