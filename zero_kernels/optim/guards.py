"""Set-ups that would reduce gradients twice: a model wrapped in ``DistributedDataParallel``.

``ShardedFusedAdam`` reduces gradients across ranks itself (every stage). Under DDP they are
all-reduced a second time: at stage 0 DDP's all-reduce into ``p.grad`` races with the optimizer's,
at stages 2-3 DDP holds a full-size gradient bucket and ``p.grad`` stays ``None`` (torch's clipping
through DDP sees nothing), and DDP's buckets hold on to the shapes of stage 3's emptied
parameters. So DDP is refused wherever it can be seen, whatever the optimizer was given:

- at construction, when the optimizer is given a DDP module (as the model or as ``module=``) or a
  model containing one;
- at the first forward run inside a DDP wrapper built later, around the model or around any
  module holding the optimizer's parameters (the Hugging Face Trainer and Accelerate wrap the model
  after the optimizer exists): a forward pre-hook on the model when the optimizer knows it; when it
  was given only parameters, a process-wide forward pre-hook that finds the first module run that
  holds them (then hooks it as above and removes itself, so that it costs nothing afterwards) and
  checks every DDP run meanwhile;
- at ``step()``, when a sub-module of that model holding the optimizer's parameters was wrapped in DDP
  (``model.body = DistributedDataParallel(model.body)``, before or after the optimizer was built): the model's
  pre-hook runs before the sub-module's DDP forward, so it cannot see it, and at stage 0 the two all-reduces
  into ``p.grad`` left the weights 0.1-0.2 relative off DDP + AdamW with no error. The model's modules are walked
  again only after a DDP wrapper was made a sub-module somewhere (``nn.Module``'s global module registration
  hook counts them; one put into ``_modules`` by hand goes unseen).

The error names the fix for each framework.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from .. import live

_FIX = (
    "ShardedFusedAdam reduces gradients across ranks itself, so DDP would reduce them a second time. Train the "
    "bare model: in a plain loop do not wrap it in DistributedDataParallel; with the Hugging Face Trainer use "
    "zero_kernels.integrations.hf.ZeroTrainer; with Accelerate use zero_kernels.integrations.accelerate."
    "ZeroAccelerator in place of Accelerator, and build the optimizer before accelerator.prepare(model, ...); with "
    "PyTorch Lightning give the Trainer a DDPStrategy subclass whose configure_ddp() does nothing, and Fabric one "
    "whose setup_module(module) returns the module; with PyTorch-Ignite leave out idist.auto_model(model), which "
    "wraps it in DDP on several ranks, and move it with model.to(idist.device()); with fastai leave out "
    "DistributedTrainer (learn.to_distributed()) and give each rank its part of the data; with mmengine's Runner pass "
    "launcher='none' after torch.distributed.init_process_group() (its DefaultSampler still splits the data)"
)


def refuse_ddp(module: Optional[nn.Module]) -> None:
    """ValueError when ``module`` is, or contains, a ``DistributedDataParallel`` wrapper.

    Args:
        module: the model given to the optimizer (None: nothing to check).
    """
    if module is None:
        return
    for name, m in module.named_modules():
        if isinstance(m, DistributedDataParallel):
            where = "the model" if not name else f"sub-module {name!r} of the model"
            raise ValueError(f"{where} is wrapped in DistributedDataParallel: {_FIX}")


class _RefuseDDPForward:
    """The forward pre-hook of ``refuse_ddp_forward``: a class, so that a model carrying it can still be
    copied or pickled (a copy's hook is inert; the copied optimizer installs its own)."""

    def __init__(self, owner: Any) -> None:
        self._owner = weakref.ref(owner)
        self.handle: Optional[RemovableHandle] = None  # its own, taken off once the owner is gone

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._owner = lambda: None
        self.handle = None

    def __call__(self, mod: nn.Module, args: Any) -> None:
        if self._owner() is None:
            if self.handle is not None:
                self.handle.remove()
            return
        active = getattr(DistributedDataParallel, "_active_ddp_module", None)
        if active is None:
            return
        if any(m is mod for m in active.module.modules()):
            raise RuntimeError(f"the model runs inside DistributedDataParallel, which was wrapped around it: {_FIX}")


_models: "weakref.WeakKeyDictionary[Any, weakref.ref[nn.Module]]" = weakref.WeakKeyDictionary()  # owner -> model
# the DDP wrappers made sub-modules of any module so far (those made before this import count as one): a model is
# walked again only when this has changed since its last walk (a walk at every step cost 1.5 ms on 2,000 modules)
_wrappers_registered = 1
_walked: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()  # owner -> the count at its last walk


def _count_wrapper(module: nn.Module, name: str, submodule: Optional[nn.Module]) -> None:
    global _wrappers_registered
    if isinstance(submodule, DistributedDataParallel):
        _wrappers_registered += 1


nn.modules.module.register_module_module_registration_hook(_count_wrapper)


def refuse_ddp_inside(owner: Any) -> None:
    """RuntimeError when a sub-module of ``owner``'s model (given, or found at its first forward) that holds
    parameters ``owner`` trains is a ``DistributedDataParallel`` wrapper; called before a step changes anything."""
    ref = _models.get(owner)
    model = None if ref is None else ref()
    if model is None or _walked.get(owner) == _wrappers_registered:
        return
    trained = {id(p) for p in live.params_of(owner)}
    for name, m in model.named_modules():
        if isinstance(m, DistributedDataParallel) and any(id(p) in trained for p in m.module.parameters()):
            raise RuntimeError(
                f"sub-module {name!r} of the model is wrapped in DistributedDataParallel, its gradients reduced by "
                f"DDP as well (this step was refused, nothing changed): {_FIX}"
            )
    _walked[owner] = _wrappers_registered


def refuse_ddp_forward(module: nn.Module, owner: Any) -> RemovableHandle:
    """A forward pre-hook on ``module`` that raises when it runs inside a DDP forward while ``owner`` lives.

    Args:
        module: the model the optimizer trains.
        owner: the optimizer; once it is garbage collected the hook does nothing.
    """
    _models[owner] = weakref.ref(module)
    hook = _RefuseDDPForward(owner)
    hook.handle = module.register_forward_pre_hook(hook)
    return hook.handle


class _Finder:
    """The process-wide forward pre-hook for optimizers given only parameters (see the module docstring)."""

    def __init__(self) -> None:
        self.pending: "weakref.WeakSet[Any]" = weakref.WeakSet()  # optimizers whose model is not known yet
        self.cleared: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # modules run that hold none of their params
        self.handle: Optional[RemovableHandle] = None

    def add(self, owner: Any) -> None:
        self.pending.add(owner)
        self.cleared = weakref.WeakSet()
        if self.handle is None:
            self.handle = nn.modules.module.register_module_forward_pre_hook(self)

    def __call__(self, mod: nn.Module, args: Any) -> None:
        if isinstance(mod, DistributedDataParallel):
            refuse_wrapper(mod)
            return
        if mod in self.cleared:
            return
        held = {id(p) for p in mod.parameters()}
        found = [opt for opt in list(self.pending) if any(id(p) in held for p in live.params_of(opt))]
        for opt in found:
            refuse_ddp_forward(mod, opt)
            self.pending.discard(opt)
        if not found:
            self.cleared.add(mod)
        self._remove_when_done()

    def discard(self, owner: Any) -> None:
        """Stop looking for ``owner``'s model."""
        self.pending.discard(owner)
        self._remove_when_done()

    def _remove_when_done(self) -> None:
        if not self.pending and self.handle is not None:
            self.handle.remove()
            self.handle = None


_finder = _Finder()


def refuse_wrapper(ddp: DistributedDataParallel) -> None:
    """RuntimeError when ``ddp`` wraps parameters a live ``ShardedFusedAdam`` trains."""
    held = {id(p) for p in ddp.module.parameters()}
    if any(id(p) in held for opt in live.optimizers() for p in live.params_of(opt)):
        raise RuntimeError(
            f"DistributedDataParallel wraps parameters that a ShardedFusedAdam trains (its forward was called): {_FIX}"
        )


def watch(owner: Any, module: Optional[nn.Module]) -> Callable[[], None]:
    """Refuse any DDP forward around ``owner``'s parameters from now on (see the module docstring).

    Args:
        owner: the optimizer (held weakly).
        module: its model, when known.

    Returns:
        What stops the watch: removes the hook from ``module``, or stops looking for ``owner``'s model.
    """
    if module is not None:
        return refuse_ddp_forward(module, owner).remove
    _finder.add(owner)
    ref = weakref.ref(owner)  # not the owner itself: it keeps what this returns

    def stop() -> None:
        held = ref()
        if held is not None:
            _finder.discard(held)

    return stop
