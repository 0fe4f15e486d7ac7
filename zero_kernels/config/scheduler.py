"""The ``scheduler`` section of a DeepSpeed config: ``{"type": NAME, "params": {...}}``.

``type`` is one of DeepSpeed's schedules (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``,
``OneCycle``, ``LRRangeTest``, built from ``zero_kernels.schedulers``) or, as DeepSpeed allows, the name of a
class of ``torch.optim.lr_scheduler`` (its params' names are checked against the class's
signature, their values passed through as given). The params of DeepSpeed's schedules are
checked against their signatures (unknown names, bad values) and may be ``"auto"``: filled
from a keyword of ``from_deepspeed``, from ``training_args``, from the Hugging Face Trainer's
defaults, else from the class's default; a required parameter with nothing to fill it
(``total_num_steps``, ``cycle_min_lr``, ``cycle_max_lr``) is an error naming it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch

from .. import schedulers
from .at_updates import at_updates, counting
from .rules import Field, ParseContext, Scalar, Section, boolean, choice, integer, join, number, suggest


def _per_group() -> Scalar:
    """A number, or a list with one number per param group (DeepSpeed's ``float or list``)."""
    one = number()

    def convert(value: Any) -> Any:
        if isinstance(value, (list, tuple)) and value:
            return [one.convert(v) for v in value]
        return one.convert(value)

    return Scalar("a finite number or a list of them (one per param group)", convert)


def _optional_count() -> Scalar:
    count = integer(0)

    def convert(value: Any) -> Optional[int]:
        return None if value is None else count.convert(value)

    return Scalar("an integer >= 0 or null", convert)


_PER_GROUP = _per_group()
PARAM_RULES: Dict[str, Scalar] = {
    "warmup_min_lr": _PER_GROUP,
    "warmup_max_lr": _PER_GROUP,
    "cycle_min_lr": _PER_GROUP,
    "cycle_max_lr": _PER_GROUP,
    "cycle_min_mom": _PER_GROUP,
    "cycle_max_mom": _PER_GROUP,
    "warmup_num_steps": integer(1),
    "total_num_steps": integer(1),
    "cycle_first_step_size": integer(1),
    "cycle_second_step_size": _optional_count(),
    "cycle_first_stair_count": integer(0),
    "cycle_second_stair_count": _optional_count(),
    "decay_step_size": integer(0),
    "last_batch_iteration": integer(-1),
    "warmup_type": choice({t: t for t in schedulers.WARMUP_TYPES}),
    "cycle_momentum": boolean(),
    "warmup_min_ratio": number(0),
    "cos_min_ratio": number(0),
    "decay_lr_rate": number(),
    "decay_mom_rate": number(),
    "lr_range_test_min_lr": _PER_GROUP,
    "lr_range_test_step_size": integer(1),
    "lr_range_test_step_rate": number(),
    "lr_range_test_staircase": boolean(),
}


def _params_section(cls: type) -> tuple[Section, tuple[str, ...]]:
    """The params of one of DeepSpeed's schedules from its signature, and the required ones (default None here)."""
    fields, required = {}, []
    for name, p in list(inspect.signature(cls.__init__).parameters.items())[2:]:
        if p.default is inspect.Parameter.empty:
            required.append(name)
        fields[name] = Field(PARAM_RULES[name], None if p.default is inspect.Parameter.empty else p.default)
    return Section(fields=fields), tuple(required)


_SECTIONS = {name: _params_section(cls) for name, cls in schedulers.SCHEDULERS.items()}
_TORCH = {
    name
    for name, obj in vars(torch.optim.lr_scheduler).items()
    if inspect.isclass(obj) and issubclass(obj, torch.optim.lr_scheduler.LRScheduler) and not name.startswith("_")
}


@dataclass(frozen=True)
class SchedulerConfig:
    """A parsed ``scheduler`` section: the class name and its keyword arguments."""

    type: str
    params: Dict[str, Any] = field(default_factory=dict)

    def build(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        """The scheduler for ``optimizer``, as DeepSpeed builds it (``Class(optimizer, **params)``: a value the class
        refuses is a ``ValueError`` naming ``scheduler.params`` and the class); for an
        optimizer that counts ``applied_steps`` (``ShardedFusedAdam``, or a wrapper of it) a subclass whose
        ``step()`` advances only after an applied update, as DeepSpeed's engine steps it (``at_updates``).

        Args:
            optimizer: the optimizer whose learning rates it sets.
        """
        cls = schedulers.SCHEDULERS.get(self.type) or getattr(torch.optim.lr_scheduler, self.type)
        if counting(optimizer) is not None:  # also wrapped, as Accelerate wraps it before the Trainer builds this
            cls = at_updates(cls)
        try:
            return cls(optimizer, **self.params)
        except (TypeError, ValueError) as err:  # the class's own words name neither the section nor the key
            raise ValueError(f"scheduler.params={self.params!r} is refused by {self.type}: {err}") from err


def _check_type(value: Any, path: str) -> str:
    if isinstance(value, str) and (value in schedulers.SCHEDULERS or value in _TORCH):
        return value
    names = sorted(schedulers.SCHEDULERS)
    hint = suggest(str(value), [*names, *_TORCH])
    raise ValueError(
        f"{path}={value!r} is invalid{hint}: expected one of {', '.join(map(repr, names))} "
        "or a class name of torch.optim.lr_scheduler (case-sensitive, as in DeepSpeed)"
    )


def _check_torch_params(name: str, params: Mapping[str, Any], where: str) -> None:
    """Refuse a param that ``torch.optim.lr_scheduler.<name>`` does not take, or a required one left out, at parse
    time: built after the optimizer, the scheduler would fail only once the optimizer holds the parameters."""
    signature = inspect.signature(getattr(torch.optim.lr_scheduler, name).__init__).parameters
    allowed = {k: p for k, p in signature.items() if k not in ("self", "optimizer")}
    listed = ", ".join(map(repr, allowed)) or "none"
    for key in params:
        if key not in allowed:
            hint = suggest(str(key), allowed)
            raise ValueError(f"unknown key {key!r} in {where}: torch's {name} takes {listed}{hint}")
    missing = [k for k, p in allowed.items() if p.default is inspect.Parameter.empty and k not in params]
    if missing:
        raise ValueError(f"{join(where, missing[0])} is required by torch's {name} and has no value: write it")


def parse_scheduler(value: Any, path: str, ctx: Optional[ParseContext] = None) -> SchedulerConfig:
    """Check a ``scheduler`` section and resolve its ``"auto"`` params; errors name the key path.

    Args:
        value: the section's JSON value.
        path: its key path (``"scheduler"``).
        ctx: the parse's context (overrides, "auto" defaults, log).
    """
    ctx = ctx if ctx is not None else ParseContext()
    if not isinstance(value, Mapping):
        raise ValueError(f'{path}={value!r} is invalid: expected a JSON object such as {{"type": "WarmupLR"}}')
    unknown = [k for k in value if k not in ("type", "params")]
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} in {path}; expected 'type' and 'params'")
    if "type" not in value:
        raise ValueError(f"{path}.type is missing: expected one of {', '.join(map(repr, sorted(_SECTIONS)))}")
    name = _check_type(value["type"], join(path, "type"))
    params = value.get("params")
    params = {} if params is None else params  # not `or {}`: [], 0 and false are refused below, not defaults
    where = join(path, "params")
    if not isinstance(params, Mapping):
        raise ValueError(f"{where}={params!r} is invalid: expected a JSON object")
    if name not in _SECTIONS:
        if any(v == "auto" for v in params.values()):
            raise ValueError(f"{where}: \"auto\" is filled only for DeepSpeed's own schedules, not torch's {name}")
        _check_torch_params(name, params, where)
        return SchedulerConfig(name, dict(params))
    section, required = _SECTIONS[name]
    parsed = section(params, where, ctx)
    missing = [k for k in required if parsed[k] is None]
    if missing:
        how = "write a number"
        if missing[0] == "total_num_steps":
            how += ", pass total_num_steps=, or pass training_args with max_steps > 0"
        raise ValueError(f"{join(where, missing[0])} is required by {name} and has no value: {how}")
    return SchedulerConfig(name, parsed)


SCHEDULER: Any = parse_scheduler
