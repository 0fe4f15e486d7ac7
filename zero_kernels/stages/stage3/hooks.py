"""When stage 3 gathers, frees, prefetches and reduces: module hooks driving abstract parameter units.

This module decides *when*; how a unit's parameters are laid out, gathered and reduced belongs to
the unit object (see ``Unit``). A unit owns a disjoint set of parameters; which units a module
needs comes from ``stage3.plan``: the units of the parameters it holds directly (several with
weight tying), of its external parameters (``model_hints.register_external_parameter``), and for a
leaf module (``model_hints.set_leaf_modules``) those of its whole subtree; a leaf's sub-modules get
no hooks. The plan is read again at the start of a forward whenever a hint changed.

Schedule, per module ``m`` that needs units (the root always runs these hooks):

- forward pre-hooks: one placed before every other (``prepend``), so that pre-hooks registered before the
  optimizer (``spectral_norm``'s) find the parameters gathered: gather ``m``'s units (wait for them), then start
  gathers of the units that come
  next in the previous forward's order: at least the next one, and more while they fit in
  ``prefetch_numel`` elements (0 disables prefetch), none while the gathered units hold ``max_live_numel``
  elements and never more than fit under it. The gathers started together are one *batch*:
  ``check(batch, phase, deferred)`` runs before any of them is issued (stage 3 checks there that every
  rank gathers the same units; ``deferred`` when the pass follows the previous pass of its kind, see
  ``Check``); then every unit of the batch is told to ``read_ahead`` (a shard in a file starts its read)
  before the first gather is issued, and with prefetch on so is the unit expected after the batch (its read
  runs beside ``m``'s compute; its gather is issued at the next module, as without files). With autograd
  recording, ``m``'s inputs are watched for the end of its backward (``stage3.uses``);
- first forward hook (kept before the hooks registered since): copy what ``m`` returns that shares the
  storage of its gathered parameters, and when autograd records the forward, route ``m``'s outputs through
  one node of ``m``'s own (``stage3.boundary``), so that ``m``'s other hooks see and keep what the caller
  gets (while the user has global forward hooks, which torch runs before a module's own, a global hook
  runs first among them and routes the same way: ``stage3.global_hooks``); last forward hook (kept after
  them): free ``m``'s units once no running module uses them, after routing an output a hook replaced.
  The node's backward gathers ``m``'s units again (before any node ``m``'s forward created runs),
  prefetching along the previous backward's order. That node runs after
  the hooks on its outputs: where an output is the next module's input, that module's use ends (and its
  units are reduced and freed) before these gathers start, and a unit's gathered copy never waits beside
  one more prefetch. It is ``m``'s even where the output is ``m``'s input or a child's output, so the
  gather comes before ``m``'s reduction on every rank;
- once the backward of every forward use of a unit has ended (``stage3.uses``: a point that does not
  depend on which of its parameters got a gradient on this rank), ``reduce_grads()`` the unit and
  free it (a unit of frozen parameters is only freed); a parameter's gradient arriving after that raises;
- end of backward (an autograd-engine callback): units not reduced yet are reduced then, in unit
  order, and everything still gathered is freed.

A backward with ``create_graph=True`` (double backward) is refused at its first hook: the graph it creates would
read parameters that its own end frees.

So every rank issues the same collectives in the same order whatever its data, as long as every
rank runs the same modules in the same order (a leaf module hides what its data chooses inside it)
and its backward reaches the same modules (an output that ignores the module's input on some ranks
cuts the modules before it off there).

A freed parameter is marked (``stage3.guard``): an operation on it inside a module's forward gathers
its unit for that module from then on (an external parameter found by use, logged once); outside
any forward it raises an error that says how to read it, as does an operation on what its
``.data`` or ``detach()`` gave while it was freed (an empty tensor, wherever it is used). Hooks are run eagerly under
``torch.compile`` (a graph break around each), so compiled module bodies see gathered parameters.

Persistent units are never gathered or freed here (they stay full); their gradients are reduced
like any other's. ``hold()`` keeps every unit gathered until ``release()`` (``gathered_params``).
"""

from __future__ import annotations

import copy
import logging
import pickle
import sys
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ...comm.primitives import CommError
from ..eager import weakly
from ..grad_state import second_gradient
from . import global_hooks, model_hints
from . import guard as guard
from .boundary import copy_views, route_outputs
from .check import explain_failed_gather
from .plan import ModulePlan, plan
from .uses import UseTracker, grad_tensors

log = logging.getLogger("zero_kernels")

_FREE, _IN_FLIGHT, _READY = "free", "in-flight", "ready"
DOUBLE_BACKWARD = (
    "ZeRO stage 3: a backward with create_graph=True (double backward: torch.autograd.grad(..., create_graph=True) "
    "for a gradient penalty such as WGAN-GP's, Hessian-vector products) is not supported: stage 3 frees each "
    "module's gathered parameters as its backward ends, and the graph that backward creates would read them in the "
    "second backward. Train such a model at stage 2 (whole parameters), or with a penalty that needs no second "
    "derivative; nothing was reduced"
)


class Unit(Protocol):
    """The parameters the scheduler gathers, frees and reduces together."""

    params: Sequence[nn.Parameter]  # owned parameters; no parameter belongs to two units
    numel: int  # elements one gather brings in; counted against the prefetch budget
    persistent: bool  # always gathered: the scheduler never gathers nor frees it

    def read_ahead(self) -> None:
        """Prepare a gather that follows soon (start reading a shard kept in a file); may do nothing."""

    def start_gather(self) -> None:
        """Issue the gather of the full parameters (may return before it completes)."""

    def finish_gather(self) -> None:
        """Wait for the gather started last and give each parameter its full value."""

    def free(self, hand_over: bool = False) -> None:
        """Drop the full parameters (each keeps its ``Parameter`` object); ``hand_over``: the end of
        ``gathered_params()``, whose views of them may outlive it (``stage3.storage``)."""

    def reduce_grads(self) -> None:
        """Reduce the gradients of the parameters into this rank's shard; a missing ``.grad`` is no gradient."""


Check = Callable[[list[int], str, bool], None]
"""``check(batch, phase, deferred)``: the units about to be gathered, "forward" | "backward" | ..., and whether
the batch belongs to a pass that so far follows the previous pass of its kind, which every rank checked: the
check may then be folded into a later exchange. The first pass of each kind after the plan was (re)read,
passes that leave the previous order and gathers outside a pass are not deferred."""


class _Pass:
    """Order of unit uses in one forward or backward pass, and the order expected from the last one."""

    def __init__(self) -> None:
        self.expected: list[int] = []
        self.recorded: list[int] = []
        self.on_track = True
        self.seen = False  # a pass of this kind has ended since the plan was read: ``expected`` is its order

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
        self.seen = True

    @property
    def deferrable(self) -> bool:
        """The pass so far repeats the previous pass of its kind."""
        return self.seen and self.on_track


FOREIGN_USE = (
    "ZeRO stage 3: module '%s' (%s) uses parameter '%s', which it does not hold, in its forward (%s); it is gathered "
    "for that module from now on."
)
# a forward that activation checkpointing recomputes in backward reads a parameter registered for a module that is
# not running then: found on first use inside a module that holds no parameter itself, it went to the module around
RECOMPUTED_READ = (
    "ZeRO stage 3: parameter '{name}' is used ({func}) during backward, where it is not gathered: it is gathered for "
    "the forward of {readers} (registered, or found on its first use there: a module that holds no parameter of its "
    "own, such as a container reading a child's weight, reads it inside the forward of the module around it), and a "
    "forward recomputed by activation checkpointing reads it without that module running. Register it for the "
    "module whose forward reads it: zero_kernels.register_external_parameter(module, parameter), before the forward"
)
# torch.compile's tracing wraps a tensor an inlined forward reads (a LoRA layer reading its adapter's weight.dtype,
# as PEFT's do): where the parameter is freed then, the module whose frame is being traced gathers it
TRACED_USE = (
    "ZeRO stage 3: torch.compile, tracing the forward of module '%s' (%s), read parameter '%s', which that module "
    "does not hold (%s: a forward it inlines reads another module's parameter, e.g. its dtype, as PEFT's LoRA layers "
    "do); it is gathered with that module from now on (the results are unchanged; it stays gathered for that "
    "module's whole forward)."
)
# a parameter kept whole shares its unit with the model's other small parameters, which is reduced when the backward of
# the calls of the modules using it ends: one read outside those forwards, upstream of them, gets its gradient after
KEPT_WHOLE_LATE = (
    "; or '{name}', kept whole on every rank (under stage3_param_persistence_threshold), is used outside the forward "
    "of the module that holds it (a method of the model other than forward, such as model.encode(x) or "
    "forward_features(x), reading it directly): stage 3 reduces it when the backward of the module calls that use "
    "its unit ends, and this gradient came after. Call such a method from that module's forward (a forward that "
    "dispatches to it); with stage3_param_persistence_threshold=0 such a use is refused where it happens"
)


COMPILED_AUTOGRAD = (
    "ZeRO stage 3 does not support compiled autograd (torch._dynamo.config.compiled_autograd = True, or "
    "torch._dynamo.compiled_autograd._enable): its tracing of the backward reads parameter '{name}' ({func}), which "
    "stage 3 keeps freed (partitioned across the ranks) outside its module's forward and backward. Turn compiled "
    "autograd off for this model (stages 0-2 support it; torch.compile of the model itself works at stage 3)"
)

# a loss kept past ``del optimizer``: its backward would read the parameters gathered for its forward, freed since
_GONE = (
    "ZeRO stage 3: backward of a forward run before its stage-3 optimizer was deleted: the parameters gathered for "
    "that forward were freed with the optimizer, which kept their shards. Run the backward (and the step) before "
    "deleting the optimizer, or run the forward again under the optimizer that trains the model now"
)


def _compiled_autograd_on() -> bool:
    """Whether compiled autograd is on (its tracing wraps every tensor the backward saved, freed parameters too)."""
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(compiled_autograd, "compiled_autograd_enabled", False))


def _running_elsewhere(root: nn.Module) -> bool:
    """Whether a call of ``root`` runs further up this thread's stack than the one whose forward pre-hook runs now
    (the root called inside its own forward); else a forward marked running was left by an exception."""
    calls, frame = 0, sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL_IMPL and frame.f_locals.get("self") is root:
            calls += 1
            if calls > 1:
                return True
        frame = frame.f_back
    return False


_CALL_IMPL = nn.Module._call_impl.__code__


def _keep_order(module: nn.Module, first: int, last: int) -> None:
    """Keep the forward hooks ``first`` and ``last`` (``Stage3Scheduler._route`` and ``_exit``) around the hooks
    registered on ``module`` since, also with ``prepend=True``: those see and keep the routed output the caller
    gets, and run while the parameters are still gathered; an output they replace (a layer-drop hook returning
    the input on some ranks) is routed again at the exit, inside the boundary (``stage3.boundary``)."""
    hooks = module._forward_hooks
    if not isinstance(hooks, OrderedDict) or first not in hooks or last not in hooks:
        return
    if next(iter(hooks)) != first:
        hooks.move_to_end(first, last=False)
    if next(reversed(hooks)) != last:
        hooks.move_to_end(last)


class _ModelHook:
    """A scheduler hook on a module of the model: an object, so that a copy of the model (``copy.deepcopy``;
    ``torch.optim.swa_utils.AveragedModel`` deep-copies) carries an inert hook instead of one that drives this
    scheduler (its gathers and pass bookkeeping) from the copy's forward, and a pickle of the model outside
    ``gathered_params()`` raises (``_copy_refusal``), whether its parameters are freed or persistent: pickled with
    the optimizer, it would not be the model the loaded optimizer trains. Run eagerly under ``torch.compile``, its
    call never traced: traced, it was compiled anew for each module class and argument count it served, up to
    Dynamo's recompile limit and its warning on every rank (a small Wav2Vec2 reached it); about 0.6 us more per call
    without ``torch.compile``."""

    def __init__(self, fn: Callable[..., Any], scheduler: "Stage3Scheduler") -> None:
        self._fn = fn
        self._scheduler = weakref.ref(scheduler)

    def __deepcopy__(self, memo: dict[int, Any]) -> "_InertHook":
        return _InertHook()

    def __reduce_ex__(self, protocol: Any) -> Any:
        scheduler = self._scheduler()
        if scheduler is not None and not scheduler._held:
            raise RuntimeError(_copy_refusal(pickle.dumps, None))
        return _InertHook, ()

    @torch._disable_dynamo
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)


class _InertHook:
    """What a copy of the model carries in place of a ``_ModelHook``: a hook that does nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


def _copy_refusal(func: Any, name: Optional[str]) -> Optional[str]:
    """Why a copy (``copy.deepcopy``) or a pickle (``pickle.dumps``: ``torch.save``) of the model cannot be made while
    parameter ``name`` is freed (None: outside ``gathered_params()``), or None for other operations."""
    if func is copy.deepcopy:
        return (
            f"ZeRO stage 3: copy.deepcopy of the model (or of parameter '{name}') while its parameters are "
            "freed: between uses each rank holds only its shard, so the copy would hold empty tensors. Copy it "
            "inside `with optimizer.gathered_params():` on every rank (e.g. "
            "`with opt.gathered_params(): ema = torch.optim.swa_utils.AveragedModel(model)`): the copy then "
            "holds the full values and none of the optimizer's hooks; or build it from "
            "zero_kernels.checkpoint's consolidated weights"
        )
    if func is pickle.dumps:
        what = "outside `gathered_params()`" if name is None else f"(or parameter '{name}') while it is freed"
        return (
            f"ZeRO stage 3: pickling the model {what} (torch.save(model), torch.save((opt, model))): a freed "
            "parameter would be saved empty, and a model saved beside the optimizer would not be the one the loaded "
            "optimizer trains (it carries a copy of its own). "
            "Save the optimizer alone (the loaded one trains `loaded.pipeline.module`), the weights "
            "(zero_kernels.checkpoint, or `model.state_dict()` inside `with opt.gathered_params():`), or pickle "
            "the model inside `with opt.gathered_params():` for a full copy without the optimizer's hooks. DataLoader "
            "workers and processes started with the model under spawn or forkserver pickle it too (and copy.copy of a "
            "parameter): start them inside the block, where they get the full values (forked, the model's hooks "
            "would gather in the worker)"
        )
    return None


def _take_off(*handles: list[RemovableHandle]) -> None:
    """Remove ``handles`` and empty their lists (in place: a scheduler's finalizer holds them)."""
    for some in handles:
        for handle in some:
            handle.remove()
        some.clear()


_UNROUTED = object()
_SCHEDULERS: "weakref.WeakSet[Stage3Scheduler]" = weakref.WeakSet()  # every live one (errors say whose forward runs)


@dataclass
class _Frame:
    """A module whose forward is running, and the units it holds in use (external ones found by use added)."""

    module: nn.Module
    needs: list[int]
    routed: Any = _UNROUTED  # the output its first forward hook gave the next hooks
    routed_tensors: dict[int, torch.Tensor] = field(default_factory=dict)  # its tensors that require grad
    versions: list[tuple[nn.Parameter, int]] = field(default_factory=list)  # its persistent parameters' at entry


class Stage3Scheduler:
    """Installs the hooks on ``root`` and its sub-modules; ``remove()`` takes them off again.

    The hooks hold the scheduler weakly (``eager.weakly``): whoever installs it keeps it (the pipeline does), and once
    it is gone they do nothing.

    Args:
        root: the model; its forward marks the start and end of a forward pass.
        units: parameter units; parameters of ``root`` that no unit owns are left alone.
        prefetch_numel: how many elements may be gathered ahead of use (0 disables prefetch).
        max_live_numel: no prefetch while the sharded units gathered hold this many elements, and none beyond it
            (the unit a module needs is gathered anyway).
        check: called with each batch of units about to be gathered, before any is (None: no check).
        on_end: called at the end of each backward, once every unit is reduced (the pipeline ends its round there).
        written: called with a parameter of a persistent unit that a module's forward wrote in place (a sharded
            unit's own ``free`` finds such writes); None: not looked for.
        late: called as each backward begins, and as the backward of each reentrant checkpoint segment begins
            (after the calls it recomputed), with the units this rank reduces at its end (``stage3.uses``: the
            units of calls whose inputs are not computed tensors, which the data may decide); returns those of every
            rank, which every rank then reduces at its end (None: this rank's own).
    """

    def __init__(
        self,
        root: nn.Module,
        units: Sequence[Unit],
        *,
        prefetch_numel: int,
        max_live_numel: int = 1 << 62,
        check: Optional[Check] = None,
        on_end: Optional[Callable[[], None]] = None,
        written: Optional[Callable[[nn.Parameter], None]] = None,
        late: Optional[Callable[[set[int]], set[int]]] = None,
    ) -> None:
        if prefetch_numel < 0:
            raise ValueError(f"stage3_prefetch_bucket_size must be >= 0, got {prefetch_numel}")
        self.root = root
        self.units = list(units)
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self._live_numel = 0  # elements of the sharded units gathered or being gathered
        self._check = check
        self._on_end = on_end
        self._written = written
        self._late = late
        self._watched: dict[int, tuple[nn.Parameter, ...]] = {}  # id(module) -> the persistent parameters it uses
        self._owner = self._owners(self.units)
        self._freed_params = {id(p) for u in self.units if not u.persistent for p in u.params}
        self._state = [_READY if u.persistent else _FREE for u in self.units]
        self._in_use = [0] * len(self.units)
        self._used = [False] * len(self.units)  # the gathered copy served a module since its gather
        self._reduced: set[int] = set()
        self._tasks: set[int] = set()  # the graph tasks of the running backward (``_begin_backward``)
        self._uses = UseTracker(len(self.units), weakly(self._uses_ended))
        self._forward, self._backward = _Pass(), _Pass()
        self._in_forward = self._in_backward = self._held = self._records = False
        self._stack: list[_Frame] = []
        self._given: dict[int, list[Any]] = {}  # id(module) -> the inputs its callers gave, before the pre-hooks
        self._leaf_units: set[int] = set()  # units of leaf modules (named in errors)
        self._root_plan = ModulePlan(root, "", (), False)
        self._generation = -1
        self._names = {id(p): name for name, p in root.named_parameters()}
        self._module_names = {id(m): name for name, m in root.named_modules()}
        self._handles: list[RemovableHandle] = []
        self._module_handles: list[RemovableHandle] = []  # both lists kept (emptied in place): ``_take_off`` holds them
        # collected (its optimizer deleted): its hooks come off the model, as stages 0-2's do (``base._let_go``);
        # left on, they did nothing, and a model trained by one optimizer after another gathered a set per optimizer
        weakref.finalize(self, _take_off, self._handles, self._module_handles).atexit = False
        self._install(root)
        _SCHEDULERS.add(self)

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
        self._install_modules()
        model_hints.follow_assignments(root.parameters())  # a weight tied after build: the plan is read again
        global_hooks.join(self)
        route, post = self._output_hooks(root, self._root_post_forward, always=True)
        pre = _ModelHook(weakly(self._root_pre_forward, route.id, post.id), self)
        self._handles += [root.register_forward_pre_hook(pre, prepend=True, with_kwargs=True), route, post]
        for i, unit in enumerate(self.units):
            for p in unit.params:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(weakly(self._grad_ready, i)))
            if self._state[i] == _FREE:
                for p in unit.params:
                    guard.mark_freed(p, self._on_freed_use, self._on_freed_read_use)

    def _install_modules(self) -> None:
        """(Re)read the plan (``stage3.plan``) and hook the modules that need units."""
        plans = plan(self.root, self._owner)
        _take_off(self._module_handles)
        self._generation = model_hints.generation()
        self._forward, self._backward = _Pass(), _Pass()  # a new plan: the next passes are checked at once
        self._root_plan = plans[0]
        self._leaf_units = set()
        every = tuple(q for u in self.units if u.persistent for q in u.params)
        persistent = {id(q) for q in every}
        self._watched = {id(p.module): tuple(q for q in p.params if id(q) in persistent) for p in plans}
        # the root's frame watches them all: a write by a module that does not use the parameter, by the root's
        # own forward or by a pre-hook that runs before a module's frame begins
        self._watched[id(self.root)] = every
        for p in plans:
            if p.leaf:
                inside = {id(q) for q in p.module.parameters()}
                self._leaf_units.update(i for i in p.needs if all(id(q) in inside for q in self.units[i].params))
            if p.module is not self.root:
                route, post = self._output_hooks(p.module, self._post_forward)
                pre = _ModelHook(weakly(self._pre_forward, p, route.id, post.id), self)
                early = _ModelHook(weakly(self._gather_early, p), self)
                early = p.module.register_forward_pre_hook(early, prepend=True, with_kwargs=True)
                self._module_handles += [early, p.module.register_forward_pre_hook(pre, with_kwargs=True), route, post]

    def _output_hooks(
        self, module: nn.Module, exit: Callable[..., Any], always: bool = False
    ) -> tuple[RemovableHandle, RemovableHandle]:
        """The forward hooks ``module`` runs first (``_route``) and last (``exit``; ``always``: also when the
        forward raises, as the root's does: the units of the modules it left running are freed and the next forward
        starts afresh, where they stayed gathered and in use, with the failed forward's graph, for the rest of the
        run)."""
        route = module.register_forward_hook(_ModelHook(weakly(self._route), self), prepend=True, with_kwargs=True)
        last = module.register_forward_hook(_ModelHook(weakly(exit), self), with_kwargs=True, always_call=always)
        return route, last

    def follow(self, previous: "Stage3Scheduler") -> None:
        """Carry on the pass orders of ``previous`` (removed) when it scheduled the same units under the same
        plan: whether a pass is checked at once must not depend on hooks put back on one rank only."""
        if len(previous.units) == len(self.units) and previous._generation == self._generation:
            self._forward, self._backward = previous._forward, previous._backward

    def remove(self) -> None:
        """Take every hook off; parameters stay as they are (freed ones lose their mark)."""
        _take_off(self._handles, self._module_handles)
        global_hooks.leave(self)
        for unit in self.units:
            for p in unit.params:
                guard.mark_gathered(p)

    # -- gather / free bookkeeping ------------------------------------------------------------

    def _phase(self) -> str:
        return "backward" if self._in_backward else "forward"

    def _start(self, batch: list[int], phase: str, deferred: bool = False) -> None:
        """Issue the gathers of ``batch`` (free units), after ``check``."""
        if not batch:
            return
        if self._check is not None:
            self._check(batch, phase, deferred)
        for i in batch:
            self.units[i].read_ahead()
        for i in batch:
            self.units[i].start_gather()
            self._state[i] = _IN_FLIGHT
            self._live_numel += self.units[i].numel

    def _finish(self, i: int) -> None:
        if self._state[i] == _FREE:
            self._start([i], self._phase())
        if self._state[i] == _IN_FLIGHT:
            self.units[i].finish_gather()
            self._state[i] = _READY
            for p in self.units[i].params:
                guard.mark_gathered(p)

    def _free(self, i: int, hand_over: bool = False) -> None:
        if self.units[i].persistent or self._held or self._in_use[i] or self._state[i] == _FREE:
            return
        self._finish(i)
        self._state[i] = _FREE  # first: a free cut short (Ctrl-C) is gathered whole next time, as any free unit
        self._live_numel -= self.units[i].numel
        self._used[i] = False
        self.units[i].free(hand_over)
        for p in self.units[i].params:
            guard.mark_freed(p, self._on_freed_use, self._on_freed_read_use)

    def _gather(self, needs: Sequence[int], step: _Pass, active: bool) -> None:
        """Gather ``needs`` now and prefetch what ``step`` expects next (only inside a pass); a failed collective
        says what ranks that ran different modules look like (``check.explain_failed_gather``)."""
        try:
            self._gather_now(needs, step, active)
        except CommError as exc:
            explained = explain_failed_gather(exc)
            if explained is exc:
                raise
            raise explained from exc

    def _gather_now(self, needs: Sequence[int], step: _Pass, active: bool) -> None:
        ahead: list[int] = []
        for i in needs:
            if active and not self.units[i].persistent and not self._used[i]:
                ahead = step.record(i)
        batch = list(dict.fromkeys(i for i in needs if self._state[i] == _FREE))
        started = batch + self._prefetch(ahead, set(batch))
        self._start(started, self._phase(), active and step.deferrable)
        self._read_ahead(ahead, set(started))
        for i in needs:
            self._finish(i)
            self._used[i] = True

    def _read_ahead(self, ahead: list[int], started: set[int]) -> None:
        """Start reading the shard of the unit expected after those just started, where it is in a file: its
        gather, issued at the next module (the same point on every rank), then finds it read, and the read ran
        beside this module's compute (a gather waits for its shard's read). A local read: no collective moves."""
        if self.prefetch_numel == 0:
            return
        nxt = next((j for j in ahead if j not in started and self._state[j] == _FREE and not self._in_use[j]), None)
        if nxt is not None:
            self.units[nxt].read_ahead()

    def _prefetch(self, ahead: list[int], taken: set[int]) -> list[int]:
        """The free units of ``ahead`` to start now: the next one whatever its size (as DeepSpeed always
        prefetches the next parameter), then more while they fit in the prefetch budget; none once the units
        gathered (with those of ``taken``, about to be) hold ``max_live_numel`` elements, and no more than fit
        in what is left of it (``stage3_max_live_parameters``, as DeepSpeed bounds its prefetch)."""
        room = self.max_live_numel - self._live_numel - sum(self.units[i].numel for i in taken)
        if self.prefetch_numel == 0 or room <= 0:
            return []
        budget, batch = min(self.prefetch_numel, room), []
        for k, j in enumerate(ahead):
            if k > 0 and self.units[j].numel > budget:
                break
            budget -= self.units[j].numel
            if not self._in_use[j] and self._state[j] == _FREE and j not in taken:
                taken.add(j)
                batch.append(j)
        return batch

    def _free_all(self, hand_over: bool = False) -> None:
        for i in range(len(self.units)):
            self._free(i, hand_over)

    # -- forward ------------------------------------------------------------------------------

    def _transformed(self) -> bool:
        """Whether a ``torch.func`` transform (``vmap``, ``grad``, ...) runs this forward: inside ``gathered_params()``
        every unit is whole and the hooks do nothing (the transform computes its own gradients); elsewhere refused
        (a gather writes in place into buffers the transform captures; the first one made there was unusable)."""
        if not torch._C._are_functorch_transforms_active():
            return False
        if self._held:
            return True
        raise RuntimeError(guard.UNDER_TRANSFORM)

    def _root_pre_forward(self, route_id: int, post_id: int, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if self._transformed():
            return None
        _keep_order(module, route_id, post_id)
        global_hooks.follow()
        if self._in_forward and not _running_elsewhere(module):
            self._abandon_forward()
        if not self._in_forward:
            if self._generation != model_hints.generation():
                self._install_modules()
            self._in_forward = True
            self._given.clear()  # left by a pre-hook that raised
            self._records = torch.is_grad_enabled()  # a training forward (an evaluation runs without autograd)
            self._forward.begin()
        return self._enter(self._root_plan, args, kwargs)

    def _abandon_forward(self) -> None:
        """A forward that an exception torch runs no ``always_call`` hook for (``KeyboardInterrupt``: Ctrl-C caught
        by the loop, ``SystemExit``) left: its frames are dropped and their units freed, as the root's exit hook does
        for an ``Exception``; the next forward starts afresh (where the units stayed gathered and in use for the rest
        of the run, every forward was checked at once, without prefetch, and its recorded order grew without end)."""
        released: list[int] = []
        while self._stack:
            self._pop_frame(released)
        self._in_forward = False
        for i in released:
            self._free(i)

    def _pop_frame(self, released: list[int]) -> _Frame:
        """The innermost frame off the stack, its units no longer in use by it (added to ``released``)."""
        frame = self._stack.pop()
        for i in frame.needs:
            self._in_use[i] -= 1
        released += frame.needs
        return frame

    def _root_post_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        if self._transformed():
            return output
        output = self._exit(module, (args, kwargs), output)
        if self._in_forward and not self._stack:
            self._in_forward = False
            self._forward.end()
            self._free_all()
        return output

    def _gather_early(self, p: ModulePlan, module: nn.Module, args: Any, kwargs: Any) -> None:
        """``p.module``'s first forward pre-hook: gather its units, so that the pre-hooks registered before the
        optimizer (``spectral_norm``'s, a hook reading ``m.weight.shape``) see its parameters (``_enter``, in
        its pre-hook after theirs, finds them gathered). The inputs the caller gave are kept for ``_enter``: a
        pre-hook may compute the module's inputs from them and from its parameters (``x + m.weight.sum(1)``),
        and the use ends only once the gradients of both reached them."""
        if self._transformed():
            return
        self._gather(p.needs, self._forward, self._in_forward)
        self._given.setdefault(id(module), []).append((args, kwargs))

    def _pre_forward(
        self, p: ModulePlan, route_id: int, post_id: int, module: nn.Module, args: Any, kwargs: Any
    ) -> Any:
        if self._transformed():
            return None
        _keep_order(module, route_id, post_id)
        global_hooks.follow()
        given = self._given.get(id(module))
        return self._enter(p, args, kwargs, given.pop() if given else None)

    def _post_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        return output if self._transformed() else self._exit(module, (args, kwargs), output)

    def _enter(self, p: ModulePlan, args: Any, kwargs: Any, given: Any = None) -> Any:
        """Gather what ``p.module`` needs and mark it running; a leaf's inputs get the end-of-backward marker.
        ``given``: the inputs the caller gave, before the module's forward pre-hooks (``UseTracker.begin``)."""
        if not self._stack:
            # A forward begins. Autocast keeps its casts of parameters until its region ends; a forward later in
            # the region (the next micro-step) took an earlier forward's casts: of a freed parameter (its backward
            # failed on the freed tensor), or made before the forward's inputs (the gradient came after the
            # parameter's unit was reduced), of weights an optimizer step has changed since
            torch.clear_autocast_cache()
        self._gather(p.needs, self._forward, self._in_forward)
        for i in p.needs:
            self._in_use[i] += 1
        watched = () if self._held or self._written is None else self._watched.get(id(p.module), ())
        self._stack.append(_Frame(p.module, list(p.needs), versions=[(q, q._version) for q in watched]))
        if p.needs and torch.is_grad_enabled():
            self._uses.begin(p.needs, args, kwargs, given)
        elif p.needs and self._in_forward and self._records:  # a reentrant checkpoint's segment
            self._uses.unrecorded(p.needs)
        return None

    def _route(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        """``module``'s first forward hook: its output as the caller gets it (``_routed``), kept in its frame."""
        if self._transformed():
            return output
        frame = next((f for f in reversed(self._stack) if f.module is module), None)
        return output if frame is None else self._settled(frame, (args, kwargs), output)

    def _settled(self, frame: _Frame, inputs: Any, output: Any) -> Any:
        """``output`` as the caller gets it: routed (``_routed``) unless it is what the frame's last routing gave,
        with no tensor added since (by a hook, in place); kept in the frame."""
        if output is frame.routed and all(frame.routed_tensors.get(id(t)) is t for t in grad_tensors(output)):
            return output
        frame.routed = self._routed(frame, inputs, output)
        frame.routed_tensors = {id(t): t for t in grad_tensors(frame.routed)}
        return frame.routed

    def _routed(self, frame: _Frame, inputs: Any, output: Any) -> Any:
        """``output`` with the views of ``frame``'s gathered parameters (and any parameter that stage 3 frees)
        copied and, with autograd recording, its tensors not routed yet in this call routed through the node
        whose backward gathers them again (``stage3.boundary``)."""
        freed = [p for i in frame.needs if not self.units[i].persistent for p in self.units[i].params]
        output = copy_views(output, freed, self._freed_params)
        if frame.needs and torch.is_grad_enabled():
            backward = weakly(self._pre_backward, tuple(dict.fromkeys(frame.needs)), gone=_GONE if freed else None)
            return route_outputs(output, inputs, backward, frame.routed_tensors)
        return output

    def _exit(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        """``module``'s last forward hook: free what it held (and frames left above it by an exception caught
        inside a forward); an output a hook replaced since ``_route`` is routed first."""
        if not self._stack:
            return output
        released: list[int] = []
        while self._stack:
            frame = self._pop_frame(released)
            self._check_writes(frame)
            if frame.module is module:
                break
        output = self._settled(frame, inputs, output)  # replaced, or a tensor added in place, by a hook
        # A recomputation may be the first node a backward runs, before any hook of ours has marked it begun.
        recomputing = self._in_backward or torch._C._current_graph_task_id() != -1
        for i in released:
            if not (recomputing and self._frozen(i)):
                self._free(i)
        return output

    def _frozen(self, i: int) -> bool:
        """Whether unit ``i`` holds frozen parameters only. During backward (a non-reentrant checkpoint's
        recomputation, also one that runs before any other node of the backward) such a unit stays gathered until
        its uses end (``_uses_ended``) or the backward ends: autograd saves a parameter
        that needs no gradient as itself, not as a detached view, and torch's check of the recomputed tensors reads
        its shape after the recomputed forward has returned."""
        return not any(p.requires_grad for p in self.units[i].params)

    def _readers(self, param: nn.Parameter) -> str:
        """The modules ``param`` is registered for as an external parameter, quoted (empty: none)."""
        return ", ".join(
            f"'{self._module_names.get(id(m), '?') or '<root>'}'"
            for m in self.root.modules()
            if any(q is param for q in model_hints.external_parameters(m))
        )

    def _check_writes(self, frame: _Frame) -> None:
        """The persistent parameters written in place during the frame's module's forward (``nn.Embedding(max_norm)``;
        the root's frame: during the whole forward): kept whole on every rank, but each rank's step takes only its
        own shard's part, so ``written`` is told of each (the step refuses them where the ranks' values differ,
        ``forward_writes``); inside ``gathered_params()`` writes are meant."""
        if self._held:
            return
        for q, version in frame.versions:
            if q._version != version:
                self._written(q)

    def _on_freed_use(self, param: nn.Parameter, func: Any) -> None:
        """A freed parameter is computed with: gather it for the running module, or explain."""
        i = self._owner[id(param)]
        name = self._names.get(id(param), "?")
        refusal = _copy_refusal(func, name)
        if refusal is not None:
            raise RuntimeError(refusal)
        if not self._stack:
            if _compiled_autograd_on():
                raise RuntimeError(COMPILED_AUTOGRAD.format(name=name, func=guard.operation_name(func)))
            where = "during backward" if self._in_backward else "outside the forward of its model's modules"
            if not self._in_backward and any(other._stack for other in _SCHEDULERS if other is not self):
                where = (
                    "in the forward of a model that another stage-3 optimizer holds (a model's forward gathers "
                    "the parameters of its own optimizer only; train both with one optimizer, or use it inside "
                    "`with <its optimizer>.gathered_params():`)"
                )
            readers = self._readers(param) if self._in_backward else ""
            if readers:
                raise RuntimeError(RECOMPUTED_READ.format(name=name, func=guard.operation_name(func), readers=readers))
            needs_grad = torch.is_grad_enabled() and param.requires_grad
            raise RuntimeError(guard.outside_forward(name, func, where, needs_grad))
        frame = self._stack[-1]
        user = self._module_names.get(id(frame.module), "?") or "<root>"
        log.warning(
            (TRACED_USE if torch.compiler.is_compiling() else FOREIGN_USE)
            + " zero_kernels.register_external_parameter(module, parameter) says so up front (and silences this "
            "message).",
            user,
            type(frame.module).__name__,
            name,
            guard.operation_name(func),
        )
        model_hints.register_external_parameter(frame.module, param)
        self._uses.late.add(i)  # this use was not counted: its unit waits for the end of backward
        self._gather((i,), self._forward, False)
        self._in_use[i] += 1
        frame.needs.append(i)

    def _on_freed_read_use(self, param: nn.Parameter, func: Any) -> None:
        """What ``.data``, ``detach()`` or a conversion gave for a freed parameter is computed with: explain."""
        name = self._names.get(id(param), "?")
        if guard.sets_data(func):
            raise RuntimeError(
                f"ZeRO stage 3: `p.data = t` for parameter '{name}', where t is the empty tensor that .data gave while "
                "it was freed, and it has been gathered or given other values since (a swap `p.data, e.data = "
                "e.data, p.data` outside gathered_params(), to evaluate with EMA weights and back): t holds no values, "
                "so nothing would be put back, and the values assigned before (the EMA's) would stay the trained "
                "weights. Swap inside `with optimizer.gathered_params():` on every rank, both ways (the forward may "
                "run outside it: the block's end writes what was swapped in into the shards), or copy instead "
                "(`p.data.copy_(...)` inside the block)"
            )
        fix = (
            "read parameters outside the forward inside `with optimizer.gathered_params():` (a copy taken there, "
            "e.g. {n: p.detach().clone() for n, p in model.named_parameters()}, holds the full values; writes made "
            "there reach every rank's shard)"
        )
        if self._stack:
            fix = (
                f"inside a forward, read it in a module that holds it, or register it for the module that reads it "
                f"(zero_kernels.register_external_parameter(module, model.get_parameter('{name}'))); {fix}"
            )
        raise RuntimeError(
            f"ZeRO stage 3: parameter '{name}' was read through .data, .detach() or a conversion while it was freed, "
            f"and what that gave is now used ({guard.operation_name(func)}): between uses each rank holds only its "
            f"shard, so it is an empty tensor. To fix it, {fix}"
        )

    # -- backward -----------------------------------------------------------------------------

    def _begin_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if not self._in_backward:
            if torch.is_grad_enabled():  # autograd runs a backward's hooks in grad mode only with create_graph
                raise RuntimeError(DOUBLE_BACKWARD)
            self._agree_late()  # before any collective of this backward, on every rank
            self._tasks = {task}
            self._in_backward = True
            self._backward.begin(guess=self._forward.expected[::-1])
            torch.autograd.Variable._execution_engine.queue_callback(weakly(self._end_backward))
        elif task not in self._tasks:  # a reentrant checkpoint segment's own backward, after its recomputed calls
            self._tasks.add(task)
            self._agree_late()

    def _agree_late(self) -> None:
        """Every rank holds late the units late on any rank (``late``): at a point of the backward that every rank
        reaches before the collectives that follow it; a failed exchange says what ranks that ran different passes
        look like (``check.explain_failed_gather``), as a gather does."""
        if self._late is None:
            return
        try:
            late = self._late(set(self._uses.late))
        except CommError as exc:
            explained = explain_failed_gather(exc)
            if explained is exc:
                raise
            raise explained from exc
        self._uses.late |= late

    def _pre_backward(self, needs: tuple[int, ...]) -> None:
        self._begin_backward()
        self._gather(needs, self._backward, True)

    def _grad_ready(self, i: int, param: nn.Parameter) -> None:
        self._begin_backward()
        if i in self._reduced:
            if i in self._leaf_units:
                raise RuntimeError(
                    f"ZeRO stage 3: parameter '{self._names.get(id(param), '?')}' of a leaf module got its "
                    "gradient after the leaf's backward had ended and its gradients were reduced; a parameter "
                    "of a leaf module must be used only inside the leaf's forward"
                )
            name = self._names.get(id(param), "?")
            late = KEPT_WHOLE_LATE.format(name=name) if self.units[i].persistent else ""
            raise RuntimeError(second_gradient(3, f"parameter '{name}'") + late)

    def _uses_ended(self, ready: list[int]) -> None:
        """Every use of the units ``ready`` has ended its backward (``stage3.uses``): reduce them; frozen units
        (no parameter requires grad) are freed."""
        self._begin_backward()
        for i in ready:
            if self._frozen(i):
                self._free(i)
            elif i not in self._reduced:
                self._reduce(i)

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
        self._forget_backward()
        if self._on_end is not None:
            self._on_end()

    def _forget_backward(self) -> None:
        """The backward's bookkeeping cleared: none is running (it ended, or raised and was given up)."""
        self._reduced = set()
        self._uses.reset()
        self._in_backward = False

    @property
    def in_backward(self) -> bool:
        """A backward began and its end (an autograd callback) has not run: it is running, or it raised."""
        return self._in_backward

    def end_failed_backward(self, keep: bool) -> None:
        """End a backward that raised (autograd drops its end callback then): ``keep``, as it would have ended (the
        units left are reduced); else its units are freed and the gradients they did not reduce left to the caller.
        """
        if keep:
            self._end_backward()
            return
        self._free_all()
        self._forget_backward()

    # -- whole-model access -------------------------------------------------------------------

    def hold(self) -> None:
        """Gather every unit and keep it gathered until ``release()``."""
        self._start([i for i in range(len(self.units)) if self._state[i] == _FREE], "gathered_params()")
        for i in range(len(self.units)):
            self._finish(i)
        self._held = True

    def release(self) -> None:
        """End ``hold()``: free every unit no running module uses (views taken in the block keep their values)."""
        self._held = False
        self._free_all(hand_over=True)

    def each_gathered(self, phase: str) -> Iterator[Unit]:
        """Every unit whole in turn, gathered one at a time and freed after its turn (those already whole, persistent
        or held, as they are): a read of the whole model that never holds it whole. ``phase`` names the reader in
        the ranks' check of their gathers."""
        for i, unit in enumerate(self.units):
            gathered_here = self._state[i] == _FREE
            if gathered_here:
                self._start([i], phase)
            self._finish(i)
            try:
                yield unit
            finally:
                if gathered_here:
                    self._free(i, hand_over=True)

    @property
    def gathered(self) -> list[bool]:
        """Per unit: whether its full parameters are present (persistent units always are)."""
        return [state == _READY for state in self._state]
