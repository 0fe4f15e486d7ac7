"""The DeepSpeed config a ``ZeroTrainer`` trains with, read as the Hugging Face Trainer with DeepSpeed reads it.

Where it comes from (at most one of them): ``ZeroTrainer(config=...)``, ``TrainingArguments(deepspeed=...)``
(the Trainer's own switch; transformers needs ``deepspeed`` importable to accept it), or
``ZeroTrainer(zero_optimization=...)`` (a ``zero_optimization`` section, or a whole config or its path).
Each is a path of a JSON file or the config as a dict, as for ``zk.initialize``.

What the Trainer with DeepSpeed does with a whole config (transformers' ``HfTrainerDeepSpeedConfig``
and ``deepspeed_optim_sched``), and ``ZeroTrainer`` does the same:

- ``"auto"`` values are filled from ``TrainingArguments`` (lr, betas, eps, weight decay,
  ``max_grad_norm``, batch sizes, accumulation, bf16/fp16, warmup), from the training length
  (``total_num_steps``) and the model's hidden size (the bucket sizes); an explicit value that
  disagrees with ``TrainingArguments`` is an error, as the Trainer's "mismatch" error;
- an ``optimizer`` section: that optimizer over every trainable parameter in one group (its weight
  decay applies to biases and norms too, as in DeepSpeed); none: the Trainer's AdamW from
  ``TrainingArguments`` (no decay on biases and norms);
- a ``scheduler`` section: that schedule, stepped once per optimizer step; none: the Trainer's own
  (``lr_scheduler_type``, warmup);
- ``gradient_clipping``: its value (``"auto"``: ``max_grad_norm``), DeepSpeed's default 1.0 when
  the key is missing: with a config it is DeepSpeed that clips, not the Trainer's ``max_grad_norm``;
- ``bf16``: bf16 weights with fp32 master weights in the optimizer; ``fp16`` is refused (the
  Trainer's loop cannot run our loss scaling: use bf16).

With only ``zero_optimization`` keys (or none: stage 1), everything else comes from
``TrainingArguments`` as for the Trainer without DeepSpeed, and ``"auto"`` bucket sizes from the
model's hidden size. ``describe`` is the one log line that says where each value came from.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import types
from typing import Any, Mapping, Optional, Union

from ..config import ZeroConfig, ZeroOptions
from ..config.files import load as read_config
from ..config.hf import TRAINER_DEFAULTS, model_hidden_size, training_args_overrides

__all__ = [
    "ConfigSource",
    "find",
    "without_deepspeed",
    "accelerate_without_deepspeed",
    "resolve",
    "describe",
    "clipping",
]

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class ConfigSource:
    """The DeepSpeed config given to a ``ZeroTrainer``.

    ``data``: the config (a lone ``zero_optimization`` section wrapped as ``{"zero_optimization": ...}``),
    None when there is none; ``origin``: where it was given, for messages; ``whole``: its other
    sections apply (else they come from ``TrainingArguments``); ``options``: a ``ZeroOptions`` given as is.
    """

    data: Optional[Mapping[str, Any]]
    origin: str
    whole: bool
    options: Optional[ZeroOptions] = None


def find(config: Any, zero_optimization: Any, args: Any) -> ConfigSource:
    """The config given through ``config=``, ``zero_optimization=`` or ``args.deepspeed`` (at most one).

    Args:
        config: ``ZeroTrainer(config=...)``: a path or a dict, or None.
        zero_optimization: ``ZeroTrainer(zero_optimization=...)``: a section, a whole config, a path,
            a ``ZeroOptions``, or None.
        args: the ``TrainingArguments`` (None: the Trainer's defaults).
    """
    given = [
        (f"ZeroTrainer({name}=...)", value)
        for name, value in (("config", config), ("zero_optimization", zero_optimization))
        if value is not None
    ]
    if getattr(args, "deepspeed", None):
        given.append(("TrainingArguments(deepspeed=...)", args.deepspeed))
    if len(given) > 1:
        raise ValueError(
            f"ZeroTrainer: a DeepSpeed config is given twice, as {given[0][0]} and {given[1][0]}: keep one"
        )
    if not given:
        return ConfigSource(None, "no DeepSpeed config (ZeRO stage 1, the rest from TrainingArguments)", False)
    origin, value = given[0]
    if isinstance(value, ZeroOptions):
        return ConfigSource(None, origin, False, value)
    if isinstance(value, (str, os.PathLike)):
        return ConfigSource(read_config(value), origin.replace("...", repr(os.fspath(value))), True)
    if not isinstance(value, Mapping):
        raise ValueError(
            f"ZeroTrainer: {origin} must be the path of a DeepSpeed JSON config or its content as a dict "
            f"(zero_optimization=: also its zero_optimization section or a ZeroOptions), not {type(value).__name__}"
        )
    if origin.startswith("ZeroTrainer(zero_optimization") and "zero_optimization" not in value:
        return ConfigSource({"zero_optimization": dict(value)}, origin, False)
    return ConfigSource(value, origin, True)


def without_deepspeed(args: Any) -> Any:
    """``args`` with DeepSpeed switched off (a copy; ``args`` itself is left as it is), so that the Trainer
    and Accelerate leave the model and optimizer to zero_kernels."""
    if not getattr(args, "deepspeed", None) and getattr(args, "deepspeed_plugin", None) is None:
        return args
    detached = copy.copy(args)
    detached.deepspeed = None
    detached.hf_deepspeed_config = None
    detached.deepspeed_plugin = None
    if _deepspeed_type(vars(detached).get("distributed_state")):
        vars(detached).pop("_setup_devices", None)  # set up for DeepSpeed: set up again without it
        detached.distributed_state = None
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # from_pretrained would otherwise partition new models for DeepSpeed ZeRO-3
    return detached


def _deepspeed_type(state: Any) -> bool:
    return "DEEPSPEED" in str(getattr(state, "distributed_type", "") or "")


def accelerate_without_deepspeed() -> None:
    """Clear what a DeepSpeed set-up left in Accelerate's process-wide state (the environment switch, the
    shared state of an earlier ``Accelerator``), so that the next ``Accelerator`` is a plain one."""
    from accelerate.state import AcceleratorState, PartialState

    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    shared = AcceleratorState._shared_state
    if shared.get("deepspeed_plugins") is not None or _deepspeed_type(types.SimpleNamespace(**shared)):
        partial = types.SimpleNamespace(**PartialState._shared_state)
        AcceleratorState._reset_state(reset_partial_state=_deepspeed_type(partial))


def resolve(source: ConfigSource, args: Any, model: Any, num_training_steps: int) -> ZeroConfig:
    """The config with every ``"auto"`` filled, as the Trainer with DeepSpeed fills it when training starts.

    Args:
        source: from ``find``.
        args: the ``TrainingArguments``.
        model: the model (its ``config.hidden_size`` sizes the buckets).
        num_training_steps: the optimizer steps of this training (the Trainer's ``max_steps``).
    """
    hidden = model_hidden_size(model)
    world = getattr(args, "world_size", 1)
    if source.data is None:
        return ZeroConfig(zero=source.options or ZeroOptions(stage=1), world_size=world)
    if not source.whole:
        return ZeroConfig.from_deepspeed(source.data, world_size=world, hidden_size=hidden)
    sized = _with_length(args, num_training_steps)
    return ZeroConfig.from_deepspeed(source.data, world_size=world, training_args=sized, hidden_size=hidden)


def _with_length(args: Any, num_training_steps: Optional[int]) -> Any:
    """``args`` as the Trainer reads it once it knows the training length (``max_steps``: every optimizer step)."""
    if not num_training_steps:
        return args
    sized = copy.copy(args)
    sized.max_steps = num_training_steps
    return sized


def _lookup(data: Mapping[str, Any], path: str) -> Any:
    node: Any = data
    for key in path.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return _MISSING
        node = node[key]
    return node


class _Sources:
    """Where the value of each key path came from, for ``describe``."""

    def __init__(self, source: ConfigSource, args: Any, model: Any, total: int, world: int) -> None:
        self.data = source.data or {}
        self.whole = source.whole
        hidden = model_hidden_size(model)
        self.auto = {path: why for path, (_, why) in TRAINER_DEFAULTS.items()}
        if source.whole:
            for path, override in training_args_overrides(_with_length(args, total), world, None).items():
                self.auto[path] = override.source.replace("training_args.", "TrainingArguments.")
        for name in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
            if hidden is not None:
                self.auto[f"zero_optimization.{name}"] = f"hidden_size={hidden}"

    def __call__(self, path: str) -> str:
        raw = _lookup(self.data, path)
        if raw is _MISSING:
            return "DeepSpeed's default"
        if raw == "auto":
            return f"auto: {self.auto.get(path, 'DeepSpeed default')}"
        return "config"


def _zero_part(config: ZeroConfig, where: _Sources) -> list[str]:
    keys = ["reduce_bucket_size"]
    if config.stage == 3:
        keys += ["stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"]
    return [f"stage={config.stage} [{where('zero_optimization.stage')}]"] + [
        f"{k}={getattr(config.zero, k)} [{where(f'zero_optimization.{k}')}]" for k in keys
    ]


def _optimizer_part(config: ZeroConfig, where: _Sources, args: Any) -> str:
    opt = config.optimizer
    if opt is None:
        return (
            f"optimizer=AdamW [TrainingArguments, no optimizer section: lr={args.learning_rate}, betas="
            f"({args.adam_beta1}, {args.adam_beta2}), eps={args.adam_epsilon}, weight_decay={args.weight_decay} "
            "not on biases and norms]"
        )
    values = ", ".join(
        f"{k}={getattr(opt, k)} [{where(f'optimizer.params.{k}')}]" for k in ("lr", "betas", "eps", "weight_decay")
    )
    return f"optimizer={opt.type} [config, one group: weight decay on every parameter]: {values}"


def _scheduler_part(config: ZeroConfig, where: _Sources, args: Any) -> str:
    sched = config.scheduler
    if sched is None:
        kind = getattr(args, "lr_scheduler_type", "linear")
        return f"scheduler={getattr(kind, 'value', kind)} [TrainingArguments, no scheduler section]"
    values = ", ".join(f"{k}={v} [{where(f'scheduler.params.{k}')}]" for k, v in sched.params.items())
    return f"scheduler={sched.type} [config]: {values}"


def describe(
    source: ConfigSource,
    config: ZeroConfig,
    args: Any,
    model: Any,
    num_training_steps: int,
    given: Any = None,
    given_by: str = "optimizers=",
) -> str:
    """One line: each value ``ZeroTrainer`` trains with, and where it came from.

    Args:
        source: from ``find``.
        config: from ``resolve``.
        args: the ``TrainingArguments``.
        model: the model.
        num_training_steps: the optimizer steps of this training.
        given: ``(optimizer, scheduler)`` the user passed as ``optimizers=`` or built in a ``create_optimizer``
            override (None: built from the config); the scheduler may be None (the Trainer's).
        given_by: ``"optimizers="`` or ``"create_optimizer"``: where ``given`` came from.
    """
    where = _Sources(source, args, model, num_training_steps, config.world_size)
    if given is not None:
        parts = _given_parts(*given, args, given_by)
    elif source.whole:
        clip = config.gradient_clipping
        parts = _zero_part(config, where) + [
            _optimizer_part(config, where, args),
            _scheduler_part(config, where, args),
            f"gradient_clipping={clip} [{where('gradient_clipping')}]",
            f"bf16={config.bf16} [{where('bf16.enabled')}]",
        ]
    else:
        parts = _zero_part(config, where) + [
            _optimizer_part(dataclasses.replace(config, optimizer=None), where, args),
            _scheduler_part(dataclasses.replace(config, scheduler=None), where, args),
        ]
    if not source.whole:
        parts.append(f"gradient_clipping={args.max_grad_norm} [TrainingArguments.max_grad_norm]")
    origins = {"optimizers=": "optimizers=(ShardedFusedAdam, ...)", "create_optimizer": "create_optimizer()"}
    origin = origins[given_by] if given is not None else source.origin
    return f"ZeroTrainer: {origin}: " + "; ".join(parts)


def _given_parts(opt: Any, scheduler: Any, args: Any, given_by: str) -> list[str]:
    """``describe``'s parts for an optimizer the user built: its own options and param groups."""
    keys = ["reduce_bucket_size"]
    if opt.options.stage == 3:
        keys += ["stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"]
    groups = "; ".join(
        f"group {i}: lr={g.get('initial_lr', g['lr'])}, betas={tuple(g['betas'])}, eps={g['eps']}, "
        f"weight_decay={g['weight_decay']}"  # the lr the schedule starts from: a warmup has set the group's to its own
        for i, g in enumerate(opt.param_groups)
    )
    if scheduler is None:
        kind = getattr(args, "lr_scheduler_type", "linear")
        sched = f"scheduler={getattr(kind, 'value', kind)} [TrainingArguments]"
    else:
        made_by = given_by if given_by == "optimizers=" else "create_scheduler"
        sched = f"scheduler={type(scheduler).__name__} [{made_by}]"
    return (
        [f"stage={opt.options.stage} [optimizer]"]
        + [f"{k}={getattr(opt.options, k)} [optimizer]" for k in keys]
        + [f"optimizer=ShardedFusedAdam [{given_by}]: {groups}", sched]
    )


def clipping(source: ConfigSource, config: ZeroConfig, args: Any) -> Union[float, None]:
    """The norm to clip the gradients to (None: none), as the Trainer with DeepSpeed decides it."""
    value = config.gradient_clipping if source.whole else args.max_grad_norm
    return float(value) if value and value > 0 else None
