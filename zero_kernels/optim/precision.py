"""Loss scaling for fp16 training, DeepSpeed's rules (``fp16`` section of the config).

Usage with ``ShardedFusedAdam``: ``opt.backward(loss)`` runs ``(loss / gradient_accumulation_steps *
opt.loss_scale).backward()``, as DeepSpeed's ``engine.backward``; ``opt.step()`` divides the gradients
by the scale inside the fused kernel, skips the update when any gradient on any rank is inf/NaN, and
calls ``LossScaler.update(overflow)``.

Dynamic scaling (``loss_scale == 0``), step for step as DeepSpeed 0.19's ``DynamicLossScaler``:
start at ``2**initial_scale_power``. On an overflow, spend one unit of hysteresis; when only one is
left, halve the scale instead (never below ``min_loss_scale``; an overflow at the minimum raises
``LossScaleError``, where DeepSpeed stops the run too). A good step that follows ``k > 0``
consecutive good steps since the last overflow (or the start) doubles the scale when ``k`` is a
multiple of ``loss_scale_window`` and refills the hysteresis: the first doubling comes on the
``window + 1``-th good step, the next ones every ``window`` steps. With
``consecutive_hysteresis`` every good step refills the hysteresis. A static scale
(``loss_scale > 0``) never changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class LossScaleError(RuntimeError):
    """Gradients overflowed at the minimum loss scale: scaling cannot help any more."""


@dataclass
class LossScaler:
    """Loss-scale state machine.

    Args:
        scale: current loss scale.
        dynamic: whether ``update`` changes the scale.
        window: ``loss_scale_window``: good steps between doublings.
        hysteresis: overflows tolerated before the scale halves.
        min_scale: lower bound of the scale.
        good_steps: consecutive good steps since the last overflow (or the start).
        hysteresis_left: overflows left before the scale halves.
        consecutive_hysteresis: refill the hysteresis on every good step.
    """

    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    good_steps: int = 0
    hysteresis_left: int = 2
    consecutive_hysteresis: bool = False

    @classmethod
    def from_fp16_config(cls, fp16: Any) -> "LossScaler":
        """Build from a ``config.FP16Config`` (or any object with the same fields).

        Args:
            fp16: ``loss_scale`` (0 = dynamic), ``initial_scale_power``, ``loss_scale_window``,
                ``hysteresis``, ``min_loss_scale``, ``consecutive_hysteresis``.
        """
        dynamic = fp16.loss_scale == 0
        scale = float(2**fp16.initial_scale_power) if dynamic else float(fp16.loss_scale)
        return cls(
            scale=scale,
            dynamic=dynamic,
            window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis,
            min_scale=float(fp16.min_loss_scale),
            hysteresis_left=fp16.hysteresis,
            consecutive_hysteresis=bool(fp16.consecutive_hysteresis),
        )

    def update(self, overflow: bool) -> None:
        """Account for one step that overflowed (and was skipped) or not.

        Raises ``LossScaleError``, changing nothing, on an overflow at ``min_scale`` with no
        hysteresis left.

        Args:
            overflow: True when some gradient was inf/NaN.
        """
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
            elif self.scale == self.min_scale:
                raise LossScaleError(
                    f"fp16: the gradients overflowed at the minimum loss scale {self.scale:g} (min_loss_scale) with "
                    "no hysteresis left: lowering the scale cannot help any more (DeepSpeed stops here too). Lower "
                    "the learning rate, look for inf/NaN in the data or the loss, or train in bf16"
                )
            else:
                self.scale = max(self.scale / 2.0, self.min_scale)
            self.good_steps = 0
            return
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        if self.good_steps > 0 and self.good_steps % self.window == 0:
            self.scale *= 2.0
            self.hysteresis_left = self.hysteresis
        self.good_steps += 1

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "hysteresis_left": self.hysteresis_left,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
