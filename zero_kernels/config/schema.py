"""The DeepSpeed JSON schema understood by ``ZeroConfig.from_deepspeed``, as tables.

Each section is a ``Section``: the keys zero_kernels acts on (rule, DeepSpeed's default, whether
``"auto"`` is allowed), the keys DeepSpeed accepts that change nothing here (with the level they
are logged at: WARNING where DeepSpeed would change training and zero_kernels does not, INFO
otherwise), and alternative spellings. Defaults follow DeepSpeed's own config classes
(``deepspeed/runtime/zero/config.py``, ``precision_config.py``, ``constants.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .monitoring import UNUSED as MONITORING
from .offload import (
    AIO_RULES,
    OPTIMIZER_RULES,
    PARAM_RULES,
    AioConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
)
from .rules import (
    Field,
    Invalid,
    Scalar,
    Section,
    Unsupported,
    Unused,
    boolean,
    choice,
    enum_integer,
    integer,
    number,
    pair,
    rejected,
    strings,
)
from .scheduler import SCHEDULER

INFO, WARNING = logging.INFO, logging.WARNING

OPTIMIZER_TYPES = ("Adam", "AdamW")
COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# DeepSpeed reads data_types' dtypes with its DtypeEnum, which also takes these spellings (int8 aside).
GRAD_ACCUM_DTYPES = {
    **COMM_DTYPES,
    **dict.fromkeys(("float32", "float", "torch.float32"), torch.float32),
    **dict.fromkeys(("float16", "half", "torch.float16"), torch.float16),
    **dict.fromkeys(("bfloat16", "torch.bfloat16"), torch.bfloat16),
}

# A bare device name is accepted too ("cpu" stands for {"device": "cpu"}).
_OFFLOAD_ALLOWED = 'a JSON object such as {"device": "cpu"}, a device name, or null'


def _block_fields(kind: type, rules: Dict[str, Scalar]) -> Dict[str, Field]:
    defaults = {f.name: f.default for f in fields(kind)}
    return {name: Field(rule, defaults[name], auto=False) for name, rule in rules.items()}


OFFLOAD_OPTIMIZER = Section(
    fields=_block_fields(OffloadOptimizerConfig, OPTIMIZER_RULES),
    ignored={"convert_grad_on_cpu": INFO},
    # DeepSpeed's faster start of its nvme swapper: the disk tier writes a new buffer's state piece by piece anyway
    unused={"fast_init": Unused(boolean(), level=INFO)},
    finish=lambda d: OffloadOptimizerConfig(**{k: d[k] for k in OPTIMIZER_RULES}),
    nullable=True,
    shorthand="device",
    allowed=_OFFLOAD_ALLOWED,
)
OFFLOAD_PARAM = Section(
    fields=_block_fields(OffloadParamConfig, PARAM_RULES),
    finish=lambda d: OffloadParamConfig(**d),
    nullable=True,
    shorthand="device",
    allowed=_OFFLOAD_ALLOWED,
)
# DeepSpeed 0.19 reads "aio" at the top level only, and its thread count as "intra_op_parallelism";
# Hugging Face's NVMe template nests it in zero_optimization and writes "thread_count" (``zero_config``
# accepts both with one warning).
AIO = Section(
    fields={
        **_block_fields(AioConfig, AIO_RULES),
        "use_gds": Field(boolean(supported=(False,)), False, auto=False),
    },
    aliases={"thread_count": "intra_op_parallelism"},
    finish=lambda d: AioConfig(**{k: d[k] for k in AIO_RULES}),
    optional=True,
)


class LocoParam(dict):
    """``zeropp_loco_param``: error feedback of the quantized gradient reduction (LoCo): the carried
    error decays by ``err_beta`` and is reset every ``reset_T`` steps (DeepSpeed's defaults 0.8, 1024).

    A read-only dict with DeepSpeed's keys (what DeepSpeed's config holds), also read as attributes.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        dict.__init__(self, {"err_beta": 0.8, "reset_T": 1024})
        dict.update(self, *args, **kwargs)

    @property
    def err_beta(self) -> float:
        return self["err_beta"]

    @property
    def reset_T(self) -> int:  # noqa: N802 (DeepSpeed's key)
        return self["reset_T"]

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("zeropp_loco_param is read-only: make a new one")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = __ior__ = _read_only

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def __reduce__(self) -> tuple:
        return LocoParam, (dict(self),)


_LOCO = Section(
    fields={
        "err_beta": Field(number(0, 1, hi_open=True), 0.8, auto=False),
        "reset_T": Field(integer(1), 1024, auto=False),
    },
    finish=LocoParam,
    allowed='a JSON object such as {"err_beta": 0.8, "reset_T": 1024}, or null',
)


def _loco(value: Any, path: str, ctx: Any = None) -> Optional[LocoParam]:
    """null (off), a ``{"err_beta", "reset_T"}`` object, or a ``LocoParam`` (checked again)."""
    if value is None:
        return None
    return _LOCO(value, path, ctx)


# DeepSpeed 0.19's default leaf modules: Hugging Face's mixture-of-experts blocks, whose experts run by the data.
DEFAULT_LEAF_CLASSES: Tuple[str, ...] = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


@dataclass(frozen=True)
class LeafModules:
    """``zero_optimization.leaf_module``: the modules stage 3 treats as leaves (``set_leaf_modules``), by class
    (its name or ``module.QualifiedName``), by name in ``named_modules()``, or by the end of that name."""

    classes: Tuple[str, ...] = DEFAULT_LEAF_CLASSES
    names: Tuple[str, ...] = ()
    name_suffixes: Tuple[str, ...] = ()


_LEAF = Section(
    fields={
        "classes": Field(strings(), DEFAULT_LEAF_CLASSES, auto=False),
        "names": Field(strings(), (), auto=False),
        "name_suffixes": Field(strings(), (), auto=False),
    },
    finish=lambda d: LeafModules(**d),
    nullable=True,
    allowed='a JSON object such as {"classes": ["MixtralSparseMoeBlock"], "names": [], "name_suffixes": []}',
)

# ZeRO++ (DeepSpeed's ``zero_*`` keys): the field of ``ZeroOptions`` each is carried in.
ZEROPP_FIELDS: Dict[str, str] = {
    "quantized_weights": "zero_quantized_weights",
    "quantized_nontrainable_weights": "zero_quantized_nontrainable_weights",
    "hpz_partition_size": "zero_hpz_partition_size",
    "quantized_gradients": "zero_quantized_gradients",
    "loco_param": "zeropp_loco_param",
}

# The counts take strings holding an integer ("1000", "1000.0") as DeepSpeed's zero_optimization model reads them.
ZERO_FIELDS: Dict[str, Field] = {
    "stage": Field(enum_integer(0, 3), 0, auto=False),
    # None: DeepSpeed's stage-dependent default, on for stage 3 only.
    "overlap_comm": Field(boolean(), None),
    "contiguous_gradients": Field(boolean(), True),
    "reduce_bucket_size": Field(integer(1, text=True), 500_000_000),
    "allgather_bucket_size": Field(integer(1, text=True), 500_000_000),
    "reduce_scatter": Field(boolean(), True),
    # Not a DeepSpeed key (Megatron's overlap_param_gather): stages 1-2 wait for the all-gather after the
    # step where the next forward first uses a parameter, not in the step.
    "overlap_param_gather": Field(boolean(), False),
    # 0 is DeepSpeed's way to turn prefetching off, so it is allowed here.
    "stage3_prefetch_bucket_size": Field(integer(0, text=True), 50_000_000),
    "stage3_param_persistence_threshold": Field(integer(0, text=True), 100_000),
    "stage3_max_live_parameters": Field(integer(0, text=True), 1_000_000_000),
    "stage3_max_reuse_distance": Field(integer(0, text=True), 1_000_000_000),
    # Whether the Hugging Face integration's save_model gathers full weights at stage 3 (DeepSpeed's default: no).
    "stage3_gather_16bit_weights_on_model_save": Field(boolean(), False),
    "offload_optimizer": Field(OFFLOAD_OPTIMIZER, None, auto=False),
    "offload_param": Field(OFFLOAD_PARAM, None, auto=False),
    # Elements of the optimizer state swapped in and out at once by the disk tier (DeepSpeed's default).
    "sub_group_size": Field(integer(0, text=True), 1_000_000_000),
    "aio": Field(AIO, None, auto=False),  # the Hugging Face template's place; DeepSpeed reads it at the top level
    # Deprecated DeepSpeed spellings: offload_optimizer / offload_param {"device": "cpu"}, and their pin_memory.
    "cpu_offload": Field(boolean(), False, auto=False),
    "cpu_offload_param": Field(boolean(), False, auto=False),
    "cpu_offload_use_pin_memory": Field(boolean(), False, auto=False),
    # ZeRO++ (``ZEROPP_FIELDS``; the stages each applies at are checked by ``ZeroOptions``).
    "zero_quantized_weights": Field(boolean(), False, auto=False),
    # Stage 3: frozen parameters partitioned too, and stored in int8 (``stages.stage3.frozen``).
    "zero_quantized_nontrainable_weights": Field(boolean(), False, auto=False),
    # 0 and 1 both mean no secondary partition (DeepSpeed: ge=0, on above 1).
    "zero_hpz_partition_size": Field(integer(0, text=True), 1, auto=False),
    "zero_quantized_gradients": Field(boolean(), False, auto=False),
    "zeropp_loco_param": Field(_loco, None, auto=False),
    "leaf_module": Field(_LEAF, None, auto=False),
}

ZERO_IGNORED: Dict[str, int] = {
    **{
        k: INFO
        for k in (
            "round_robin_gradients",
            "elastic_checkpoint",
            "ignore_unused_parameters",
            "allgather_partitions",
            "use_multi_rank_bucket_allreduce",
            "memory_efficient_linear",
            "legacy_stage1",
            "stage3_model_persistence_threshold",
            "model_persistence_threshold",
            "stage3_module_granularity_threshold",
            "module_granularity_threshold",
            "stage3_use_all_reduce_for_fetch_params",
            "use_all_reduce_for_fetch_params",
            "stage3_allgather_sequential",
            "allgather_sequential",
            "stage3_partition_stream_chunk_size",
            "partition_stream_chunk_size",
            "pipeline_loading_checkpoint",
            "override_module_apply",
            "log_trace_cache_warnings",
            "enable_sanity_checks",
            "save_muon_momentum_buffer_in_memory",
            "mics_hierarchical_params_gather",
        )
    },
    **{
        k: WARNING
        for k in (
            "mics_shard_size",
            "zenflow",
        )
    },
}

# DeepSpeed's pydantic model accepts its field names as well as the stage3_* aliases.
ZERO_ALIASES: Dict[str, str] = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    # ZeroOptions' field names, so that keyword arguments may use either spelling.
    **{name: key for name, key in ZEROPP_FIELDS.items()},
}

ZERO_UNUSED: Dict[str, Unused] = {
    # false: DeepSpeed rebuilds the fp32 masters from the 16-bit weights when it loads a checkpoint; loads here
    # always take the checkpoint's fp32 masters
    "load_from_fp32_weights": Unused(boolean(), quiet=lambda value: value is not False),
}

# Keys read into ``ZeroOptions`` that no stage acts on, and whether a value asks for what the stages do anyway:
# stages 0, 2 and 3 reduce during backward, stage 1 at the step; gradients always go through contiguous buckets
# that stages 1-3 reduce-scatter; stage 3 frees every unit after each use (a reuse distance of 0).
ZERO_INERT: Dict[str, Callable[[Any, Mapping[str, Any]], bool]] = {
    "overlap_comm": lambda value, zero: value is None or value == (zero["stage"] != 1),
    "contiguous_gradients": lambda value, zero: value is True,
    "reduce_scatter": lambda value, zero: value is True or zero["stage"] == 0,
    "stage3_max_reuse_distance": lambda value, zero: True,
}

ZERO = Section(
    fields=ZERO_FIELDS,
    ignored=ZERO_IGNORED,
    aliases=ZERO_ALIASES,
    unused=ZERO_UNUSED,
    inert=ZERO_INERT,
    replaced={"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"},
)

OPTIMIZER_PARAMS = Section(
    fields={
        "lr": Field(number(0), 1e-3),
        "betas": Field(pair(number(0, 1, hi_open=True)), (0.9, 0.999)),
        "eps": Field(number(0), 1e-8),
        # None: DeepSpeed's FusedAdam default 0, or torch's default for the class when torch_adam is set.
        "weight_decay": Field(number(0), None),
        "torch_adam": Field(boolean(), False),
        "adam_w_mode": Field(boolean(), True),
        "bias_correction": Field(boolean(supported=(True,)), True, auto=False),
        "amsgrad": Field(boolean(), False, auto=False),
        "maximize": Field(boolean(), False, auto=False),
        "max_grad_norm": Field(rejected('the top-level "gradient_clipping"'), auto=False),
    },
    # torch.optim.AdamW's choice of implementation (DeepSpeed hands them to it with torch_adam): no effect here.
    unused={key: Unused(boolean(nullable=True), level=INFO) for key in ("foreach", "fused")},
    unsupported={
        "fp32_optimizer_states": Unsupported(
            "Adam's moments in the parameters' dtype (DeepSpeedCPUAdam's option); zero_kernels keeps them in fp32",
            off=lambda value: value is True,
            how_off="set it to true or leave it out",
        )
    },
)

OPTIMIZER = Section(
    fields={
        "type": Field(choice({t.lower(): t for t in OPTIMIZER_TYPES}, shown=OPTIMIZER_TYPES), None, auto=False),
        "params": Field(OPTIMIZER_PARAMS, None, auto=False),
    },
    ignored={"legacy_fusion": INFO},
    optional=True,
)

FP16 = Section(
    fields={
        "enabled": Field(boolean(), False),
        "loss_scale": Field(number(0, text=True), 0.0),  # DeepSpeed reads it with float(): "128" too
        # ints in DeepSpeed's config model, which reads "2" as 2 and refuses 0.5
        # at most 1023: the starting scale 2**power must be a float (DeepSpeed refuses an infinite one)
        "initial_scale_power": Field(integer(0, 1023, text=True), 16),
        "loss_scale_window": Field(integer(text=True), 1000),  # >= 1 with dynamic scaling: FP16Config
        "hysteresis": Field(integer(1, text=True), 2),
        "min_loss_scale": Field(integer(text=True), 1),  # >= 1 with dynamic scaling: FP16Config
        "consecutive_hysteresis": Field(boolean(), False),
    },
    ignored={
        "auto_cast": WARNING,
        "fp16_master_weights_and_grads": WARNING,
        "fused_mode": INFO,
    },
)

_BF16_IGNORED = {
    "immediate_grad_update": INFO,
    "bf16_master_weights_and_grads": WARNING,
    "bf16_optimizer_states": WARNING,
}


def _no_static_scale(value: Any) -> float:
    if number(0).convert(value) != 0:
        raise Invalid
    return 0.0


# The fp16 block's loss-scaling keys, copied into bf16 blocks (LLaMA-Factory's ALST template): bf16 training has
# no loss scaling, so DeepSpeed up to 0.16 never read them there and 0.17 onwards refuses them (its bf16 config
# allows no other key). Accepted with the fp16 block's rules and a warning; a static scale (loss_scale > 0) asks
# for scaling that no release applied in bf16, so it is refused.
_BF16_LOSS_SCALING = {
    "loss_scale": Unused(
        Scalar(
            "0 (dynamic: bf16 training has no loss scaling; DeepSpeed 0.16 ignored the key in the bf16 block and "
            "0.17 onwards refuses it): remove it or write 0",
            _no_static_scale,
        )
    ),
    **{key: Unused(FP16.fields[key].rule) for key in FP16.fields if key not in ("enabled", "loss_scale")},
    "auto_cast": Unused(boolean()),
}
_BF16_UNUSED = {
    **_BF16_LOSS_SCALING,
    # false: DeepSpeed applies inf/NaN gradients; the step here still skips them unless skip_nonfinite_steps is false
    "check_grad_overflow": Unused(boolean(), quiet=lambda value: value is not False),
}
# null: the defaults, as DeepSpeed reads it (its legacy "bfloat16": null fails there; optional here: as absent)
BF16 = Section(fields={"enabled": Field(boolean(), False)}, ignored=_BF16_IGNORED, unused=_BF16_UNUSED, nullable=True)
BFLOAT16 = Section(
    fields={"enabled": Field(boolean(), False)}, ignored=_BF16_IGNORED, unused=_BF16_UNUSED, optional=True
)

TOP_IGNORED: Dict[str, int] = {
    **{
        k: INFO
        for k in (
            "steps_per_print",
            "wall_clock_breakdown",
            "memory_breakdown",
            "dump_state",
            "flops_profiler",
            "zero_allow_untested_optimizer",
            "zero_force_ds_cpu_optimizer",
            "dataloader_drop_last",
            "checkpoint",
            "autotuning",
            "vocabulary_size",
            "timers",
            "hybrid_engine",
            "disable_allgather",
            "use_data_before_expert_parallelism",
            "seq_parallel_communication_data_type",
            "log_level",
            "disable_python_gc",
        )
    },
    **{
        k: WARNING
        for k in (
            "compile",
            "activation_checkpointing",
            "pipeline",
            "prescale_gradients",
            "gradient_predivide_factor",
            "data_efficiency",
            "weight_quantization",
        )
    },
}

# ``grad_accum_dtype`` acts at every stage (``stages.grad_accum``: how and why, and DeepSpeed's default, the
# training dtype, which is zero_kernels' too); a dtype narrower than the gradients warns when the optimizer is built.
DATA_TYPES = Section(
    fields={"grad_accum_dtype": Field(choice(GRAD_ACCUM_DTYPES, nullable=True), None, auto=False)},
    ignored={"param_dtype": WARNING, "buffer_dtype": WARNING},
)


def _disabled(value: Any) -> bool:
    """A block written with ``"enabled": false`` (or null): it turns nothing on."""
    return value is None or (isinstance(value, Mapping) and value.get("enabled") is False)


# Keys DeepSpeed's engine acts on and zero_kernels does not: listed at WARNING, or at INFO where the value is
# DeepSpeed's default, which asks for what happens here anyway (no autocast; gradients reduced in their own dtype).
TOP_ENGINE: Dict[str, Unused] = {
    "torch_autocast": Unused(
        None, quiet=lambda value: value is None or (isinstance(value, Mapping) and not value.get("enabled"))
    ),
    "fp32_allreduce": Unused(None, quiet=lambda value: value is False),
}


def _tp_off(value: Any) -> bool:
    """Whether a ``tensor_parallel`` block asks for no tensor parallelism: absent, or its ``autotp_size`` (else its
    ``tp.tp_size``) unset, 0 or 1. Anything but a mapping asks for something unknown."""
    if value is None:
        return True
    if not isinstance(value, Mapping):
        return False
    tp = value.get("tp")
    size = value.get("autotp_size", tp.get("tp_size") if isinstance(tp, Mapping) else tp)
    return size is None or (not isinstance(size, bool) and size in (0, 1))


# Blocks that training tools hand DeepSpeed (LLaMA-Factory's ALST template, its fp8 template) and that change how
# the model runs: zero_kernels cannot honour them, so they are refused unless turned off.
TOP_UNSUPPORTED: Dict[str, Unsupported] = {
    "sequence_parallel": Unsupported(
        "sequence parallelism (Ulysses/ALST) splits every sample's sequence over several ranks, which changes the "
        "data-parallel size and how those ranks' gradients combine; zero_kernels treats every rank of its process "
        "group as a data-parallel replica",
        _disabled,
        'remove the block or write "enabled": false to train data-parallel only',
    ),
    "sequence_parallel_size": Unsupported(
        "DeepSpeed divides the world size by it to get the data-parallel size (and so the batch sizes and the "
        "ranks gradients are averaged over); zero_kernels reduces over the whole process group",
        lambda value: value in (None, 1),
        "remove it or write 1",
    ),
    "tensor_parallel": Unsupported(
        "DeepSpeed's AutoTP splits the model's linear layers over autotp_size ranks and divides the world size by "
        "it to get the data-parallel size (the ranks of one tensor-parallel group see the same batch); "
        "zero_kernels keeps every parameter whole on each data-parallel replica and reduces over the whole "
        "process group",
        _tp_off,
        "remove the block or write autotp_size 1",
    ),
    "gradient_allreduce_op": Unsupported(
        "DeepSpeed's \"sum\" adds the data-parallel ranks' gradients instead of averaging them (every "
        "gradient, and so the clipping norm, world-size times larger); zero_kernels averages them, as DeepSpeed's "
        'default "mean"',
        lambda value: value is None or (isinstance(value, str) and value.lower() == "mean"),
        'remove it or write "mean" (for summed gradients, multiply the loss by the world size)',
    ),
    "managed_gradient_accumulation": Unsupported(
        "DeepSpeed's false makes every step() call apply an update (the caller owns the accumulation boundary) while "
        "backward still divides the loss by gradient_accumulation_steps; zero_kernels counts "
        "gradient_accumulation_steps step() calls per update, as DeepSpeed's default true",
        lambda value: value is None or value is True,
        "remove it or write true; for updates at the steps you choose, write gradient_accumulation_steps 1 (with "
        "train_batch_size to match) and divide the loss by your number of backward passes: several backward passes "
        "before one step() add up",
    ),
    "fp8": Unsupported(
        "fp8 training runs the matrix multiplications in fp8 with their own scaling (through the training tool, "
        "e.g. Transformer Engine); zero_kernels keeps and updates the parameters in their fp32/bf16/fp16 dtype and "
        "does not cast the model to fp8",
        _disabled,
        'remove the block or write "enabled": false (bf16 training: "bf16": {"enabled": true})',
    ),
}


def _removed_off(value: Any) -> bool:
    """Whether a key DeepSpeed removed turns nothing on: null, false, an empty block or ``"enabled": false``."""
    return value is False or value == {} or _disabled(value)


def _removed(feature: str, instead: str = "") -> Unsupported:
    """A top-level key DeepSpeed 0.19 removed and refuses at any value (its ``_REMOVED_TOP_LEVEL_CONFIG_KEYS``)."""
    return Unsupported(
        f"DeepSpeed 0.19 removed {feature} and refuses the key" + (f" ({instead})" if instead else ""),
        _removed_off,
        'remove it, or write false, {} or "enabled": false',
    )


# DeepSpeed 0.19's removed features: refused rather than logged, as the user asked for something no release runs.
TOP_REMOVED: Dict[str, Unsupported] = {
    "amp": _removed(
        "NVIDIA Apex AMP mixed precision", "zero_kernels would train in the parameters' dtype; use fp16 or bf16"
    ),
    "sparse_gradients": _removed("the sparse reduction of dense nn.Embedding gradients"),
    "elasticity": _removed(
        "elastic training", "set train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps"
    ),
    "nebula": _removed("Nebula checkpointing"),
    "compression_training": _removed("the compression library"),
    "quantize_training": _removed("Mixture-of-Quantization training"),
    "eigenvalue": _removed("eigenvalue-based Mixture-of-Quantization"),
    "sparse_attention": _removed("Sparse Attention"),
    "graph_harvesting": _removed("graph harvesting"),
    "curriculum_learning": _removed(
        "top-level curriculum learning", "it reads data_efficiency.data_sampling.curriculum_learning"
    ),
    "progressive_layer_drop": _removed("Progressive Layer Dropping"),
}

TOP = Section(
    fields={
        "zero_optimization": Field(ZERO, None, auto=False),
        "optimizer": Field(OPTIMIZER, None, auto=False),
        # After "optimizer": an "auto" warmup_max_lr takes the optimizer's resolved lr.
        "scheduler": Field(SCHEDULER, None, auto=False),
        "bf16": Field(BF16, None, auto=False),
        "bfloat16": Field(BFLOAT16, None, auto=False),
        "fp16": Field(FP16, None, auto=False),
        # DeepSpeed's GRADIENT_CLIPPING_DEFAULT (1.0 in DeepSpeed 0.19; it was 0 in older releases).
        "gradient_clipping": Field(number(0), 1.0),
        "gradient_accumulation_steps": Field(integer(1), None),
        "train_micro_batch_size_per_gpu": Field(integer(1), None),
        "train_batch_size": Field(integer(1), None),
        "communication_data_type": Field(choice(COMM_DTYPES, nullable=True), None),
        "data_types": Field(DATA_TYPES, None, auto=False),
        # zero_kernels' own key (DeepSpeed ignores unknown top-level keys): skip a step whose
        # gradients are not finite (fp32/bf16; fp16 loss scaling always skips).
        "skip_nonfinite_steps": Field(boolean(), True),
        "aio": Field(AIO, None, auto=False),
    },
    ignored=TOP_IGNORED,
    unsupported={**TOP_UNSUPPORTED, **TOP_REMOVED},
    unused={**MONITORING, **TOP_ENGINE},
)

# Keyword arguments of ``from_deepspeed`` that fill "auto" (or missing) values: name -> key path.
# ``bf16`` is redirected to ``bfloat16.enabled`` when a config uses only the legacy spelling.
AUTO_KEYWORDS: Dict[str, str] = {
    "lr": "optimizer.params.lr",
    "betas": "optimizer.params.betas",
    "eps": "optimizer.params.eps",
    "weight_decay": "optimizer.params.weight_decay",
    "gradient_clipping": "gradient_clipping",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu": "train_micro_batch_size_per_gpu",
    "train_batch_size": "train_batch_size",
    "communication_data_type": "communication_data_type",
    "grad_accum_dtype": "data_types.grad_accum_dtype",
    "bf16": "bf16.enabled",
    "fp16": "fp16.enabled",
    **{k: f"zero_optimization.{k}" for k, f in ZERO_FIELDS.items() if f.auto},
    **{k: f"scheduler.params.{k}" for k in ("total_num_steps", "warmup_num_steps", "warmup_min_lr", "warmup_max_lr")},
}

# ``hidden_size`` fills only "auto" bucket sizes, the way the Hugging Face Trainer derives them.
HIDDEN_SIZE_RULE: Scalar = integer(1)


def hidden_size_values(hidden: int) -> Tuple[Tuple[str, int], ...]:
    """Key paths and values the Hugging Face Trainer derives from a model's hidden size."""
    return (
        ("zero_optimization.reduce_bucket_size", hidden * hidden),
        ("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden)),
        ("zero_optimization.stage3_param_persistence_threshold", 10 * hidden),
    )
