"""``torch.amp.GradScaler`` driving a ``ShardedFusedAdam``: torch's contract for optimizers that scale.

GradScaler reaches gradients through ``p.grad``, which stages 2 and 3 do not keep, and decides on
each rank alone whether a step is skipped. So the optimizer takes the scaling over, as torch lets an
optimizer with ``_step_supports_amp_scaling`` do: ``scaler.step(opt)`` calls ``opt.step(grad_scaler=
scaler)`` (torch warns once that it may pass the scale as attributes instead, in a later release),
and the step

- unscales the gradients inside the fused kernel: their multiplier gains ``1 / scale``, computed as
  GradScaler computes it, unless ``scaler.unscale_(opt)`` already divided them in ``p.grad``
  (stages 0 and 1 keep the gradients there; at stages 2 and 3 ``unscale_`` reaches nothing and the
  reduced gradient shard is still scaled, and so is the wider buffer of stages 0-1 with a ``grad_accum_dtype``
  wider than the gradients, ``p.grad`` being None there too);
- skips, on every rank, a step whose gradients hold inf/NaN on some rank (whatever
  ``skip_nonfinite_steps`` says), and hands that global flag to the scaler as the found-inf of this
  optimizer, so ``scaler.update()`` backs off or grows the scale the same way on every rank.

GradScaler's other way, the scale and its found-inf set as the optimizer's attributes ``grad_scale`` and
``found_inf`` (taken for an optimizer whose ``step`` does not show ``grad_scaler``: a wrapper hid it), is
refused before anything changes: that found-inf comes from ``p.grad`` on one rank.

``opt.clip_grad_norm_`` between ``scaler.unscale_(opt)`` and ``scaler.step(opt)`` measures the
unscaled gradients once the optimizer has seen the scaler (from the second step on); at the first
step it cannot know the scale, returns the norm of the scaled gradients and logs it once, while the
step itself applies the right clipping (the norm is corrected then); unless told of the scaler before
(``expect_scaler``: Accelerate's, by ``ZeroAccelerator.clip_grad_norm_``). ``max_grad_norm`` (clipping
inside the step) is right from the first step. With ``gradient_accumulation_steps``, ``scaler.step``
must come only on the micro-step that updates (GradScaler's scale must not change inside a window).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.amp.grad_scaler import OptState

from ..stages import grad_state

log = logging.getLogger("zero_kernels")


@dataclass(frozen=True)
class ScaledStep:
    """What one step takes from the scaler: the gradients' extra multiplier, and where to report found-inf."""

    scaler: Any
    multiplier: Optional[torch.Tensor]  # float64 0-d: 1 / scale when the gradients are still scaled, else None
    inv_scale: torch.Tensor  # float64 0-d: 1 / scale

    def record(self, opt: Any, skip: Optional[torch.Tensor]) -> None:
        """Report the step's global inf/NaN flag as this optimizer's found-inf, for ``scaler.update()``."""
        state = self.scaler._per_optimizer_states[id(opt)]
        if skip is None:
            skip = torch.zeros((), dtype=torch.float32, device=self.inv_scale.device)
        state["found_inf_per_device"] = {skip.device: skip.detach().float().reshape(()).clone()}


def _inv_scale(scaler: Any) -> torch.Tensor:
    """``1 / scale`` as GradScaler's ``unscale_`` computes it (fp32), as a float64 0-d tensor."""
    scale = scaler._scale
    if scale is None:
        raise RuntimeError("GradScaler: scaler.step(opt) before any scaler.scale(loss): there is no scale yet")
    return scale.double().reciprocal().float().double()


def _seen_scaler(opt: Any) -> Optional[Any]:
    """The GradScaler that last stepped ``opt`` (None: none yet, or it is gone)."""
    ref = getattr(opt, "_grad_scaler", None)
    return ref() if ref is not None else None


def expect_scaler(opt: Any, scaler: Any) -> None:
    """Take ``scaler`` as the GradScaler ``opt`` has seen, before its first ``scaler.step(opt)``, where the caller
    knows that this scaler steps it (Accelerate's, whose ``clip_grad_norm_`` measures before that step): a norm taken
    then is the unscaled gradients' one. Nothing changes once a scaler has stepped ``opt``, or where its fp16 config
    scales the loss (the step refuses a GradScaler there).

    Args:
        opt: the ``ShardedFusedAdam``.
        scaler: the ``torch.amp.GradScaler`` that will step it.
    """
    if _seen_scaler(opt) is None and opt.loss_scaler is None:
        opt._grad_scaler = weakref.ref(scaler)


def _scaling(scaler: Optional[Any]) -> bool:
    """Whether ``scaler`` is an enabled GradScaler that has a scale."""
    return scaler is not None and scaler.is_enabled() and scaler._scale is not None


def unscaled_in_p_grad(opt: Any) -> bool:
    """Whether ``scaler.unscale_(opt)`` divided the gradients the optimizer reads since its last step, the scaler
    known (it stepped the optimizer before): a checkpoint saved then keeps it, as the resumed scaler cannot."""
    scaler = _seen_scaler(opt)
    if not _scaling(scaler) or scaler._per_optimizer_states[id(opt)]["stage"] is not OptState.UNSCALED:
        return False
    if opt.pipeline.grads_in_p_grad:  # unscale_ divided p.grad, which a checkpoint keeps, also where stage 1 had
        return True  # reduced it into its shard before (the step was to unscale the shard: it reduces p.grad again)
    return not _still_scaled(scaler, opt)


def _still_scaled(scaler: Any, opt: Any) -> bool:
    """Whether the gradients the optimizer reads still carry the scale (``unscale_`` did not reach them, and no
    checkpoint loaded them divided already: ``opt._unscaled_loaded``)."""
    if getattr(opt, "_unscaled_loaded", False):
        return False
    state = scaler._per_optimizer_states[id(opt)]
    if state["stage"] is OptState.READY:
        return True
    pipeline = opt.pipeline
    if pipeline.grads_in_p_grad:  # unscale_ divided p.grad, unless stage 1 had reduced it into its shard before
        return getattr(opt, "_reduced_early", None) == _SCALED
    reached = bool(state["found_inf_per_device"])  # unscale_ found gradients left in p.grad (no_sync)
    if reached and pipeline.wide_local:
        raise RuntimeError(
            f"ShardedFusedAdam (stage {pipeline.stage}): scaler.unscale_(opt) divided gradients set in p.grad by hand "
            "but cannot reach those added up in the wider grad_accum_dtype (p.grad is None after backward there); "
            "do not call scaler.unscale_(opt) after setting p.grad (the step unscales)"
        )
    if reached and pipeline.reduced_since_step:
        raise RuntimeError(
            f"ShardedFusedAdam (stage {pipeline.stage}): scaler.unscale_(opt) divided the gradients still in p.grad "
            "(backward passes under no_sync) but cannot reach those already reduced into the gradient shard; run "
            "the last backward of the step outside no_sync (or do not call scaler.unscale_(opt))"
        )
    return not reached


_SCALED, _UNSCALED, _UNKNOWN = "scaled", "unscaled", "unknown"


def note_reduction(opt: Any) -> None:
    """Before a call that reduces stage 1's gradients ahead of the step (a norm, a gradient read: the step then
    reads that shard, not ``p.grad``): whether a GradScaler's ``unscale_`` had divided ``p.grad`` by then. ``unscale_``
    after it divides ``p.grad`` alone, so the step unscales the shard itself (``_still_scaled``); where no scaler was
    known yet (the first step), the step reduces again (``begin``)."""
    pipeline = opt.pipeline
    if not (pipeline.grads_in_p_grad and pipeline.num_shards > 1) or pipeline.grads_final:
        return
    scaler = _seen_scaler(opt)
    if scaler is None:  # whether unscale_ ran before: seen at the step from a sample of p.grad taken now
        opt._reduced_early = _UNKNOWN
        opt._reduced_sample = grad_state.sample_local(pipeline)
    elif _scaling(scaler) and scaler._per_optimizer_states[id(opt)]["stage"] is not OptState.UNSCALED:
        opt._reduced_early = _SCALED
    else:
        opt._reduced_early = _UNSCALED


def forget_reduction(opt: Any) -> None:
    """The gradients were used or dropped: no early reduction is pending."""
    opt._reduced_early = opt._reduced_sample = None


def _settle_unknown(scaler: Any, opt: Any) -> None:
    """At the first ``scaler.step(opt)``, of a stage-1 reduction made before the scaler was known: where
    ``unscale_`` has run and ``p.grad`` changed since the reduction read it, ``unscale_`` came after it, so the shard
    is still scaled (where no rank's sample can tell, ``p.grad`` is reduced again, on every rank)."""
    unscaled = scaler._per_optimizer_states[id(opt)]["stage"] is OptState.UNSCALED
    changed = grad_state.local_changed(opt.pipeline, opt._reduced_sample) if unscaled else False
    changed = grad_state.agreed_change(opt.pipeline, changed)  # one rank alone must not reduce again
    opt._reduced_early = _SCALED if changed else _UNSCALED
    if changed is None:
        opt.pipeline.reduce_again()
        opt._reduced_early = _UNSCALED
    opt._reduced_sample = None


def begin(scaler: Any, opt: Any) -> Optional[ScaledStep]:
    """The scaled step ``scaler`` asks of ``opt`` (None: no scaler, or a disabled one); raises on misuse.

    Args:
        scaler: the ``grad_scaler`` given to ``opt.step`` (a ``torch.amp.GradScaler``).
        opt: the ``ShardedFusedAdam``.
    """
    if scaler is None and "found_inf" in vars(opt):
        _refuse_attributes(opt)
    if scaler is None or not scaler.is_enabled():
        return None
    if opt.loss_scaler is not None:
        raise ValueError(
            "ShardedFusedAdam.step: a torch.amp.GradScaler and the fp16 loss scaling of the config both scale the "
            "loss; use one of them (opt.backward(loss) with the fp16 config, or scaler.scale(loss).backward())"
        )
    if opt.micro_step + 1 < opt.gradient_accumulation_steps:
        raise RuntimeError(
            f"ShardedFusedAdam.step: scaler.step(opt) on accumulation micro-step {opt.micro_step + 1} of "
            f"{opt.gradient_accumulation_steps}: the scale must not change inside the window. Call opt.step() on "
            "the first micro-steps and scaler.step(opt); scaler.update() on the last, or accumulate with opt.no_sync()"
        )
    opt._grad_scaler = weakref.ref(scaler)
    if getattr(opt, "_reduced_early", None) == _UNKNOWN:
        _settle_unknown(scaler, opt)
    inv = _inv_scale(scaler)
    return ScaledStep(scaler, inv if _still_scaled(scaler, opt) else None, inv)


def _refuse_attributes(opt: Any) -> None:
    """``RuntimeError``, the scaler's attributes removed, nothing else changed: GradScaler passed the scale as the
    attributes ``grad_scale`` and ``found_inf`` (its way for an optimizer whose ``step`` does not show a
    ``grad_scaler`` parameter: a wrapper hid it), its found-inf taken from ``p.grad`` on this rank alone."""
    for name in ("grad_scale", "found_inf"):
        vars(opt).pop(name, None)
    raise RuntimeError(
        "ShardedFusedAdam.step: torch.amp.GradScaler called it through a wrapper that hides step's grad_scaler "
        "parameter, so the scaler passed the scale as attributes, with an inf/NaN check made on this rank's p.grad "
        "alone (stage 1 holds the local gradients there, stages 2-3 none), which would unscale nothing and let the "
        "ranks' scales part. Call scaler.step(opt) on the ShardedFusedAdam itself, or wrap its step with "
        "functools.wraps(opt.step) (with Accelerate, use ZeroAccelerator); nothing was changed"
    )


def clip_factor(opt: Any) -> tuple[Optional[torch.Tensor], bool]:
    """(extra multiplier of the gradients for ``clip_grad_norm_``, whether the scaler is known).

    The multiplier is ``1 / scale`` when the optimizer has seen an enabled GradScaler and the gradients
    it reads are still scaled; unknown until the first ``scaler.step(opt)``.
    """
    scaler = _seen_scaler(opt)
    if not _scaling(scaler):
        return None, scaler is not None
    return (_inv_scale(scaler) if _still_scaled(scaler, opt) else None), True


def correct_clip(norm: torch.Tensor, step: ScaledStep, opt: Any) -> torch.Tensor:
    """A norm ``clip_grad_norm_`` measured before the scaler was known, as the unscaled gradients have it."""
    if step.multiplier is None and opt.pipeline.grads_in_p_grad:
        return norm  # unscale_ divided p.grad before the norm was taken
    log.warning(
        "zero_kernels: opt.clip_grad_norm_() ran before the optimizer had seen the GradScaler, so it returned the "
        "norm of the scaled gradients; the step clips by the unscaled norm, and later calls return it"
    )
    return norm * step.inv_scale.to(norm.device)
