"""Loss scaling for fp16 training, DeepSpeed's rules (``fp16`` section of the config).

Usage with ``ShardedFusedAdam``: ``opt.backward(loss)`` runs ``(loss * opt.loss_scale).backward()``;
``opt.step()`` divides the gradients by the scale inside the fused kernel, skips the update when
any gradient on any rank is inf/NaN, and calls ``LossScaler.update(overflow)``.

Dynamic scaling (``loss_scale == 0``): start at ``2**initial_scale_power``. On an overflow, spend
one unit of hysteresis; when none is left, halve the scale (never below ``min_loss_scale``).
After ``loss_scale_window`` consecutive good steps, double the scale and refill the hysteresis.
A static scale (``loss_scale > 0``) never changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class LossScaler:
    """Loss-scale state machine.

    Args:
        scale: current loss scale.
        dynamic: whether ``update`` changes the scale.
        window: good steps before the scale doubles.
        hysteresis: overflows tolerated before the scale halves.
        min_scale: lower bound of the scale.
    """

    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    good_steps: int = 0
    hysteresis_left: int = 2

    @classmethod
    def from_fp16_config(cls, fp16: Any) -> "LossScaler":
        """Build from a ``config.FP16Config`` (or any object with the same fields).

        Args:
            fp16: ``loss_scale`` (0 = dynamic), ``initial_scale_power``, ``loss_scale_window``,
                ``hysteresis``, ``min_loss_scale``.
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
        )

    def update(self, overflow: bool) -> None:
        """Account for one step that overflowed (and was skipped) or not.

        Args:
            overflow: True when some gradient was inf/NaN.
        """
        if not self.dynamic:
            return
        if overflow:
            self.good_steps = 0
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
            else:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self.good_steps += 1
        if self.good_steps == self.window:
            self.scale *= 2.0
            self.good_steps = 0
            self.hysteresis_left = self.hysteresis

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
