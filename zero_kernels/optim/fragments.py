"""DeepSpeed's tensor-fragment functions (``deepspeed.utils.safe_get_full_fp32_param`` and the rest) for the
parameters a ``ShardedFusedAdam`` trains, under the same names and arguments.

A script written for DeepSpeed reads or writes one parameter's fp32 value, optimizer state or gradient although
each rank holds only a piece of it; these functions find the live optimizer that trains the parameter (``live``)
and go through its state door (``stages.state_door``):

- ``safe_get_full_*`` return the whole tensor, fp32, shaped as the parameter, the same on every rank; they are
  collectives where the state is sharded (every rank calls them, for the same parameters in the same order);
- ``safe_set_full_*`` take the whole tensor (the same on every rank; each rank writes the part it holds);
- ``safe_get_local_*``/``safe_set_local_*``: this rank's piece, 1-D, the elements it holds of the flattened
  parameter in order (as ``opt.state[p]`` shows a piece: ``state_view``); empty where it holds none. DeepSpeed
  has them at stage 3 only; here at every stage.

What they see:

- ``fp32_param``: the parameter's fp32 value, which the next step starts from (the master of a bf16/fp16
  parameter; an fp32 parameter is its own). Setting it writes the master and the parameter (rounded to its
  dtype) wherever the model reads it, so the model sees the new value at once;
- ``optimizer_state``: ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with AMSGrad), None before the
  parameter's first step, as ``torch.optim.AdamW`` has no state then;
- ``grad``: the gradient this step's update will use for the parameter, fp32: reduced over the ranks, divided
  as the step divides it (the accumulation steps, the fp16 loss scale, a GradScaler's scale), times what
  ``scale_grads_`` and ``clip_grad_norm_`` asked for so far, as torch's in-place calls leave ``p.grad``. At every
  stage the same value (DeepSpeed returns ``p.grad`` where it is set, still scaled by the loss scale with fp16).
  Read and written after the last backward of the step, before ``step()`` (inside the accumulation window:
  an error, as for the norm); getting it may complete the gradients' reduction (a collective at every stage,
  the full one also to agree whether any rank has a gradient: None where none has). A gradient set stands for
  the step's: it is divided back by what the step multiplies by, and a later backward's gradients are refused
  at the step, as after a clip.

A parameter no live ``ShardedFusedAdam`` trains (frozen, or never given to one): the getters return None, as
DeepSpeed's; the setters raise ``ValueError`` naming it (DeepSpeed's change nothing, without a word).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from .. import live
from ..stages import state_door as door
from . import amp

_STATE_KEYS = door.MOMENTS  # what ``optim_state_key`` may name (the master is ``fp32_param``)


def _owner(param: torch.Tensor) -> Optional[Any]:
    """The live optimizer that trains ``param`` (the one built last, where several do), or None."""
    for opt in reversed(live.optimizers()):
        if door.trained_index(opt.pipeline, param) is not None:
            return opt
    return None


def _trainer(param: torch.Tensor, what: str) -> Any:
    opt = _owner(param)
    if opt is None:
        shape = tuple(param.shape)
        raise ValueError(
            f"{what}: the parameter of shape {shape} is not trained by any live ShardedFusedAdam (frozen when "
            "the optimizer was built, or never given to it): nothing was written"
        )
    return opt


def _state_key(key: str, what: str) -> str:
    if key not in _STATE_KEYS:
        raise KeyError(f"{what}: optim_state_key must be one of {', '.join(_STATE_KEYS)}, got {key!r}")
    return key


def _stepped(opt: Any, param: torch.Tensor) -> bool:
    return opt.pipeline.steps.get(door.trained_index(opt.pipeline, param), 0) > 0


def _local(opt: Any, param: torch.Tensor, kind: str) -> torch.Tensor:
    pieces = [view.float() for _, view in door.runs(opt.pipeline, param, kind)]
    device = door.device_of(opt.pipeline, param)
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.float32, device=device)


def _whole(opt: Any, param: torch.Tensor, value: Any, what: str) -> torch.Tensor:
    """``value`` as the flattened whole parameter, fp32, on the parameter's device (its shape checked)."""
    shape = opt.pipeline.param_shape(param)
    value = torch.as_tensor(value)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{what}: a value of shape {tuple(value.shape)} for a parameter of shape {tuple(shape)}")
    return value.detach().to(device=door.device_of(opt.pipeline, param), dtype=torch.float32).reshape(-1)


def _write_local(opt: Any, param: torch.Tensor, kind: str, value: Any, what: str) -> None:
    """This rank's runs of ``kind`` from ``value`` (its piece, 1-D)."""
    local = door.runs(opt.pipeline, param, kind)
    numel = sum(view.numel() for _, view in local)
    value = torch.as_tensor(value)
    if value.numel() != numel:
        raise ValueError(f"{what}: this rank holds {numel} elements of the parameter, the value has {value.numel()}")
    flat = value.detach().reshape(-1).to(device=door.device_of(opt.pipeline, param), dtype=torch.float32)
    pieces, at = [], 0
    for start, view in local:
        pieces.append((start, flat.narrow(0, at, view.numel())))
        at += view.numel()
    # the fp32 value: every copy the model reads takes every rank's new piece; else through the door's writer (a
    # gradient shard kept in a file is no view to write into)
    whole = (
        door.assemble(opt.pipeline, param, pieces) if kind == door.PARAM else door.spread(opt.pipeline, param, pieces)
    )
    door.write_runs(opt.pipeline, param, kind, whole.reshape(-1))


def _complete_grads(opt: Any, what: str) -> None:
    """This step's gradients reduced and final (a collective); refused inside the accumulation window."""
    if opt.micro_step + 1 < opt.gradient_accumulation_steps:
        raise RuntimeError(
            f"{what} on accumulation micro-step {opt.micro_step + 1} of {opt.gradient_accumulation_steps}: the "
            "gradients are complete only before the step that updates; call it there"
        )
    amp.note_reduction(opt)
    opt.pipeline.finish_grad_sync()


def _grad_multiplier(opt: Any) -> float:
    """What the step multiplies the reduced gradients by before Adam: the accumulation steps or the fp16 loss
    scale divided out, a GradScaler's scale, ``scale_grads_`` and the clips asked for so far."""
    factor, _ = amp.clip_factor(opt)
    multiplier = opt._grad_factor / opt._grad_divisor * (1.0 if factor is None else float(factor))
    clips = opt._clips.coefficient(lambda norm, scale_known: norm)
    return multiplier if clips is None else multiplier * float(clips)


def _settable_multiplier(opt: Any, what: str) -> float:
    """``_grad_multiplier`` once the gradients are complete, where a gradient set now can reach the update."""
    _complete_grads(opt, what)
    multiplier = _grad_multiplier(opt)
    if not multiplier > 0:
        raise ValueError(
            f"{what}: the step multiplies this step's gradients by {multiplier} (scale_grads_(0), or a clip to 0): "
            "no gradient set now could reach the update; nothing was written"
        )
    return multiplier


def _any_grad(opt: Any, param: torch.Tensor) -> bool:
    """Whether some rank got a gradient for ``param`` this step (a collective on several ranks)."""
    pipeline = opt.pipeline
    flag = torch.tensor([float(pipeline.has_grad.get(door.trained_index(pipeline, param), False))])
    if pipeline.world_size > 1:
        flag = flag.to(pipeline.column_device)
        pipeline.engine.all_reduce(flag, op="max", name="fragment.has_grad").wait()
    return bool(flag.item())


# ---------------------------------------------------------------- whole tensors
def safe_get_full_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The fp32 value of ``param`` the next step starts from, whole (None: no live optimizer trains it)."""
    opt = _owner(param)
    if opt is None:
        return None
    return door.assemble(opt.pipeline, param, door.runs(opt.pipeline, param, door.PARAM))


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Give ``param`` the fp32 ``value`` (its shape; the same on every rank): the master and the parameter."""
    what = "safe_set_full_fp32_param"
    opt = _trainer(param, what)
    door.write_runs(opt.pipeline, param, door.PARAM, _whole(opt, param, value, what))


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> Optional[torch.Tensor]:
    """``param``'s ``exp_avg``, ``exp_avg_sq`` or ``max_exp_avg_sq``, whole (None: not trained, or before its first
    step; an AMSGrad key of a group without AMSGrad: ``KeyError``)."""
    opt = _owner(param)
    if opt is None:
        return None
    key = _state_key(optim_state_key, "safe_get_full_optimizer_state")
    if not _stepped(opt, param):
        return None
    return door.assemble(opt.pipeline, param, door.runs(opt.pipeline, param, key))


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set ``param``'s ``optim_state_key`` state to ``value`` (its shape; the same on every rank)."""
    what = "safe_set_full_optimizer_state"
    opt = _trainer(param, what)
    key = _state_key(optim_state_key, what)
    _require_state(opt, param, what)
    door.write_runs(opt.pipeline, param, key, _whole(opt, param, value, what))


def safe_get_full_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient this step's update will use for ``param``, whole, fp32 (None: not trained, or no rank has a
    gradient for it this step)."""
    opt = _owner(param)
    if opt is None:
        return None
    _complete_grads(opt, "safe_get_full_grad")
    if not _any_grad(opt, param):
        return None
    return door.assemble(opt.pipeline, param, door.runs(opt.pipeline, param, door.GRAD)) * _grad_multiplier(opt)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``value`` (its shape; the same on every rank) the gradient this step's update uses for ``param``."""
    what = "safe_set_full_grad"
    opt = _trainer(param, what)
    if value is None:  # torch.as_tensor(None) would say only "Could not infer dtype of NoneType"
        raise TypeError(
            f"{what}: None for the parameter of shape {tuple(opt.pipeline.param_shape(param))}: the value is its "
            "full gradient, a tensor. To leave a parameter out of a step, call p.requires_grad_(False) before its "
            "backward, or set p.grad = None in a post-accumulate-grad hook (p.register_post_accumulate_grad_hook)"
        )
    multiplier = _settable_multiplier(opt, what)
    door.write_runs(opt.pipeline, param, door.GRAD, _whole(opt, param, value, what) / multiplier)
    _mark_grad(opt, param)


def safe_update_full_grad_vectorized(param_list: Sequence[torch.Tensor], update_func: Callable) -> None:
    """For every parameter of ``param_list`` that requires grad: ``update_func(its full gradient or None, param)``,
    and where that returns a tensor, it becomes the gradient (``safe_set_full_grad``)."""
    for param in param_list:
        if param.requires_grad:
            new = update_func(safe_get_full_grad(param), param)
            if new is not None:
                safe_set_full_grad(param, new)


# ---------------------------------------------------------------- this rank's piece
def safe_get_local_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's piece of ``param``'s fp32 value (1-D; None: not trained)."""
    opt = _owner(param)
    return None if opt is None else _local(opt, param, door.PARAM)


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write this rank's piece of ``param``'s fp32 value (the model reads every rank's new piece at once: a
    collective where the state is sharded)."""
    what = "safe_set_local_fp32_param"
    _write_local(_trainer(param, what), param, door.PARAM, value, what)


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> Optional[torch.Tensor]:
    """This rank's piece of ``param``'s ``optim_state_key`` state (1-D; None: not trained, or before its first
    step)."""
    opt = _owner(param)
    if opt is None:
        return None
    key = _state_key(optim_state_key, "safe_get_local_optimizer_state")
    return _local(opt, param, key) if _stepped(opt, param) else None


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Write this rank's piece of ``param``'s ``optim_state_key`` state."""
    what = "safe_set_local_optimizer_state"
    opt = _trainer(param, what)
    key = _state_key(optim_state_key, what)
    _require_state(opt, param, what)
    _write_local(opt, param, key, value, what)


def safe_get_local_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's piece of the gradient this step's update will use (1-D, fp32; zeros where no rank had one; None:
    not trained). It may complete the gradients' reduction: call it on every rank."""
    opt = _owner(param)
    if opt is None:
        return None
    _complete_grads(opt, "safe_get_local_grad")
    return _local(opt, param, door.GRAD) * _grad_multiplier(opt)


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write this rank's piece of the gradient this step's update will use for ``param`` (call it on every rank)."""
    what = "safe_set_local_grad"
    opt = _trainer(param, what)
    multiplier = _settable_multiplier(opt, what)
    _write_local(opt, param, door.GRAD, torch.as_tensor(value).float() / multiplier, what)
    _mark_grad(opt, param)


def _mark_grad(opt: Any, param: torch.Tensor) -> None:
    """``param`` has a gradient this step, and a later backward's is refused at the step (as after a clip). Set
    before the optimizer has seen a GradScaler (its first ``scaler.step(opt)``), the value was not multiplied by
    the scale the step will divide out: ``rescale_set_grads`` does it then."""
    opt.pipeline.has_grad[door.trained_index(opt.pipeline, param)] = True
    opt.pipeline.clipped = True
    _, scale_known = amp.clip_factor(opt)
    if not scale_known:
        vars(opt).setdefault(_SET_UNKNOWN_SCALE, {})[id(param)] = param


_SET_UNKNOWN_SCALE = "_fragment_grads_set_scale_unknown"  # {id: parameter} whose gradient was set, scaler unknown


def rescale_set_grads(opt: Any, scale: Optional[float]) -> None:
    """At the step: the gradients set while no GradScaler was known (``_mark_grad``) take the ``scale`` the step
    now divides out (None: it divides nothing); the record is forgotten either way."""
    params = vars(opt).pop(_SET_UNKNOWN_SCALE, {})
    if scale is None:
        return
    for param in params.values():
        local = [(start, view.float() * scale) for start, view in door.runs(opt.pipeline, param, door.GRAD)]
        door.write_runs(opt.pipeline, param, door.GRAD, door.spread(opt.pipeline, param, local))


def forget_set_grads(opt: Any) -> None:
    """The gradients are gone (``zero_grad``): no set gradient waits for a scale."""
    vars(opt).pop(_SET_UNKNOWN_SCALE, None)


def _require_state(opt: Any, param: torch.Tensor, what: str) -> None:
    if not _stepped(opt, param):
        raise RuntimeError(
            f"{what}: {opt.pipeline.name_of(param)} has not stepped yet, so it has no optimizer state "
            "(torch.optim.AdamW makes it at the first step): set it after a step; nothing was written"
        )
