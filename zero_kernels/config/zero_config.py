"""DeepSpeed JSON config -> one validated, frozen ``ZeroConfig``.

``ZeroConfig.from_deepspeed(path_or_dict)`` reads the keys zero_kernels acts on (``zero_optimization``,
``optimizer``, ``bf16``/``fp16``, ``gradient_clipping``, the batch sizes, ``communication_data_type``,
``data_types.grad_accum_dtype`` and zero_kernels' own ``skip_nonfinite_steps``)
with DeepSpeed's defaults and checks. Keys DeepSpeed knows that change nothing here are accepted
and logged once per parse on the ``zero_kernels`` logger; unknown keys and bad values raise
``ValueError`` naming the full key path, the value and what is allowed.

Mapping of DeepSpeed's optimizer settings (``deepspeed/runtime/engine.py``): the type name is
case-insensitive; ``"AdamW"`` always uses decoupled weight decay; ``"Adam"`` does too unless
``params.adam_w_mode`` is false (its default is true), in which case decay is the L2 term of
``torch.optim.Adam``. ``weight_decay`` defaults to 0 as in DeepSpeed's FusedAdam, or to torch's
default for the chosen class (1e-2 for AdamW, 0 for Adam) when ``params.torch_adam`` is true.

Hugging Face Trainer configs write ``"auto"`` for many values. Each ``"auto"`` is filled, in
order, from a keyword argument of ``from_deepspeed`` (see ``AUTO_KEYWORDS``; ``hidden_size`` fills
the bucket sizes the way the Trainer does), from ``training_args`` (a ``TrainingArguments``, read
as the Trainer reads it, see ``config.hf``), from the Trainer's own defaults for the keys it fills
(lr 5e-5, gradient clipping 1.0, weight decay 0, ...), else from DeepSpeed's default; each value
so chosen is logged once, at WARNING, with its source. An ``"auto"`` with nothing sensible to
fill it (``"stage"``, a scheduler's ``total_num_steps``) is an error naming the key. A keyword
also fills a key the config leaves out; a keyword or ``training_args`` value that contradicts a
value the config writes explicitly is an error.

The ``scheduler`` section (``config.scheduler``) is parsed into ``ZeroConfig.scheduler``;
``SchedulerConfig.build(optimizer)`` makes the scheduler.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .files import load
from .hf import TRAINER_DEFAULTS, training_args_overrides
from .offload import AioConfig, OffloadOptimizerConfig, OffloadParamConfig, as_block
from .rules import Override, ParseContext, Scalar, integer, logger, number, suggest
from .scheduler import SchedulerConfig
from .schema import (
    AUTO_KEYWORDS,
    COMM_DTYPES,
    FP16,
    HIDDEN_SIZE_RULE,
    OPTIMIZER,
    OPTIMIZER_PARAMS,
    TOP,
    ZERO,
    ZERO_FIELDS,
    ZERO_INERT,
    ZEROPP_FIELDS,
    LeafModules,
    LocoParam,
    hidden_size_values,
)


def _normalise(obj: Any, rules: Mapping[str, Scalar], prefix: str, nullable: Tuple[str, ...] = ()) -> None:
    """Check and normalise each field of a frozen dataclass in place (``None`` kept where nullable)."""
    for name, rule in rules.items():
        value = getattr(obj, name)
        if value is None and name in nullable:
            continue
        object.__setattr__(obj, name, rule(value, f"{prefix}.{name}"))


def _key(name: str) -> str:
    """The ``zero_optimization`` key a ``ZeroOptions`` field is read from."""
    return ZEROPP_FIELDS.get(name, name)


def _zero_default(name: str) -> Any:
    return ZERO_FIELDS[_key(name)].default


# The stages each ZeRO++ switch acts at; elsewhere turning it on is an error (off is accepted anywhere).
ZEROPP_STAGES: Dict[str, Tuple[int, ...]] = {
    "quantized_weights": (1, 2, 3),  # stages 1-2: the parameter all-gather after the step
    "quantized_nontrainable_weights": (3,),  # DeepSpeed ignores it below stage 3; refused here
    "hpz_partition_size": (3,),
    "quantized_gradients": (2, 3),  # stage 3 reduces through stage 2's path
}
_ZEROPP_WHAT = {
    "quantized_weights": "quantizes the parameter all-gather, which stage 0 does not have",
    "quantized_nontrainable_weights": "stores the partitioned frozen parameters in int8, as only stage 3 "
    "partitions parameters",
    "hpz_partition_size": "keeps a secondary partition of the parameters gathered at stage 3",
    "quantized_gradients": "quantizes the gradient reduce-scatter, which stages 0-1 do not have",
}


def _check_zeropp(options: "ZeroOptions") -> None:
    """Each ZeRO++ switch that is on must act at ``options.stage``; LoCo needs quantized gradients."""
    for name, stages in ZEROPP_STAGES.items():
        value = getattr(options, name)
        on = value > 1 if name == "hpz_partition_size" else value
        if on and options.stage not in stages:
            where = "stage 3" if stages == (3,) else f"stages {stages[0]}-{stages[-1]}"
            raise ValueError(
                f"zero_optimization.{_key(name)}={value!r} applies at {where} only ({_ZEROPP_WHAT[name]}); "
                f"the stage is {options.stage}"
            )
    if options.loco_param is not None and not options.quantized_gradients:
        raise ValueError(
            f"zero_optimization.zeropp_loco_param={dict(options.loco_param)!r} is the error feedback of "
            "quantized gradients: it needs zero_optimization.zero_quantized_gradients=true"
        )


def check_hpz(hpz: int, world_size: int) -> None:
    """``zero_hpz_partition_size`` must divide the data-parallel world size (1 and 0: off)."""
    if hpz > 1 and world_size % hpz:
        raise ValueError(
            f"zero_optimization.zero_hpz_partition_size={hpz} must divide the world size {world_size} "
            "(it is the number of ranks of one node, or a divisor of it, that hold a secondary partition)"
        )


@dataclass(frozen=True)
class ZeroOptions:
    """The ``zero_optimization`` section: stage, bucket sizes, overlap switches and offload.

    ``overlap_comm=None`` takes DeepSpeed's stage-dependent default: on for stage 3 only. The offload
    blocks (``config.offload``) may be given as their dataclass, a mapping of their keys or a device
    name; ``offload_optimizer`` needs stage 1, 2 or 3, ``offload_param`` stage 3 (as DeepSpeed).
    ``aio`` is the top-level ``aio`` block of a DeepSpeed config (the disk tier's I/O knobs).

    ZeRO++ (read from DeepSpeed's keys, ``schema.ZEROPP_FIELDS``): ``quantized_weights``
    (``zero_quantized_weights``: parameter all-gathers send int8 blocks; stages 1-3),
    ``quantized_nontrainable_weights`` (``zero_quantized_nontrainable_weights``: stage 3's partitioned frozen
    parameters stored in int8), ``hpz_partition_size`` (``zero_hpz_partition_size``:
    ranks holding a secondary partition for the backward gather; stage 3; 0 and 1 are off),
    ``quantized_gradients`` (``zero_quantized_gradients``; stages 2-3) and ``loco_param``
    (``zeropp_loco_param``: a ``LocoParam`` or None; needs quantized gradients).
    """

    stage: int = _zero_default("stage")
    overlap_comm: Optional[bool] = _zero_default("overlap_comm")
    contiguous_gradients: bool = _zero_default("contiguous_gradients")
    reduce_bucket_size: int = _zero_default("reduce_bucket_size")
    allgather_bucket_size: int = _zero_default("allgather_bucket_size")
    reduce_scatter: bool = _zero_default("reduce_scatter")
    overlap_param_gather: bool = _zero_default("overlap_param_gather")
    stage3_prefetch_bucket_size: int = _zero_default("stage3_prefetch_bucket_size")
    stage3_param_persistence_threshold: int = _zero_default("stage3_param_persistence_threshold")
    stage3_max_live_parameters: int = _zero_default("stage3_max_live_parameters")
    stage3_max_reuse_distance: int = _zero_default("stage3_max_reuse_distance")
    stage3_gather_16bit_weights_on_model_save: bool = _zero_default("stage3_gather_16bit_weights_on_model_save")
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    sub_group_size: int = _zero_default("sub_group_size")
    aio: AioConfig = field(default_factory=AioConfig)
    quantized_weights: bool = _zero_default("quantized_weights")
    quantized_nontrainable_weights: bool = _zero_default("quantized_nontrainable_weights")
    hpz_partition_size: int = _zero_default("hpz_partition_size")
    quantized_gradients: bool = _zero_default("quantized_gradients")
    loco_param: Optional[LocoParam] = None
    leaf_module: LeafModules = field(default_factory=LeafModules)

    def __post_init__(self) -> None:
        blocks = {"offload_optimizer": OffloadOptimizerConfig, "offload_param": OffloadParamConfig, "aio": AioConfig}
        rules = {f.name: ZERO_FIELDS[_key(f.name)].rule for f in fields(self) if f.name not in blocks}
        _normalise(self, rules, "ZeroOptions", nullable=("overlap_comm", "loco_param"))
        for name, kind in blocks.items():
            object.__setattr__(self, name, as_block(kind, getattr(self, name), name))
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        _check_offload_stage(self)
        _check_zeropp(self)

    @classmethod
    def from_dict(cls, d: Mapping, *, path: str = "zero_optimization") -> ZeroOptions:
        """Parse a ``zero_optimization`` mapping; errors name keys as ``{path}.{key}``.

        ``"auto"`` values take DeepSpeed's defaults; accepted-but-ignored keys are logged.
        """
        ctx = ParseContext()
        options = cls._from_parsed(ZERO(d, path, ctx))
        ctx.log()
        return options

    @classmethod
    def _from_parsed(cls, values: Mapping[str, Any], aio: Optional[AioConfig] = None) -> ZeroOptions:
        values = _deprecated_offload(values)
        return cls(**{**{f.name: values[_key(f.name)] for f in fields(cls)}, "aio": aio or values["aio"]})


_ZEROPP_WARNED: set[tuple[int, tuple[str, ...]]] = set()  # (stage, keys) already warned about in this process


def _warn_zeropp_below_stage3(options: ZeroOptions) -> None:
    """A DeepSpeed config's quantized weights or gradients at stages 1-2 are honoured, where DeepSpeed 0.19 ignores
    them (its stage 1-2 optimizer is built without them): the same JSON trains with other numbers, so say so, once
    per process (the keyword arguments of ``ShardedFusedAdam`` are not a DeepSpeed config: nothing is said)."""
    on = tuple(_key(name) for name in ("quantized_weights", "quantized_gradients") if getattr(options, name))
    if on and options.stage < 3 and (options.stage, on) not in _ZEROPP_WARNED:
        _ZEROPP_WARNED.add((options.stage, on))
        logger.warning(
            "zero_optimization: %s at stage %d: zero_kernels quantizes (lossy: %s), where DeepSpeed 0.19 ignores %s "
            "below stage 3; remove %s to train as DeepSpeed does",
            " and ".join(f"{key}=true" for key in on),
            options.stage,
            "; ".join(_ZEROPP_EFFECT[key] for key in on),
            "it" if len(on) == 1 else "them",
            "it" if len(on) == 1 else "them",
        )


_ZEROPP_EFFECT = {
    "zero_quantized_weights": "every rank's copy of the others' parameters is the int8 all-gather's, within half a "
    "block's scale",
    "zero_quantized_gradients": "the gradients are reduced in int4 blocks",
}


def _check_offload_stage(options: ZeroOptions) -> None:
    """Offload where DeepSpeed has it: the optimizer state at stages 1-3, the parameters at stage 3 (the block is
    dropped with a warning elsewhere, as DeepSpeed ignores it)."""
    if options.offload_optimizer.enabled and options.stage == 0:
        raise ValueError(
            f"zero_optimization.offload_optimizer.device={options.offload_optimizer.device!r} needs stage 1, 2 or 3 "
            "(stage 0 keeps no sharded optimizer state to offload); stage is 0"
        )
    if options.offload_param.enabled and options.stage != 3:
        logger.warning(
            "zero_optimization.offload_param.device=%r has no effect at stage %d: only stage 3 partitions the "
            "parameters (DeepSpeed ignores the block there too); every rank keeps its whole parameters",
            options.offload_param.device,
            options.stage,
        )
        object.__setattr__(options, "offload_param", OffloadParamConfig())
    options.offload_param.check_nvme()


def _deprecated_offload(values: Mapping[str, Any]) -> Dict[str, Any]:
    """DeepSpeed's old spellings: ``cpu_offload``/``cpu_offload_param`` true stand for device ``"cpu"``, and
    ``cpu_offload_use_pin_memory`` for ``pin_memory`` of both (given true beside the new blocks they are refused
    while parsing: ``Section.replaced``)."""
    out = dict(values)
    pin = values.get("cpu_offload_use_pin_memory", False)
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        block = out[new]
        if values.get(old):
            logger.info("zero_optimization.%s is DeepSpeed's deprecated spelling of %s.device='cpu'", old, new)
            block = replace(block, device="cpu")
        if pin and block.enabled:
            block = replace(block, pin_memory=True)
        out[new] = block
    return out


@dataclass(frozen=True)
class OptimizerConfig:
    """The ``optimizer`` section: Adam hyper-parameters and the weight-decay mode.

    ``adamw``: decoupled weight decay (``torch.optim.AdamW``) when true, L2 decay added to the
    gradient (``torch.optim.Adam``) when false; ``None`` means true. ``weight_decay=None`` takes
    torch's default for that update rule (1e-2 decoupled, 0 for L2).
    """

    type: str
    lr: float = OPTIMIZER_PARAMS.fields["lr"].default
    betas: Tuple[float, float] = OPTIMIZER_PARAMS.fields["betas"].default
    eps: float = OPTIMIZER_PARAMS.fields["eps"].default
    weight_decay: Optional[float] = None
    adamw: Optional[bool] = None
    amsgrad: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        keys = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
        rules = {name: OPTIMIZER_PARAMS.fields[name].rule for name in keys}
        _normalise(self, {"type": OPTIMIZER.fields["type"].rule, **rules}, "OptimizerConfig", ("weight_decay",))
        if self.adamw is None:
            object.__setattr__(self, "adamw", True)
        if not isinstance(self.adamw, bool):
            raise ValueError(f"OptimizerConfig.adamw={self.adamw!r} is invalid: expected true or false")
        if self.type == "AdamW" and not self.adamw:
            raise ValueError("OptimizerConfig.adamw=False contradicts type='AdamW': use type='Adam' for L2 decay")
        if self.weight_decay is None:
            object.__setattr__(self, "weight_decay", 1e-2 if self.adamw else 0.0)


@dataclass(frozen=True)
class FP16Config:
    """The ``fp16`` section. ``loss_scale=0`` means dynamic loss scaling from ``2**initial_scale_power``."""

    enabled: bool = FP16.fields["enabled"].default
    loss_scale: float = FP16.fields["loss_scale"].default
    initial_scale_power: int = FP16.fields["initial_scale_power"].default
    loss_scale_window: int = FP16.fields["loss_scale_window"].default
    hysteresis: int = FP16.fields["hysteresis"].default
    min_loss_scale: int = FP16.fields["min_loss_scale"].default
    consecutive_hysteresis: bool = FP16.fields["consecutive_hysteresis"].default

    def __post_init__(self) -> None:
        _normalise(self, {f.name: FP16.fields[f.name].rule for f in fields(self)}, "FP16Config")
        if self.enabled and self.loss_scale == 0:  # only dynamic scaling reads them, as in DeepSpeed
            for key in ("loss_scale_window", "min_loss_scale"):
                if getattr(self, key) < 1:
                    raise ValueError(
                        f"fp16.{key}={getattr(self, key)!r} is invalid: expected an integer >= 1 with dynamic loss "
                        "scaling (fp16.enabled with loss_scale 0)"
                    )


_COUNT = integer(1)
_CLIP = number(0)


def _check_precision(fp16: bool, bf16: bool, bf16_key: str = "bf16") -> None:
    if fp16 and bf16:
        raise ValueError(f"fp16.enabled and {bf16_key}.enabled are both true: enable at most one of them")


@dataclass(frozen=True)
class ZeroConfig:
    """Everything zero_kernels reads from a DeepSpeed config, validated and immutable.

    ``world_size`` is the data-parallel size the batch sizes were checked against.
    """

    zero: ZeroOptions = field(default_factory=ZeroOptions)
    optimizer: Optional[OptimizerConfig] = None
    bf16: bool = False
    fp16: FP16Config = field(default_factory=FP16Config)
    gradient_clipping: float = 0.0
    gradient_accumulation_steps: int = 1
    train_micro_batch_size_per_gpu: Optional[int] = None
    train_batch_size: Optional[int] = None
    communication_data_type: Optional[torch.dtype] = None
    grad_accum_dtype: Optional[torch.dtype] = None
    skip_nonfinite_steps: bool = True
    world_size: int = 1
    scheduler: Optional[SchedulerConfig] = None

    def __post_init__(self) -> None:
        kinds = (("zero", ZeroOptions), ("fp16", FP16Config), ("optimizer", OptimizerConfig))
        for name, kind in kinds + (("scheduler", SchedulerConfig),):
            value = getattr(self, name)
            if not isinstance(value, kind) and not (name in ("optimizer", "scheduler") and value is None):
                raise ValueError(f"ZeroConfig.{name}={value!r} is invalid: expected a {kind.__name__}")
        for name in ("bf16", "skip_nonfinite_steps"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ZeroConfig.{name}={getattr(self, name)!r} is invalid: expected true or false")
        for name in ("communication_data_type", "grad_accum_dtype"):
            if getattr(self, name) not in (None, *COMM_DTYPES.values()):
                allowed = ", ".join(str(t) for t in COMM_DTYPES.values())
                raise ValueError(f"ZeroConfig.{name}={getattr(self, name)!r}: expected {allowed} or None")
        counts = ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size", "world_size")
        rules = {"gradient_clipping": _CLIP, **{name: _COUNT for name in counts}}
        _normalise(self, rules, "ZeroConfig", ("train_micro_batch_size_per_gpu", "train_batch_size"))
        _check_precision(self.fp16.enabled, self.bf16)
        batch, micro = self.train_batch_size, self.train_micro_batch_size_per_gpu
        if batch is not None and micro is not None:
            _check_batch(batch, micro, self.gradient_accumulation_steps, self.world_size, ())
        check_hpz(self.zero.hpz_partition_size, self.world_size)

    @property
    def stage(self) -> int:
        """The ZeRO stage, 0 to 3."""
        return self.zero.stage

    def sharded_options(self) -> dict[str, Any]:
        """``ShardedFusedAdam``'s keyword arguments this config sets beside the optimizer's hyper-parameters and what
        a training loop counts or clips itself: every ``zero_optimization`` option a stage reads (the stage
        included; the keys without effect, ``ZERO_INERT``, were logged when the config gave them and would be
        logged again, given or not, as keywords), ``communication_data_type``, ``data_types.grad_accum_dtype`` and
        ``skip_nonfinite_steps``."""
        zero = {f.name: getattr(self.zero, f.name) for f in fields(self.zero) if _key(f.name) not in ZERO_INERT}
        return dict(
            zero, communication_data_type=self.communication_data_type, grad_accum_dtype=self.grad_accum_dtype,
            skip_nonfinite_steps=self.skip_nonfinite_steps,
        )  # fmt: skip

    @classmethod
    def from_deepspeed(
        cls,
        source: Union[str, os.PathLike, Mapping],
        *,
        world_size: Optional[int] = None,
        training_args: Any = None,
        **auto_values: Any,
    ) -> ZeroConfig:
        """Parse a DeepSpeed config file (path) or an already-loaded mapping.

        Args:
            source: path to a JSON file (hjson where it is installed, as DeepSpeed reads it), a base64-encoded
                JSON string, or a mapping with the same content.
            world_size: data-parallel size for the batch-size check; ``None`` = the initialised
                ``torch.distributed`` world size, else 1.
            training_args: a ``transformers.TrainingArguments`` (any object with its attributes) whose
                values fill ``"auto"`` as the Hugging Face Trainer does; keywords take precedence.
            **auto_values: values for ``"auto"`` (or missing) keys, by the names in
                ``AUTO_KEYWORDS`` (``lr``, ``train_micro_batch_size_per_gpu``, ``bf16``,
                ``total_num_steps``, ...) and ``hidden_size``; ``None`` counts as not given.
        """
        data = load(source)
        world = _world_size(world_size)
        given = {k: v for k, v in auto_values.items() if v is not None}
        overrides = _overrides(given, data)
        if training_args is not None:
            from_args = training_args_overrides(training_args, world, given.get("total_num_steps"))
            overrides = {**from_args, **overrides}
        ctx = ParseContext(overrides=overrides, auto_defaults=dict(TRAINER_DEFAULTS), derived=set(_BATCH_KEYS))
        if "bf16" in data and "bfloat16" in data:
            raise ValueError('both "bf16" and its legacy spelling "bfloat16" are given: keep only "bf16"')
        data = _legacy_zero_flag(data)
        _aio_forms(data)
        top = TOP(data, "", ctx)
        _check_unused(ctx, data)
        config = _build(cls, top, world, ctx)
        ctx.log()
        _warn_zeropp_below_stage3(config.zero)
        return config


def _build(cls: type, top: Dict[str, Any], world: int, ctx: ParseContext) -> ZeroConfig:
    legacy = top["bfloat16"] is not None
    bf16 = (top["bfloat16"] if legacy else top["bf16"])["enabled"]
    fp16 = FP16Config(**top["fp16"])
    _check_precision(fp16.enabled, bf16, "bfloat16" if legacy else "bf16")
    batch, micro, accum = _derive_batch(
        top["train_batch_size"], top["train_micro_batch_size_per_gpu"], top["gradient_accumulation_steps"], world, ctx
    )
    return cls(
        zero=ZeroOptions._from_parsed(top["zero_optimization"], top["aio"]),
        optimizer=_optimizer(top["optimizer"]),
        bf16=bf16,
        fp16=fp16,
        gradient_clipping=top["gradient_clipping"],
        gradient_accumulation_steps=accum,
        train_micro_batch_size_per_gpu=micro,
        train_batch_size=batch,
        communication_data_type=top["communication_data_type"],
        grad_accum_dtype=top["data_types"]["grad_accum_dtype"],
        skip_nonfinite_steps=top["skip_nonfinite_steps"],
        world_size=world,
        scheduler=top["scheduler"],
    )


def _legacy_zero_flag(data: Mapping) -> Mapping:
    """``"zero_optimization": true`` (or false), DeepSpeed's deprecated form: stage 1 (0), with one warning."""
    flag = data.get("zero_optimization")
    if not isinstance(flag, bool):
        return data
    stage = 1 if flag else 0
    logger.warning(
        '"zero_optimization": %s is a deprecated form, read as DeepSpeed reads it: '
        '{"stage": %d}; write "zero_optimization": {"stage": %d}',
        "true" if flag else "false",
        stage,
        stage,
    )
    return {**data, "zero_optimization": {"stage": stage}}


def _aio_forms(data: Mapping) -> None:
    """The ``aio`` block where DeepSpeed 0.19 reads it (top level, ``intra_op_parallelism``), or in the Hugging
    Face template's form (inside ``zero_optimization``, ``thread_count``) with one warning; never both places."""
    zero = data.get("zero_optimization")
    nested = isinstance(zero, Mapping) and "aio" in zero
    if nested and "aio" in data:
        raise ValueError('"aio" is given both at the top level and in zero_optimization: keep only the top-level one')
    block = zero["aio"] if nested else data.get("aio")
    threads = isinstance(block, Mapping) and "thread_count" in block
    if not (nested or threads):
        return
    what = []
    if nested:
        what.append(
            "zero_optimization.aio is read by zero_kernels, but DeepSpeed 0.19 reads aio only at the top level "
            "and refuses this block (zero_optimization takes no key 'aio': the same file fails to load there)"
        )
    if threads:
        what.append(
            "aio.thread_count is read as intra_op_parallelism, DeepSpeed 0.19's name for it (DeepSpeed would "
            "ignore thread_count and use 1 thread)"
        )
    logger.warning('%s; move it to the top-level "aio" block as intra_op_parallelism', "; ".join(what))


def _optimizer(values: Optional[Mapping[str, Any]]) -> Optional[OptimizerConfig]:
    """DeepSpeed's Adam/AdamW selection rules applied to a parsed ``optimizer`` section."""
    if values is None:
        return None
    if values["type"] is None:
        raise ValueError("optimizer.type is missing: expected one of 'Adam', 'AdamW'")
    params = values["params"]
    adamw = values["type"] == "AdamW" or params["adam_w_mode"]
    if values["type"] == "AdamW" and not params["adam_w_mode"]:
        logger.warning("optimizer.params.adam_w_mode=false has no effect with type AdamW (as in DeepSpeed)")
    decay = params["weight_decay"]
    if decay is None:
        decay = 1e-2 if params["torch_adam"] and adamw else 0.0
    return OptimizerConfig(
        type=values["type"], lr=params["lr"], betas=params["betas"], eps=params["eps"], weight_decay=decay, adamw=adamw,
        amsgrad=params["amsgrad"], maximize=params["maximize"],
    )  # fmt: skip


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _derive_batch(
    batch: Optional[int], micro: Optional[int], accum: Optional[int], world: int, ctx: ParseContext
) -> Tuple[Optional[int], Optional[int], int]:
    """Fill the missing batch sizes as DeepSpeed does, then check they agree with ``world``.

    With neither ``train_batch_size`` nor ``train_micro_batch_size_per_gpu`` given (DeepSpeed
    refuses that; the optimizer does not need them) both stay ``None`` and accumulation defaults to 1.
    """
    given = (batch is not None, micro is not None, accum is not None)
    if given == (True, True, False):
        accum = batch // micro // world
    elif given == (True, False, True):
        micro = batch // world // accum
    elif given == (False, True, True):
        batch = micro * accum * world
    elif given == (True, False, False):
        micro, accum = batch // world, 1
    elif given == (False, True, False):
        batch, accum = micro * world, 1
    elif batch is None and micro is None:
        accum = 1 if accum is None else accum
    derived = tuple(k for k, was in zip(_BATCH_KEYS, given) if not was)
    if batch is not None and micro is not None:
        for key, value in zip(_BATCH_KEYS, (batch, micro, accum)):
            if key in derived:
                ctx.choose(key, value, f"derived for world_size={world}", auto=key in ctx.autos)
        _check_batch(batch, micro, accum, world, derived)
    return batch, micro, accum


def _check_batch(batch: int, micro: int, accum: int, world: int, derived: Tuple[str, ...]) -> None:
    """DeepSpeed's rule: train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world."""
    values = dict(zip(_BATCH_KEYS, (batch, micro, accum)))
    shown = {k: f"{k}={v}" + (" (derived)" if k in derived else "") for k, v in values.items()}
    bad = [shown[k] for k, v in values.items() if v < 1]
    if bad:  # a derived size (the ones given are >= 1): say what it was derived from
        given = ", ".join(shown[k] for k in _BATCH_KEYS if k not in derived)
        raise ValueError(
            f"{', '.join(bad)} is invalid: batch sizes must be >= 1 ({given}, world_size={world}; train_batch_size "
            "must equal train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size)"
        )
    if batch != micro * accum * world:
        raise ValueError(
            f"{shown['train_batch_size']} must equal train_micro_batch_size_per_gpu * gradient_accumulation_steps * "
            f"world_size = {micro} * {accum} * {world} = {micro * accum * world} "
            f"({shown['train_micro_batch_size_per_gpu']}, {shown['gradient_accumulation_steps']})"
        )


def _world_size(world_size: Optional[int]) -> int:
    if world_size is None:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return integer(1)(world_size, "world_size")


def _overrides(auto_values: Mapping[str, Any], data: Mapping) -> Dict[str, Override]:
    """Keyword arguments of ``from_deepspeed`` -> key path -> ``Override``."""
    out: Dict[str, Override] = {}
    if "hidden_size" in auto_values:
        hidden = HIDDEN_SIZE_RULE(auto_values["hidden_size"], "hidden_size")
        for path, value in hidden_size_values(hidden):
            out[path] = Override(value, f"hidden_size={hidden}", strict=False)
    for name, value in auto_values.items():
        if name == "hidden_size":
            continue
        if name not in AUTO_KEYWORDS:
            known = sorted([*AUTO_KEYWORDS, "hidden_size"])
            raise ValueError(
                f'unknown keyword {name!r}{suggest(name, [*known, "world_size"])}; the keywords that fill "auto" '
                f"values are {', '.join(known)} (and world_size, the data-parallel size, for from_deepspeed)"
            )
        path = AUTO_KEYWORDS[name]
        if name == "bf16" and "bfloat16" in data and "bf16" not in data:
            path = "bfloat16.enabled"
        out[path] = Override(value, f"keyword {name}")
    return out


def _check_unused(ctx: ParseContext, data: Mapping) -> None:
    for path, override in ctx.overrides.items():
        if override.strict and override.fills_missing and path not in ctx.used:
            section = path.split(".")[0]
            where = (
                f"which the config's {section!r} section does not take"
                if section in data
                else (f"but the config has no {section!r} section")
            )
            raise ValueError(f"{override.source}={override.value!r} sets {path}, {where}")
