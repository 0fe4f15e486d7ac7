"""Clips asked for before a step, composed as ``torch.nn.utils.clip_grad_norm_``'s in-place clips compose.

Stages 1-3 cannot scale the gradients where ``clip_grad_norm_`` runs (they live in shards, or are reduced only at
the step), so each call records what it asked for and the step applies the product of the coefficients. Torch
scales ``p.grad`` at each call, so a later call measures the gradients an earlier one already scaled: clipping to
0.02 and then to 0.05 leaves the 0.02 clip, and the second call returns about 0.02. ``PendingClips`` gives the same:
a norm measured on the unscaled gradients (``measured``) is seen multiplied by the coefficients of the clips asked
for before it; a norm the caller gives (``clip_grads_with_norm_``) is taken as it is, as torch takes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from ..stages.outcome import clip_coef

Correct = Callable[[torch.Tensor, bool], torch.Tensor]  # (norm, scale known when asked) -> the norm to clip by


@dataclass(frozen=True)
class _Asked:
    norm: torch.Tensor  # float64, 0-d
    max_norm: float
    scale_known: bool  # whether a GradScaler's scale was known when the norm was taken (``amp.clip_factor``)
    measured: bool  # taken from the gradients as the step will read them, before the earlier clips' coefficients


class PendingClips:
    """The clips of the coming step (see the module docstring)."""

    def __init__(self) -> None:
        self._asked: list[_Asked] = []

    def ask(self, norm: Union[float, torch.Tensor], max_norm: float, scale_known: bool, measured: bool) -> None:
        """Record a clip to ``max_norm`` by ``norm`` (``measured``: before the coefficients of earlier clips)."""
        self._asked.append(_Asked(torch.as_tensor(norm, dtype=torch.float64), float(max_norm), scale_known, measured))

    def seen(self, measured: torch.Tensor) -> torch.Tensor:
        """A norm measured on the gradients as the step reads them, as torch would measure it now: after the
        clips asked for so far."""
        coef = _product(self._asked, lambda norm, known: norm)
        return measured if coef is None else measured * coef.to(measured.device)

    def coefficient(self, correct: Correct) -> Optional[torch.Tensor]:
        """The coefficient of every clip asked for (None: none), each norm passed through ``correct`` first (a
        GradScaler learnt of after the norm was taken); the step forgets them (``clear``) once it has run, so a
        step refused before any update (a NaN lr, ranks disagreeing) applies them when called again."""
        return _product(self._asked, correct)

    def max_norm(self) -> Optional[float]:
        """The smallest finite ``max_norm`` asked for (None: no clip), which the ranks compare at the step: the clips
        compose to about the smallest's, whatever their order."""
        finite = [a.max_norm for a in self._asked if math.isfinite(a.max_norm)]
        return min(finite) if finite else None

    def clear(self) -> None:
        self._asked = []

    def to_list(self) -> list[list[Any]]:
        """The clips asked for as plain data (a checkpoint saved between them and the step keeps them)."""
        return [[float(a.norm), a.max_norm, a.scale_known, a.measured] for a in self._asked]

    def load_list(self, asked: list[list[Any]]) -> None:
        """The clips ``to_list`` gave, asked for again."""
        self._asked = [_Asked(torch.tensor(norm, dtype=torch.float64), *rest) for norm, *rest in asked]

    def __bool__(self) -> bool:
        """Whether a clip is asked for (``p.grad`` is then not yet clipped as the step will clip it); a call that only
        measures (``max_norm`` inf) clips nothing."""
        return any(math.isfinite(a.max_norm) for a in self._asked)


def _product(asked: list[_Asked], correct: Correct) -> Optional[torch.Tensor]:
    coef: Optional[torch.Tensor] = None
    for a in asked:
        norm = correct(a.norm, a.scale_known)
        if a.measured and coef is not None:
            norm = norm * coef.to(norm.device)
        step = torch.where(torch.isfinite(norm), clip_coef(norm, a.max_norm), 1.0)
        coef = step if coef is None else coef * step
    return coef
