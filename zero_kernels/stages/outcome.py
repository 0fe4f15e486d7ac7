"""What a step decides from its gradients, kept on their device; read by the host only when asked.

A step needs three values that depend on every rank's gradients: the global norm (clipping), the
gradient multiplier after clipping, and whether some gradient is inf/NaN (the step is then
skipped). ``decide`` computes them with tensor operations on the gradients' device, in the same
float64 arithmetic the host used (so results are bit for bit those of a host decision), and the
Adam kernels take the multiplier and the skip flag as one-element device tensors. On a GPU the
step then queues its work and returns without waiting for it.

``StepResult`` carries the norm and the flag back to the host: on CUDA they are copied into
pinned memory behind an event, both on the gradients' device (not the current one), queued before
the step's Adam kernels; ``ready()`` polls it, and reading ``grad_norm`` or ``skipped`` waits for
that copy only (the event: the gradient norm, not the update, nor the rest of the device's queue).
The pipeline reads ``skipped`` when its step counts are next needed (``Pipeline.settle``), typically
at the next step, by which time the device has long passed the point where the flag was computed,
while the next step's forward and backward stay queued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

Scale = Union[float, torch.Tensor]


@dataclass(frozen=True)
class Decision:
    norm: Optional[torch.Tensor]  # float64 0-d: the global norm of the scaled gradients (None: not computed)
    skip: Optional[torch.Tensor]  # fp32 (1,): non-zero when some gradient is not finite (None: not checked)
    grad_scale: Scale  # the kernels' gradient multiplier: a float, or an fp32 (1,) tensor on the device


def clip_coef(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (norm + 1e-6))`` as a float64 tensor (a NaN norm gives 1, as Python's ``min``)."""
    coef = max_norm / (norm + 1e-6)
    return torch.where(coef < 1.0, coef, 1.0)


def decide(
    sq: Optional[torch.Tensor], grad_scale: Scale, max_grad_norm: Optional[float], check_finite: bool
) -> Decision:
    """The step's decision from the global squared norm (or finiteness sum) ``sq``.

    Args:
        sq: float64 0-d: the sum over ranks of the gradients' squared norms when clipping, else a
            sum that is finite exactly when every gradient is (None: neither is needed).
        grad_scale: multiplier of the reduced gradients (float, or a float64 0-d tensor that
            carries ``clip_grad_norm_``'s coefficient).
        max_grad_norm: clip the global norm to this (None: no clipping, and no norm).
        check_finite: produce the skip flag.
    """
    norm = None if sq is None or max_grad_norm is None else sq.sqrt() * grad_scale
    skip = torch.isfinite(sq).logical_not().float().reshape(1) if check_finite and sq is not None else None
    scale: Scale = grad_scale
    if norm is not None:
        scale = clip_coef(norm, max_grad_norm) * grad_scale
    if isinstance(scale, torch.Tensor):
        scale = scale.float().reshape(1)
    return Decision(norm, skip, scale)


def _to_host(flat: torch.Tensor) -> tuple[torch.Tensor, Optional[Any]]:
    """(host copy of ``flat``, the CUDA event that completes it, or None when it is complete already).

    On CUDA everything happens on ``flat``'s device, whatever device is current: the pinned buffer, the
    copy queued on that device's current stream, and the event recorded on that stream (recorded on the
    current device instead, it would complete independently of the copy: the host would read the last
    step's values, and a rank whose current device is not its own would open a context on it).
    """
    if flat.device.type != "cuda":
        return flat.to("cpu"), None
    with torch.cuda.device(flat.device):
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(flat.device))
    return host, event


class StepResult:
    """What a step found: ``grad_norm`` (None unless clipping) and ``skipped``, read when asked.

    Args:
        norm: float64 0-d tensor of the global norm, or None.
        skip: fp32 one-element flag (non-zero: the step updated nothing), or None (never skipped).
    """

    def __init__(self, norm: Optional[torch.Tensor] = None, skip: Optional[torch.Tensor] = None):
        self.skip_flag = skip  # on the device, for whoever acts on it there (a GradScaler's found-inf)
        self._has_norm = norm is not None
        self._values: Optional[tuple[Optional[float], bool]] = None
        self._event: Optional[Any] = None
        parts = [t.reshape(1).double() for t in (norm, skip) if t is not None]
        if not parts:
            self._values = (None, False)
            return
        self._host, self._event = _to_host(torch.cat(parts))

    def ready(self) -> bool:
        """Whether reading the values would not wait for the device."""
        return self._values is not None or self._event is None or self._event.query()

    def _read(self) -> tuple[Optional[float], bool]:
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            values = self._host.tolist()
            norm = values.pop(0) if self._has_norm else None
            self._values = (norm, bool(values and values[0] != 0))
            self._host = self._event = None
        return self._values

    @property
    def grad_norm(self) -> Optional[float]:
        """Global norm of the unscaled, averaged gradients (computed when clipping), else None."""
        return self._read()[0]

    @property
    def skipped(self) -> bool:
        """True when some gradient was not finite and the step updated nothing."""
        return self._read()[1]

    def __getstate__(self) -> dict[str, Any]:
        norm, skipped = self._read()
        return {"values": (norm, skipped)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.skip_flag = None
        self._values = tuple(state["values"])
        self._has_norm = self._values[0] is not None
        self._event = None

    def __repr__(self) -> str:
        if not self.ready():
            return "StepResult(pending)"
        norm, skipped = self._read()
        return f"StepResult(grad_norm={norm}, skipped={skipped})"


class StepCounts:
    """Per-parameter Adam step counts that take a step into account once its outcome is known.

    ``pending(result, with_grad)`` after each step; ``settle()`` reads ``result.skipped`` (at once
    when ``ready()``, else when the counts are next read through ``settled()`` or the next step
    settles first), adds one to each parameter of ``with_grad`` unless the step was skipped, and
    hands the result to ``on_settle`` (the optimizer counts skipped steps and updates its loss scale).
    """

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}  # optimizer param index -> steps taken (the last one maybe not yet)
        self.unsettled: Optional[tuple[StepResult, set[int]]] = None
        self.on_settle: Optional[Callable[[StepResult], None]] = None

    def pending(self, result: StepResult, with_grad: set[int]) -> None:
        """A step was queued: ``with_grad`` advance unless ``result`` says it was skipped."""
        self.settle()
        self.unsettled = (result, with_grad)
        if result.ready():
            self.settle()

    def settle(self) -> None:
        """Apply the last step's outcome (on a GPU: waits for its flag's copy, not for the device's queue)."""
        if self.unsettled is None:
            return
        result, with_grad = self.unsettled
        self.unsettled = None
        if not result.skipped:
            for i in with_grad:
                self.counts[i] += 1
        if self.on_settle is not None:
            self.on_settle(result)

    def settled(self) -> dict[int, int]:
        """The counts, the last step's outcome applied."""
        self.settle()
        return self.counts
