"""torch's gradient clipping on the parameters of a ``ShardedFusedAdam``: right, or an error.

``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` reads ``p.grad``. At stages 2 and
3 that is ``None`` (each rank holds its shard of the reduced gradients), so torch's norm is 0 and
nothing is clipped; at stage 1 ``p.grad`` is this rank's own gradient until the step reduces it,
so each rank clips by its local norm; and wherever the step divides the gradients by a loss scale
or an accumulation count, torch measures them before that division. Frameworks (Accelerate's
``clip_grad_norm_``, plain loops) make exactly this call.

So once a ``ShardedFusedAdam`` exists, torch's ``clip_grad_norm_``, ``get_total_norm``,
``clip_grads_with_norm_`` and ``clip_grad_value_`` look at what they are given:

- no parameter (or gradient) of a live sharded optimizer, or one whose ``p.grad`` is the very
  gradient its step uses (stage 0, or stage 1 on one rank, without loss scaling, accumulation
  steps, a wider ``grad_accum_dtype`` or a clip asked of ``opt.clip_grad_norm_`` since the last step:
  ``p.grad`` is then the mean over ranks, as with DDP): torch's own function runs;
- every parameter the optimizer trains (others may come along if they have no gradient, such as
  frozen ones): ``clip_grad_norm_`` is ``opt.clip_grad_norm_`` (the global norm of the reduced
  gradients, applied by the next step); ``get_total_norm`` of their gradients (stage 1) is that
  global norm; ``clip_grads_with_norm_`` hands its ``total_norm`` to the next step;
- anything else (some of the optimizer's parameters, or them and others that have gradients; an
  empty gradient list while an optimizer that keeps no gradients in ``p.grad`` holds this step's; value clipping)
  cannot be made right, and raises ``ValueError`` saying what to call instead.

The routing replaces the function inside torch's ``no_grad`` wrapper of each of these, so every
reference to them, however early it was imported (``from torch.nn.utils import clip_grad_norm_``),
is routed; where torch's layout differs, the module attributes are replaced instead.

Accelerate's ``Accelerator.clip_grad_norm_`` (from 1.16) keeps only the parameters whose ``p.grad`` is
set before it calls torch: at stages 2 and 3 none is, so it returned 0 and clipped nothing. When
``accelerate`` is imported by the time an optimizer is built, its ``clip_grad_norm_`` hands the
parameters a live ``ShardedFusedAdam`` trains to torch's routed one after unscaling (``clip_sharded``;
``ZeroAccelerator`` does so whatever the import order).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import sys
import types
from typing import Any, Callable, Iterator, Optional

import torch

from .. import live
from . import amp

_in_torch_clip = contextvars.ContextVar("zero_kernels_in_torch_clip", default=False)
_installed = False


def _reduced(pipeline: Any) -> bool:
    """Whether ``p.grad`` holds the reduced gradients: one rank, or a synchronised backward ran since the step and
    left nothing for the step's own round (backward passes under ``no_sync()`` after it)."""
    return pipeline.world_size == 1 or (pipeline.reduced_since_step and not pipeline.owed)


def exact_in_p_grad(optimizer: Any) -> bool:
    """Whether ``p.grad`` holds exactly the gradient ``optimizer``'s next step uses (torch's clip is right)."""
    stage, world = optimizer.options.stage, optimizer.pipeline.world_size
    shared = (stage == 0 or (stage == 1 and world == 1)) and optimizer.pipeline.grads_in_p_grad
    reduced = _reduced(optimizer.pipeline)
    scaled = optimizer._loss_scaler is not None  # fp16: p.grad holds the gradients times the loss scale
    unclipped = bool(optimizer._clips) or optimizer._grad_factor != 1.0  # the step applies a clip or a scale
    return shared and reduced and not scaled and not unclipped and optimizer.gradient_accumulation_steps == 1


def _why(optimizer: Any) -> str:
    stage = optimizer.options.stage
    if stage >= 2:
        return f"at stage {stage} p.grad is None: each rank holds its shard of the reduced gradients"
    if not optimizer.pipeline.grads_in_p_grad:
        return f"at stage {stage} p.grad is None: the gradients add up in a buffer of the wider grad_accum_dtype"
    if stage == 1 and optimizer.pipeline.world_size > 1:
        return "at stage 1 p.grad is this rank's own gradient until the step reduces it"
    if not _reduced(optimizer.pipeline):
        return "p.grad holds gradients of backward passes under no_sync(), this rank's own until the step reduces them"
    if optimizer._clips:
        return "p.grad is not yet clipped by the opt.clip_grad_norm_ asked for before: the step applies it"
    if optimizer._grad_factor != 1.0:
        return "p.grad is not yet scaled by the opt.scale_grads_ asked for before: the step applies it"
    if optimizer.scales_loss:
        return f"p.grad holds the gradients times the loss scale ({optimizer.loss_scale:g}), which the step divides out"
    return (
        f"p.grad holds the gradients summed over {optimizer.gradient_accumulation_steps} accumulation micro-steps, "
        "which the step divides out"
    )


_FIX = "pass all of the optimizer's parameters (model.parameters()), or call opt.clip_grad_norm_(max_norm)"


def _owner(params: list[torch.Tensor], what: str) -> Optional[Any]:
    """The sharded optimizer ``params`` belong to when torch's function must not run on them, else None."""
    hit = [opt for opt in live.training(params) if not exact_in_p_grad(opt)]
    if not hit:
        return None
    if len(hit) > 1:
        raise ValueError(
            f"torch.nn.utils.{what}: the parameters given are trained by {len(hit)} ShardedFusedAdam optimizers; "
            "clip each optimizer's parameters with its own opt.clip_grad_norm_(max_norm)"
        )
    opt = hit[0]
    held = {id(p) for p in live.params_of(opt) if p.requires_grad}  # a frozen one in its groups has no gradient
    given = {id(p) for p in params}
    stage = opt.options.stage
    if held - given:
        raise ValueError(
            f"torch.nn.utils.{what} was given {len(held & given)} of the {len(held)} parameters of a "
            f"ShardedFusedAdam at stage {stage}, whose gradients it cannot see ({_why(opt)}); {_FIX}"
        )
    foreign = [p for p in params if id(p) not in held and p.grad is not None]
    if foreign:
        raise ValueError(
            f"torch.nn.utils.{what}: {len(foreign)} of the parameters given have gradients but are not trained by "
            f"the ShardedFusedAdam (stage {stage}) that trains the others; their norm cannot be combined with its "
            "sharded gradients here: clip the optimizer's parameters with opt.clip_grad_norm_ and the others apart"
        )
    return opt


def _as_list(tensors: Any) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _nonfinite(norm: torch.Tensor, norm_type: float) -> None:
    if not math.isfinite(float(norm)):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )


@contextlib.contextmanager
def _inside_torch() -> Iterator[None]:
    token = _in_torch_clip.set(True)
    try:
        yield
    finally:
        _in_torch_clip.reset(token)


def _clip_grad_norm(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = _as_list(parameters)
        opt = _owner(params, "clip_grad_norm_")
        if opt is None:
            keep_warning = not params and isinstance(parameters, types.GeneratorType)
            with _inside_torch():
                return original(iter(()) if keep_warning else params, max_norm, norm_type, error_if_nonfinite, foreach)
        norm = opt.clip_grad_norm_(max_norm, norm_type)
        if error_if_nonfinite:
            _nonfinite(norm, norm_type)
        return norm

    return clip_grad_norm_


def _grads_owner(tensors: list[torch.Tensor]) -> Optional[Any]:
    """The sharded optimizer whose parameters' gradients ``tensors`` are, when torch's norm of them is wrong."""
    grads = {}  # id(p.grad) -> its optimizer
    for opt in live.optimizers():
        if not exact_in_p_grad(opt):
            grads.update((id(p.grad), opt) for p in live.params_of(opt) if p.grad is not None)
    hit = list({id(grads[id(t)]): grads[id(t)] for t in tensors if id(t) in grads}.values())
    if not hit:
        return None
    opt = hit[0]
    mine = {id(p.grad) for p in live.params_of(opt) if p.grad is not None}
    if len(hit) > 1 or {id(t) for t in tensors} != mine:
        raise ValueError(
            "torch.nn.utils.get_total_norm was given some of the gradients of a ShardedFusedAdam's parameters, or "
            f"them and other tensors ({_why(opt)}); opt.clip_grad_norm_(float('inf')) returns the global norm"
        )
    return opt


def _holding_sharded_grads() -> Optional[Any]:
    for opt in live.optimizers():
        if not opt.pipeline.grads_in_p_grad and any(opt.pipeline.has_grad.values()):
            return opt
    return None


def _get_total_norm(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        items = _as_list(tensors)
        if _in_torch_clip.get():
            return original(items, norm_type, error_if_nonfinite, foreach)
        opt = _grads_owner(items) if items else _holding_sharded_grads()
        if opt is None:
            return original(items, norm_type, error_if_nonfinite, foreach)
        if not items:
            raise ValueError(
                "torch.nn.utils.get_total_norm was given no gradients while a ShardedFusedAdam at stage "
                f"{opt.options.stage} holds this step's ({_why(opt)}); opt.clip_grad_norm_(float('inf')) returns "
                "their global norm, and torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) clips them"
            )
        norm = opt._grad_norm(norm_type).float()
        if error_if_nonfinite:
            _nonfinite(norm, norm_type)
        return norm

    return get_total_norm


def _clip_grads_with_norm(original: Callable[..., None]) -> Callable[..., None]:
    def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
        params = _as_list(parameters)
        opt = None if _in_torch_clip.get() else _owner(params, "clip_grads_with_norm_")
        if opt is None:
            return original(params, max_norm, total_norm, foreach)
        opt._clip_with_norm(max_norm, total_norm)
        return None

    return clip_grads_with_norm_


def _clip_grad_value(original: Callable[..., None]) -> Callable[..., None]:
    def clip_grad_value_(parameters, clip_value, foreach=None):
        params = _as_list(parameters)
        opt = next((o for o in live.training(params) if not exact_in_p_grad(o)), None)
        if opt is None:
            return original(params, clip_value, foreach)
        raise ValueError(
            "torch.nn.utils.clip_grad_value_ cannot clip the gradients of a ShardedFusedAdam at stage "
            f"{opt.options.stage} ({_why(opt)}): clip by norm with opt.clip_grad_norm_(max_norm), or set max_grad_norm"
        )

    return clip_grad_value_


_ROUTES = {
    "clip_grad_norm_": _clip_grad_norm,
    "_get_total_norm": _get_total_norm,
    "_clip_grads_with_norm_": _clip_grads_with_norm,
    "clip_grad_value_": _clip_grad_value,
}
_PUBLIC = {"_get_total_norm": "get_total_norm", "_clip_grads_with_norm_": "clip_grads_with_norm_"}


def _replace_inside(wrapper: Any, route: Callable[[Callable], Callable]) -> bool:
    """Put ``route(f)`` in place of the function ``f`` that torch's ``_no_grad`` ``wrapper`` calls."""
    cells = [
        c
        for c in getattr(wrapper, "__closure__", None) or ()
        if isinstance(c.cell_contents, types.FunctionType) and c.cell_contents.__name__ == wrapper.__name__
    ]
    if len(cells) != 1:
        return False
    cells[0].cell_contents = route(cells[0].cell_contents)
    return True


def clip_sharded(accelerator: Any, parameters: list, max_norm: float, norm_type: float) -> torch.Tensor:
    """Accelerate's clipping of parameters a ``ShardedFusedAdam`` trains: unscale, then torch's routed call. The
    optimizers are told first of the accelerator's GradScaler, which will step them: before their first step they
    could not know it, and the norm of the first step was that of the scaled gradients."""
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None:
        for opt in live.training(parameters):
            amp.expect_scaler(opt, scaler)
    accelerator.unscale_gradients()
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)


def _route_accelerate() -> None:
    """Route ``accelerate.Accelerator.clip_grad_norm_`` when ``accelerate`` is imported (see the module docstring)."""
    accelerator = getattr(sys.modules.get("accelerate"), "Accelerator", None)
    if accelerator is None or getattr(accelerator.clip_grad_norm_, "_zero_kernels_routed", False):
        return
    original = accelerator.clip_grad_norm_

    def clip_grad_norm_(self: Any, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        parameters = list(parameters)
        if live.training(parameters):
            return clip_sharded(self, parameters, max_norm, norm_type)
        return original(self, parameters, max_norm, norm_type=norm_type)

    clip_grad_norm_._zero_kernels_routed = True
    clip_grad_norm_.__doc__ = original.__doc__
    accelerator.clip_grad_norm_ = clip_grad_norm_


def install() -> None:
    """Route torch's clipping functions (once per process; the optimizer calls it when built), and
    Accelerate's when it is imported by then."""
    global _installed
    _route_accelerate()
    if _installed:
        return
    clip_grad = torch.nn.utils.clip_grad
    for name, route in _ROUTES.items():
        wrapper = getattr(clip_grad, name, None)
        if wrapper is None or _replace_inside(wrapper, route):
            continue
        routed = torch.no_grad()(route(wrapper))
        setattr(clip_grad, name, routed)
        setattr(torch.nn.utils, _PUBLIC.get(name, name), routed)
    _installed = True
