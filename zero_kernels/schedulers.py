"""DeepSpeed's learning-rate schedules as ``torch.optim.lr_scheduler.LRScheduler`` subclasses.

``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle`` and ``LRRangeTest`` take DeepSpeed's parameter
names and defaults (``deepspeed/runtime/lr_schedules.py``) and give the same learning rate at
every step, so that a DeepSpeed config's ``scheduler`` section trains the same here. Use them as
any torch scheduler: ``scheduler.step()`` after ``optimizer.step()``.

Step counting. DeepSpeed's schedules count ``last_batch_iteration`` from -1 (set at construction)
and ``deepspeed.initialize`` does not step them, so the first optimizer step runs at the value
for iteration -1 (for example ``warmup_min_lr``; 0 for ``WarmupCosineLR``). torch's schedulers
step once at construction (``last_epoch`` 0). Here ``last_batch_iteration == last_epoch - 1``:
after construction and after every ``step()`` the optimizer holds DeepSpeed's value.

State. ``state_dict()`` is torch's (every attribute but the optimizer); ``load_state_dict`` also
takes DeepSpeed's own ``{"last_batch_iteration": n}``, as found in a DeepSpeed checkpoint.

Where these differ from DeepSpeed on purpose: an unknown ``warmup_type`` is an error (DeepSpeed
warns and uses ``"log"``), and every argument is checked when the scheduler is built.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["LRRangeTest", "OneCycle", "SCHEDULERS", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

PerGroup = Union[float, Sequence[float]]
WARMUP_TYPES = ("log", "linear")


def _per_group(optimizer: Optimizer, value: PerGroup, name: str) -> list[float]:
    """One value per param group: a scalar broadcast, or a list with one entry per group (DeepSpeed's rule)."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"{name} has {len(value)} values; the optimizer has {len(optimizer.param_groups)} groups")
        values = list(value)
    else:
        values = [value] * len(optimizer.param_groups)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name}={value!r} is invalid: expected a finite number or one per param group")
    return [float(v) for v in values]


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} is invalid: expected a finite number")
    return float(value)


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} is invalid: expected a positive integer")
    return value


def _warmup_type(value: Any) -> str:
    if value not in WARMUP_TYPES:
        raise ValueError(f"warmup_type={value!r} is invalid: expected one of {', '.join(map(repr, WARMUP_TYPES))}")
    return value


def _warmup_fraction(iteration: int, steps: int, kind: str) -> float:
    """Progress through the warmup, 0 at iteration 0 and 1 at ``steps`` (log: ``log(i + 1) / log(steps)``)."""
    if kind == "log":
        return math.log(iteration + 1) / math.log(steps)
    return iteration / steps


class _DeepSpeedSchedule(LRScheduler):
    """Torch's scheduler bookkeeping with DeepSpeed's iteration count (``last_epoch - 1``)."""

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int) -> None:
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, int):
            raise ValueError(f"last_batch_iteration={last_batch_iteration!r} is invalid: expected an integer >= -1")
        if last_batch_iteration < -1:
            raise ValueError(f"last_batch_iteration={last_batch_iteration} is invalid: expected an integer >= -1")
        if last_batch_iteration != -1:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        super().__init__(optimizer, last_epoch=last_batch_iteration)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's count: -1 before the first ``step()``, then 0, 1, ..."""
        return self.last_epoch - 1

    def get_lr(self) -> list[float]:
        """The learning rate of every param group at the current iteration."""
        return self.lrs_at(self.last_batch_iteration)

    def lrs_at(self, iteration: int) -> list[float]:
        """The learning rate of every param group at DeepSpeed iteration ``iteration`` (-1: before the first step)."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()``, or DeepSpeed's ``{"last_batch_iteration": n}`` (the rest stays as built).

        Unlike torch's schedulers, this also sets the param groups' ``lr`` (and ``OneCycle``'s
        ``betas``) to the loaded iteration's, so a scheduler loaded alone resumes correctly.

        Args:
            state_dict: a state from ``state_dict()`` or from a DeepSpeed checkpoint.
        """
        if set(state_dict) == {"last_batch_iteration"}:
            self.last_epoch = int(state_dict["last_batch_iteration"]) + 1
        else:
            super().load_state_dict(state_dict)
        self._apply()

    def _apply(self) -> None:
        """Set the optimizer's hyper-parameters to the current iteration's."""
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


class WarmupLR(_DeepSpeedSchedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` steps, then constant.

    Args:
        optimizer: the optimizer whose param groups' ``lr`` is set.
        warmup_min_lr: first learning rate (a number, or one per param group).
        warmup_max_lr: learning rate after the warmup; None: each group's ``lr`` at construction.
        warmup_num_steps: length of the warmup (DeepSpeed uses at least 2).
        warmup_type: ``"log"`` or ``"linear"`` growth during the warmup.
        last_batch_iteration: DeepSpeed's resume index; -1 starts from the beginning.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: PerGroup = 0.0,
        warmup_max_lr: Optional[PerGroup] = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.warmup_num_steps = max(2, _positive_int(warmup_num_steps, "warmup_num_steps"))
        self.warmup_type = _warmup_type(warmup_type)
        if warmup_max_lr is None:
            warmup_max_lr = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """``WarmupLR``, then a linear decay to 0 at ``total_num_steps``.

    Args:
        optimizer: the optimizer whose param groups' ``lr`` is set.
        total_num_steps: the step at which the learning rate reaches 0.
        warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration: as
            ``WarmupLR``, except that ``warmup_max_lr`` defaults to 0.001 (DeepSpeed's default).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: PerGroup = 0.0,
        warmup_max_lr: PerGroup = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return max(0.0, (self.total_num_steps - iteration) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_DeepSpeedSchedule):
    """A ratio of each group's initial ``lr``: warmup from ``warmup_min_ratio`` to 1, then cosine to ``cos_min_ratio``.

    Args:
        optimizer: the optimizer whose param groups' ``lr`` is set (their ``lr`` at construction is the peak).
        total_num_steps: the step at which the cosine reaches ``cos_min_ratio``.
        warmup_min_ratio: ratio at the first warmup step.
        warmup_num_steps: length of the warmup (at least 2 is used).
        cos_min_ratio: final ratio.
        warmup_type: ``"log"`` or ``"linear"`` growth during the warmup.
        last_batch_iteration: DeepSpeed's resume index; -1 starts from the beginning.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        self.warmup_num_steps = max(2, _positive_int(warmup_num_steps, "warmup_num_steps"))
        self.warmup_type = _warmup_type(warmup_type)
        self.warmup_min_ratio = _number(warmup_min_ratio, "warmup_min_ratio")
        self.cos_min_ratio = _number(cos_min_ratio, "cos_min_ratio")
        super().__init__(optimizer, last_batch_iteration)

    def ratio_at(self, iteration: int) -> float:
        """The factor applied to each group's initial ``lr`` at DeepSpeed iteration ``iteration``."""
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            fraction = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        done = iteration - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lrs_at(self, iteration: int) -> list[float]:
        ratio = self.ratio_at(iteration)
        return [float(base) * ratio for base in self.base_lrs]


class OneCycle(_DeepSpeedSchedule):
    """The 1Cycle policy: lr up from ``cycle_min_lr`` to ``cycle_max_lr`` and back, then an optional decay.

    With ``cycle_momentum`` (and an optimizer with ``betas``), ``betas[0]`` cycles inversely between
    ``cycle_max_mom`` and ``cycle_min_mom``, and ``betas[1]`` is set to 0.99, as DeepSpeed does.

    Args:
        optimizer: the optimizer whose param groups' ``lr`` (and ``betas``) are set.
        cycle_min_lr, cycle_max_lr: the cycle's bounds (a number, or one per param group).
        decay_lr_rate: after the cycle, ``lr = cycle_min_lr / (1 + decay_lr_rate * k / decay_step_size)``.
        cycle_first_step_size: steps of the rising half.
        cycle_second_step_size: steps of the falling half (None: as the first).
        cycle_first_stair_count, cycle_second_stair_count: staircase steps per half (0: smooth;
            None for the second: as the first).
        decay_step_size: interval of the post-cycle decay (0: no decay).
        cycle_momentum: cycle ``betas[0]`` too.
        cycle_min_mom, cycle_max_mom: the momentum bounds (a number, or one per param group).
        decay_mom_rate: post-cycle momentum growth rate, ``mom = cycle_max_mom * (1 + rate * k / decay_step_size)``.
        last_batch_iteration: DeepSpeed's resume index; -1 starts from the beginning.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: PerGroup,
        cycle_max_lr: PerGroup,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: Optional[int] = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: Optional[int] = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: PerGroup = 0.8,
        cycle_max_mom: PerGroup = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        self.first_step_size = float(_positive_int(cycle_first_step_size, "cycle_first_step_size"))
        second = cycle_second_step_size
        if second is not None and (isinstance(second, bool) or not isinstance(second, int) or second < 0):
            raise ValueError(f"cycle_second_step_size={second!r} is invalid: expected an integer >= 0 or null")
        self.second_step_size = self.first_step_size if second is None else float(second)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = _count(cycle_first_stair_count, "cycle_first_stair_count")
        stairs2 = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.second_stair_count = _count(stairs2, "cycle_second_stair_count")
        self.decay_step_size = _count(decay_step_size, "decay_step_size")
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = _number(decay_lr_rate, "decay_lr_rate")
        self.decay_mom_rate = _number(decay_mom_rate, "decay_mom_rate")
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        if not isinstance(cycle_momentum, bool):
            raise ValueError(f"cycle_momentum={cycle_momentum!r} is invalid: expected true or false")
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        super().__init__(optimizer, last_batch_iteration)

    def _scale(self, iteration: int) -> float:
        """Position in the cycle of the batch after ``iteration``: 0 at the ends, 1 at the peak."""
        batch = iteration + 1
        x = 1.0 + batch / self.total_size - math.floor(1 + batch / self.total_size)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            at = batch % self.total_size
            if at <= self.first_step_size:
                position = at * stairs / self.first_step_size
            else:
                position = (self.total_size - at) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_steps(self, iteration: int) -> Optional[int]:
        """Steps into the post-cycle decay, or None while the cycle runs."""
        return None if iteration < self.total_size else int(iteration - self.total_size + 1)

    def lrs_at(self, iteration: int) -> list[float]:
        k = self._decay_steps(iteration)
        if k is None:
            scale = self._scale(iteration)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        return [lo / (1 + self.decay_lr_rate * k / self.decay_step_size) for lo in self.min_lrs]

    def betas_at(self, iteration: int) -> list[tuple[float, float]]:
        """``betas`` of every param group at DeepSpeed iteration ``iteration`` (with ``cycle_momentum``)."""
        if iteration < 0:
            return [(m, 0.99) for m in self.min_moms]
        k = self._decay_steps(iteration)
        if k is None:
            scale = self._scale(iteration)
            return [(hi - (hi - lo) * scale, 0.99) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return [(hi, 0.99) for hi in self.max_moms]
        return [(hi * (1 + self.decay_mom_rate * k / self.decay_step_size), 0.99) for hi in self.max_moms]

    def step(self, epoch: Optional[int] = None) -> None:
        """Set every group's ``lr`` (and ``betas`` with ``cycle_momentum``) for the next iteration.

        Raises ``ValueError``, changing nothing, where ``decay_mom_rate`` would make ``betas[0]`` 1 or more.

        Args:
            epoch: deprecated by torch; leave it None.
        """
        self._check_momentum(self.last_batch_iteration + 1 if epoch is None else epoch - 1)
        super().step(epoch)
        self._set_betas()

    def _check_momentum(self, iteration: int) -> None:
        """Refuse an iteration whose momentum (raised by ``decay_mom_rate``) is 1 or more."""
        if not self.cycle_momentum:
            return
        momentum = max(beta for beta, _ in self.betas_at(iteration))
        if momentum >= 1.0:
            raise ValueError(
                f"OneCycle: iteration {iteration} would set betas[0] to {momentum:g}: scheduler.params.decay_mom_rate "
                f"({self.decay_mom_rate:g}) raises the momentum after the cycle, cycle_max_mom * (1 + decay_mom_rate * "
                f"k / decay_step_size), and Adam's betas must stay below 1. Lower decay_mom_rate or cycle_max_mom "
                "(DeepSpeed trains on with betas[0] >= 1)"
            )

    def _apply(self) -> None:
        super()._apply()
        self._set_betas()

    def _set_betas(self) -> None:
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.betas_at(self.last_batch_iteration)):
                group["betas"] = betas


class LRRangeTest(_DeepSpeedSchedule):
    """The learning-rate range test: ``lr`` grows from ``lr_range_test_min_lr`` by ``lr_range_test_step_rate`` times
    it every ``lr_range_test_step_size`` steps, without end (to find the largest ``lr`` that still trains).

    At DeepSpeed iteration ``i`` the rate is ``min_lr * (1 + step_rate * (i + 1) / step_size)``, the quotient
    rounded down with ``lr_range_test_staircase``.

    Args:
        optimizer: the optimizer whose param groups' ``lr`` is set.
        lr_range_test_min_lr: the first learning rate (a number, or one per param group).
        lr_range_test_step_size: the steps over which ``lr`` grows by ``step_rate * min_lr``.
        lr_range_test_step_rate: the growth per ``step_size`` steps, in units of ``min_lr``.
        lr_range_test_staircase: grow in steps of ``step_size`` instead of continuously.
        last_batch_iteration: DeepSpeed's resume index; -1 starts from the beginning.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: PerGroup = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = _number(lr_range_test_step_rate, "lr_range_test_step_rate")
        if not isinstance(lr_range_test_staircase, bool):
            raise ValueError(f"lr_range_test_staircase={lr_range_test_staircase!r} is invalid: expected true or false")
        self.staircase = lr_range_test_staircase
        super().__init__(optimizer, last_batch_iteration)

    def lrs_at(self, iteration: int) -> list[float]:
        intervals = (iteration + 1) / self.step_size
        if self.staircase:
            intervals = math.floor(intervals)
        return [lo * (1 + self.step_rate * intervals) for lo in self.min_lrs]


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} is invalid: expected an integer >= 0")
    return value


SCHEDULERS = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}
