"""What the Hugging Face Trainer fills into a DeepSpeed config's ``"auto"`` values, without transformers.

The Trainer (``transformers/integrations/deepspeed.py``, ``HfTrainerDeepSpeedConfig``) replaces
``"auto"`` with values of its ``TrainingArguments`` and refuses an explicit value that disagrees
with them. ``training_args_overrides`` does the same from any object with those attributes (it is
duck-typed: transformers is never imported); ``TRAINER_DEFAULTS`` holds what the Trainer would
fill with default ``TrainingArguments``, used for an ``"auto"`` that nothing else fills.

Key path -> ``TrainingArguments`` attribute:

- ``train_micro_batch_size_per_gpu`` <- ``per_device_train_batch_size``;
  ``gradient_accumulation_steps`` <- ``gradient_accumulation_steps``; ``train_batch_size`` <- their
  product times the world size.
- ``gradient_clipping`` <- ``max_grad_norm``.
- ``optimizer.params.lr``/``betas``/``eps``/``weight_decay`` <- ``learning_rate``,
  ``(adam_beta1, adam_beta2)``, ``adam_epsilon``, ``weight_decay``.
- ``fp16.enabled`` <- ``fp16 or fp16_full_eval``; ``bf16.enabled`` <- ``bf16 or bf16_full_eval``.
- ``scheduler.params.warmup_min_lr`` <- 0; ``warmup_max_lr`` <- ``learning_rate`` (the optimizer's lr; also without
  an optimizer section, where the optimizer's groups are a client's);
  ``total_num_steps`` <- ``max_steps`` (when > 0; the Trainer otherwise counts the data loader's
  batches, which zero_kernels cannot see: pass ``total_num_steps=``); ``warmup_num_steps`` <-
  ``max(1, get_warmup_steps(total_num_steps))``.
- The bucket sizes come from the model's hidden size (``model.config.hidden_size``), see
  ``schema.hidden_size_values``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Optional, Tuple

from .rules import Override, ParseContext

_DEFAULT = "Hugging Face Trainer default"

TRAINER_DEFAULTS: Dict[str, Tuple[Any, str]] = {
    "train_micro_batch_size_per_gpu": (8, f"{_DEFAULT} per_device_train_batch_size"),
    "gradient_accumulation_steps": (1, f"{_DEFAULT} gradient_accumulation_steps"),
    "gradient_clipping": (1.0, f"{_DEFAULT} max_grad_norm"),
    "optimizer.params.lr": (5e-5, f"{_DEFAULT} learning_rate"),
    "optimizer.params.betas": ((0.9, 0.999), f"{_DEFAULT} adam_beta1, adam_beta2"),
    "optimizer.params.eps": (1e-8, f"{_DEFAULT} adam_epsilon"),
    "optimizer.params.weight_decay": (0.0, f"{_DEFAULT} weight_decay"),
    "fp16.enabled": (False, f"{_DEFAULT} fp16"),
    "bf16.enabled": (False, f"{_DEFAULT} bf16"),
    "bfloat16.enabled": (False, f"{_DEFAULT} bf16"),
    "scheduler.params.warmup_min_lr": (0.0, "as the Hugging Face Trainer fills it"),
    "scheduler.params.warmup_max_lr": (
        lambda ctx: _optimizer_lr(ctx),
        "the optimizer's lr, as the Hugging Face Trainer fills it",
    ),
    "scheduler.params.warmup_num_steps": (1, f"{_DEFAULT} warmup_steps=0, at least 1"),
}


def _optimizer_lr(ctx: ParseContext) -> Optional[float]:
    """The optimizer section's lr; without a section (a client optimizer's, or one a Trainer subclass builds) the
    arguments' ``learning_rate`` when ``training_args`` are given, as the Trainer fills it (DeepSpeed then warms every
    group to it), else None, logged as what it stands for: each param group's lr, taken when the scheduler is
    built."""
    lr = ctx.values.get("optimizer.params.lr")
    given = ctx.overrides.get("optimizer.params.lr")
    if lr is None and given is not None:
        return given.value
    if lr is None:
        path = "scheduler.params.warmup_max_lr"
        ctx.derived.add(path)
        ctx.resolved.append(f"{path}=each param group's lr (no optimizer section: the optimizer's own groups)")
    return lr


def _attribute(args: Any, name: str) -> Any:
    if not hasattr(args, name):
        raise ValueError(
            f"training_args has no attribute {name!r}: expected a transformers.TrainingArguments "
            f"(or an object with its attributes), got {type(args).__name__}"
        )
    return getattr(args, name)


def _warmup_steps(args: Any, total: Optional[int]) -> Optional[int]:
    """The Trainer's warmup length: ``get_warmup_steps(total)`` when it can be known, else None."""
    if total is not None and callable(getattr(args, "get_warmup_steps", None)):
        return int(args.get_warmup_steps(total))
    steps = float(getattr(args, "warmup_steps", 0) or 0)
    ratio = float(getattr(args, "warmup_ratio", 0) or 0)
    if steps >= 1:
        return int(steps)
    fraction = steps or ratio
    if fraction == 0:
        return 0
    return None if total is None else math.ceil(total * fraction)


def training_args_overrides(args: Any, world: int, total_num_steps: Optional[int]) -> Dict[str, Override]:
    """Key path -> the value the Trainer would fill from ``args`` (only into ``"auto"``; a differing
    explicit value is an error, as in the Trainer).

    Args:
        args: a ``transformers.TrainingArguments`` (duck-typed).
        world: the data-parallel world size (the Trainer's ``args.world_size``).
        total_num_steps: the training length if known (keyword), else ``args.max_steps`` when > 0.
    """
    micro = _attribute(args, "per_device_train_batch_size")
    accum = _attribute(args, "gradient_accumulation_steps")
    lr = _attribute(args, "learning_rate")
    values: Dict[str, Tuple[Any, str]] = {
        "train_micro_batch_size_per_gpu": (micro, "per_device_train_batch_size"),
        "gradient_accumulation_steps": (accum, "gradient_accumulation_steps"),
        "train_batch_size": (micro * accum * world, "per_device_train_batch_size*gradient_accumulation_steps*world"),
        "gradient_clipping": (_attribute(args, "max_grad_norm"), "max_grad_norm"),
        "optimizer.params.lr": (lr, "learning_rate"),
        "optimizer.params.betas": ((_attribute(args, "adam_beta1"), _attribute(args, "adam_beta2")), "adam_beta1/2"),
        "optimizer.params.eps": (_attribute(args, "adam_epsilon"), "adam_epsilon"),
        "optimizer.params.weight_decay": (_attribute(args, "weight_decay"), "weight_decay"),
        "fp16.enabled": (bool(_attribute(args, "fp16") or getattr(args, "fp16_full_eval", False)), "fp16"),
        "bf16.enabled": (bool(_attribute(args, "bf16") or getattr(args, "bf16_full_eval", False)), "bf16"),
    }
    values["bfloat16.enabled"] = values["bf16.enabled"]
    max_steps = getattr(args, "max_steps", -1)
    total = total_num_steps if total_num_steps is not None else (max_steps if max_steps and max_steps > 0 else None)
    if total is not None:
        values["scheduler.params.total_num_steps"] = (total, "max_steps")
    warmup = _warmup_steps(args, total)
    if warmup is not None:
        values["scheduler.params.warmup_num_steps"] = (max(1, warmup), "warmup_steps")
    overrides = {
        path: Override(value, f"training_args.{name}", strict=True, fills_missing=False)
        for path, (value, name) in values.items()
    }
    if warmup is not None:
        path = "scheduler.params.warmup_num_steps"
        overrides[path] = dataclasses.replace(overrides[path], shown=_warmup_shown(args, warmup, total))
    return overrides


def _warmup_shown(args: Any, warmup: int, total: Optional[int]) -> str:
    """The Trainer's warmup as an error names it: the arguments it comes from, and the count when it differs."""
    given = [
        f"training_args.{name}={getattr(args, name)!r}"
        for name in ("warmup_steps", "warmup_ratio")
        if hasattr(args, name) and (name == "warmup_steps" or getattr(args, name))
    ]
    if not given and total is not None and callable(getattr(args, "get_warmup_steps", None)):
        return f"training_args.get_warmup_steps({total})={warmup!r}"  # an object with the method only
    if given == [f"training_args.warmup_steps={warmup!r}"] and warmup >= 1:
        return given[0]
    over = "" if total is None else f" of {total}"
    floor = "" if warmup >= 1 else ", which the Trainer fills in as 1"
    source = ", ".join(given) or "training_args without warmup_steps or warmup_ratio"
    return f"{source} ({warmup} warmup steps{over}{floor})"


def model_hidden_size(model: Any) -> Optional[int]:
    """The hidden size the Trainer reads from ``model.config`` (the largest of ``hidden_sizes``), or None."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        if isinstance(getattr(cfg, "hidden_size", None), int):
            return cfg.hidden_size
        sizes = getattr(cfg, "hidden_sizes", None)
        if isinstance(sizes, (list, tuple)) and sizes:
            return max(sizes)
    return None
