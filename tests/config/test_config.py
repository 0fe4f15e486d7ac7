"""ZeroConfig.from_deepspeed: every key, DeepSpeed's defaults, "auto" resolution, batch sizes, bad values."""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import re
import types

import pytest
import torch

from tests.helpers.hf_templates import ZERO3_OPTIONS, hf_template
from zero_kernels.config import FP16Config, OptimizerConfig, ZeroConfig, ZeroOptions
from zero_kernels.config.offload import AioConfig, OffloadOptimizerConfig, OffloadParamConfig

FULL = {
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": False,
        "contiguous_gradients": False,
        "reduce_bucket_size": 2e8,
        "allgather_bucket_size": 3e8,
        "reduce_scatter": False,
        "stage3_prefetch_bucket_size": 4e7,
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 2e9,
        "stage3_max_reuse_distance": 3e9,
        "offload_optimizer": {"device": "none", "pin_memory": True},
        "offload_param": {"device": "NONE"},
        "cpu_offload": False,
    },
    "optimizer": {
        "type": "adam",
        "params": {"lr": 3e-4, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.05, "adam_w_mode": False},
    },
    "fp16": {
        "enabled": True,
        "loss_scale": "128",
        "initial_scale_power": "12",  # DeepSpeed's config model reads these strings as their integers
        "loss_scale_window": 500,
        "hysteresis": " 3 ",
        "min_loss_scale": "2.0",
    },
    "bf16": {"enabled": False},
    "gradient_clipping": 1.0,
    "gradient_accumulation_steps": 4,
    "train_micro_batch_size_per_gpu": 2,
    "train_batch_size": 16,
    "communication_data_type": "FP32",
}


def test_full_config_sets_every_field() -> None:
    cfg = ZeroConfig.from_deepspeed(FULL, world_size=2)
    assert cfg.zero == ZeroOptions(
        stage=3,
        overlap_comm=False,
        contiguous_gradients=False,
        reduce_bucket_size=200_000_000,
        allgather_bucket_size=300_000_000,
        reduce_scatter=False,
        stage3_prefetch_bucket_size=40_000_000,
        stage3_param_persistence_threshold=10_000,
        stage3_max_live_parameters=2_000_000_000,
        stage3_max_reuse_distance=3_000_000_000,
        offload_optimizer=OffloadOptimizerConfig(pin_memory=True),
        offload_param="none",
    )
    assert type(cfg.zero.reduce_bucket_size) is int and type(cfg.zero.stage3_max_reuse_distance) is int
    assert cfg.optimizer == OptimizerConfig(
        type="Adam", lr=3e-4, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, adamw=False
    )
    assert cfg.fp16 == FP16Config(
        enabled=True, loss_scale=128.0, initial_scale_power=12, loss_scale_window=500, hysteresis=3, min_loss_scale=2
    )
    assert (cfg.bf16, cfg.gradient_clipping, cfg.communication_data_type) == (False, 1.0, torch.float32)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 2, 4)
    assert cfg.world_size == 2 and cfg.stage == 3


@pytest.mark.parametrize(
    "fp16", [{"enabled": True, "loss_scale": 128, "min_loss_scale": 0, "loss_scale_window": 0}, {"min_loss_scale": 0}]
)
def test_dynamic_scaling_keys_are_bounded_only_where_read(fp16: dict) -> None:
    """As DeepSpeed's config model: ``min_loss_scale`` and ``loss_scale_window`` must be >= 1 only with dynamic
    loss scaling (fp16 on, ``loss_scale`` 0); a static scale or fp16 off leaves them unread."""
    cfg = ZeroConfig.from_deepspeed({"train_micro_batch_size_per_gpu": 1, "fp16": fp16})
    assert cfg.fp16.min_loss_scale == 0


def test_defaults_are_deepspeeds() -> None:
    cfg = ZeroConfig.from_deepspeed({})
    assert dataclasses.asdict(cfg.zero) == {
        "stage": 0,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_bucket_size": 500_000_000,
        "allgather_bucket_size": 500_000_000,
        "reduce_scatter": True,
        "overlap_param_gather": False,  # ours (Megatron's name): off, as Megatron's
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_param_persistence_threshold": 100_000,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
        "stage3_gather_16bit_weights_on_model_save": False,
        "offload_optimizer": dataclasses.asdict(OffloadOptimizerConfig()),
        "offload_param": dataclasses.asdict(OffloadParamConfig()),
        "sub_group_size": 1_000_000_000,
        "aio": dataclasses.asdict(AioConfig()),
        "quantized_weights": False,
        "quantized_nontrainable_weights": False,
        "hpz_partition_size": 1,
        "quantized_gradients": False,
        "loco_param": None,
        "leaf_module": {  # DeepSpeed 0.19's default leaf classes
            "classes": (
                "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
            ),
            "names": (),
            "name_suffixes": (),
        },
    }
    assert dataclasses.asdict(cfg.fp16) == {
        "enabled": False,
        "loss_scale": 0.0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1.0,
        "consecutive_hysteresis": False,
    }
    assert cfg.optimizer is None and cfg.bf16 is False and cfg.gradient_clipping == 1.0  # DeepSpeed 0.19's default
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        None,
        None,
        1,
    )
    assert cfg.communication_data_type is None and cfg.world_size == 1
    assert ZeroOptions() == ZeroOptions.from_dict({}) == cfg.zero


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overlap_comm_default_depends_on_stage(stage: int) -> None:
    assert ZeroOptions.from_dict({"stage": stage}).overlap_comm is (stage == 3)
    assert ZeroOptions.from_dict({"stage": stage, "overlap_comm": stage != 3}).overlap_comm is (stage != 3)


@pytest.mark.parametrize(
    "type_, params, expected",
    [
        ("adamw", {}, ("AdamW", True, 0.0)),
        ("Adam", {}, ("Adam", True, 0.0)),
        ("ADAM", {"adam_w_mode": False}, ("Adam", False, 0.0)),
        ("AdamW", {"adam_w_mode": False}, ("AdamW", True, 0.0)),
        ("AdamW", {"torch_adam": True}, ("AdamW", True, 1e-2)),
        ("Adam", {"torch_adam": True}, ("Adam", True, 1e-2)),
        ("Adam", {"torch_adam": True, "adam_w_mode": False}, ("Adam", False, 0.0)),
    ],
)
def test_optimizer_type_and_decay_mode(type_: str, params: dict, expected: tuple) -> None:
    opt = ZeroConfig.from_deepspeed({"optimizer": {"type": type_, "params": params}}).optimizer
    assert (opt.type, opt.adamw, opt.weight_decay) == expected
    assert (opt.lr, opt.betas, opt.eps) == (1e-3, (0.9, 0.999), 1e-8)


def test_adamw_ignores_adam_w_mode_false_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        ZeroConfig.from_deepspeed({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})
    assert any("adam_w_mode=false has no effect with type AdamW" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("name, dtype", [("fp32", torch.float32), ("FP16", torch.float16), ("bf16", torch.bfloat16)])
def test_communication_data_type(name: str, dtype: torch.dtype) -> None:
    assert ZeroConfig.from_deepspeed({"communication_data_type": name}).communication_data_type == dtype
    assert ZeroConfig.from_deepspeed({"communication_data_type": None}).communication_data_type is None


def test_bf16_and_legacy_bfloat16_spelling() -> None:
    assert ZeroConfig.from_deepspeed({"bf16": {"enabled": True}}).bf16 is True
    assert ZeroConfig.from_deepspeed({"bfloat16": {"enabled": True}}).bf16 is True
    assert ZeroConfig.from_deepspeed({"bfloat16": {"enabled": "auto"}}, bf16=True).bf16 is True
    with pytest.raises(ValueError, match="bfloat16.enabled"):
        ZeroConfig.from_deepspeed({"bfloat16": {"enabled": True}, "fp16": {"enabled": True}})
    with pytest.raises(ValueError, match='both "bf16" and its legacy spelling "bfloat16"'):
        ZeroConfig.from_deepspeed({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})


def test_stage3_aliases_and_deepspeed_field_names() -> None:
    opts = ZeroOptions.from_dict(
        {"prefetch_bucket_size": 7, "param_persistence_threshold": 0, "max_live_parameters": 9}
    )
    assert (opts.stage3_prefetch_bucket_size, opts.stage3_param_persistence_threshold) == (7, 0)
    assert opts.stage3_max_live_parameters == 9
    with pytest.raises(
        ValueError,
        match="zero_optimization.stage3_prefetch_bucket_size is given twice, as 'prefetch_bucket_size' and as "
        "'stage3_prefetch_bucket_size': keep one",
    ):
        ZeroOptions.from_dict({"prefetch_bucket_size": 7, "stage3_prefetch_bucket_size": 7})
    with pytest.raises(ValueError, match="as 'stage3_gather_fp16_weights_on_model_save' and as 'gather_16bit_"):
        ZeroOptions.from_dict(
            {"stage3_gather_fp16_weights_on_model_save": True, "gather_16bit_weights_on_model_save": 1}
        )
    with pytest.raises(ValueError, match="aio.intra_op_parallelism is given twice, as 'thread_count' and as 'intra_op"):
        ZeroConfig.from_deepspeed({"aio": {"thread_count": 2, "intra_op_parallelism": 2}})


HF_ZERO3 = hf_template(
    {"stage": 3, **ZERO3_OPTIONS},
    fp16={"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    bf16={"enabled": "auto"},
    scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"}},
)


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "zero_kernels" and r.levelno == level)


def test_hf_auto_values_from_keywords(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        cfg = ZeroConfig.from_deepspeed(
            HF_ZERO3,
            world_size=4,
            lr=5e-5,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            bf16=True,
            gradient_clipping=1.0,
            train_micro_batch_size_per_gpu=8,
            gradient_accumulation_steps=2,
            hidden_size=1024,
            total_num_steps=100,
        )
    assert cfg.optimizer == OptimizerConfig(type="AdamW", lr=5e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    assert (cfg.bf16, cfg.fp16.enabled, cfg.gradient_clipping) == (True, False, 1.0)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (64, 8, 2)
    assert cfg.zero.reduce_bucket_size == 1024 * 1024
    assert cfg.zero.stage3_prefetch_bucket_size == int(0.9 * 1024 * 1024)
    assert cfg.zero.stage3_param_persistence_threshold == 10 * 1024
    assert cfg.scheduler.params["total_num_steps"] == 100 and cfg.scheduler.params["warmup_num_steps"] == 1
    chosen = _messages(caplog, logging.WARNING)
    for line in (
        "optimizer.params.lr=5e-05 (from keyword lr)",
        "optimizer.params.betas=(0.9, 0.95) (from keyword betas)",
        "optimizer.params.eps=1e-08 (Hugging Face Trainer default adam_epsilon)",
        "bf16.enabled=True (from keyword bf16)",
        "fp16.enabled=False (Hugging Face Trainer default fp16)",
        "zero_optimization.reduce_bucket_size=1048576 (from hidden_size=1024)",
        "train_batch_size=64 (derived for world_size=4)",
        "scheduler.params.total_num_steps=100 (from keyword total_num_steps)",
        "scheduler.params.warmup_num_steps=1 (Hugging Face Trainer default warmup_steps=0, at least 1)",
    ):
        assert line in chosen, f"{line!r} not logged; got: {chosen}"


def test_hf_warmup_mismatch_names_an_older_trainers_ratio() -> None:
    """TrainingArguments of transformers 4 (warmup_ratio, no get_warmup_steps): the error gives both arguments and
    the step count the Trainer derives from them."""
    args = types.SimpleNamespace(
        per_device_train_batch_size=4, gradient_accumulation_steps=1, learning_rate=1e-3, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, fp16=False, bf16=False,
        warmup_steps=0, warmup_ratio=0.25, max_steps=12,
    )  # fmt: skip
    config = {"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}
    shown = "training_args.warmup_steps=0, training_args.warmup_ratio=0.25 (3 warmup steps of 12);"
    with pytest.raises(ValueError, match=re.escape(f"warmup_num_steps=5 in the config disagrees with {shown}")):
        ZeroConfig.from_deepspeed(config, world_size=1, training_args=args)


def test_hf_training_args_with_the_read_attributes_only() -> None:
    """An object with the attributes the README lists as read (``get_warmup_steps()``, no ``warmup_steps`` or
    ``warmup_ratio``) fills the warmup from ``get_warmup_steps`` and names it where the config disagrees (reading
    the config raised AttributeError: no attribute 'warmup_steps')."""
    args = types.SimpleNamespace(
        per_device_train_batch_size=4, gradient_accumulation_steps=1, learning_rate=1e-3, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, fp16=False, bf16=False,
        max_steps=12, get_warmup_steps=lambda total: total // 4,
    )  # fmt: skip
    config = {"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}
    cfg = ZeroConfig.from_deepspeed(config, world_size=1, training_args=args)
    assert cfg.scheduler.params["warmup_num_steps"] == 3
    config["scheduler"]["params"]["warmup_num_steps"] = 5
    shown = "training_args.get_warmup_steps(12)=3;"
    with pytest.raises(ValueError, match=re.escape(f"warmup_num_steps=5 in the config disagrees with {shown}")):
        ZeroConfig.from_deepspeed(config, world_size=1, training_args=args)


def test_hf_auto_values_default_without_keywords(caplog: pytest.LogCaptureFixture) -> None:
    config = {**HF_ZERO3, "train_micro_batch_size_per_gpu": 4, "scheduler": {"type": "WarmupLR", "params": {}}}
    cfg = ZeroConfig.from_deepspeed(config, world_size=2)
    # The Hugging Face Trainer's defaults, not DeepSpeed's (lr 1e-3, no clipping).
    assert cfg.optimizer == OptimizerConfig(type="AdamW", lr=5e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    assert (cfg.bf16, cfg.fp16.enabled, cfg.gradient_clipping) == (False, False, 1.0)
    assert (cfg.zero.reduce_bucket_size, cfg.zero.stage3_prefetch_bucket_size) == (500_000_000, 50_000_000)
    assert cfg.zero.stage3_param_persistence_threshold == 100_000
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 4, 1)


def test_keyword_fills_missing_key_and_must_agree_with_explicit_one() -> None:
    assert ZeroConfig.from_deepspeed({}, gradient_clipping=0.5).gradient_clipping == 0.5
    assert ZeroConfig.from_deepspeed({"gradient_clipping": 0.5}, gradient_clipping=0.5).gradient_clipping == 0.5
    with pytest.raises(ValueError) as err:
        ZeroConfig.from_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, lr=0.2)
    assert "optimizer.params.lr=0.1" in str(err.value) and "keyword lr=0.2" in str(err.value)


def test_hidden_size_fills_only_auto_values() -> None:
    cfg = ZeroConfig.from_deepspeed({"zero_optimization": {"reduce_bucket_size": 123}}, hidden_size=16)
    assert (cfg.zero.reduce_bucket_size, cfg.zero.stage3_prefetch_bucket_size) == (123, 50_000_000)


@pytest.mark.parametrize(
    "config, kwargs, fragments",
    [
        ({}, {"lrr": 1e-3}, ("unknown keyword 'lrr'", "did you mean 'lr'", "hidden_size")),
        ({}, {"lr": 1e-3}, ("keyword lr=0.001 sets optimizer.params.lr", "no 'optimizer' section")),
        ({"optimizer": {"type": "Adam", "params": {"lr": "auto"}}}, {"lr": -1}, ("lr (from keyword lr)=-1", ">= 0")),
        ({}, {"bf16": 1}, ("bf16.enabled (from keyword bf16)=1", "true or false")),
        ({}, {"hidden_size": 0}, ("hidden_size=0", ">= 1")),
        ({}, {"world_size": 0}, ("world_size=0", ">= 1")),
        ({}, {"world_size": 1.5}, ("world_size=1.5", ">= 1")),
    ],
)
def test_bad_keywords(config: dict, kwargs: dict, fragments: tuple) -> None:
    with pytest.raises(ValueError) as err:
        ZeroConfig.from_deepspeed(config, **kwargs)
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} missing from: {err.value}"


def test_ignored_keys_are_accepted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    config = {
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "seq_parallel_communication_data_type": "bf16",  # Accelerate's and ALST's configs write it
        "log_level": "info",
        "disable_python_gc": True,
        "scheduler": {"type": "WarmupLR"},
        "zero_optimization": {
            "stage": 2,
            "round_robin_gradients": True,
            "sub_group_size": 1e9,
            "elastic_checkpoint": False,
            "load_from_fp32_weights": True,
            "ignore_unused_parameters": True,
            "allgather_partitions": True,
            "use_multi_rank_bucket_allreduce": True,
            "memory_efficient_linear": True,
            "stage3_gather_16bit_weights_on_model_save": True,
            "zero_hpz_partition_size": 1,
            "zero_quantized_weights": False,
            "zero_quantized_gradients": False,
            "mics_shard_size": -1,
        },
        "fp16": {"enabled": False, "auto_cast": False, "consecutive_hysteresis": False},
        "bf16": {"enabled": True, "immediate_grad_update": True},
    }
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        assert ZeroConfig.from_deepspeed(config).stage == 2
    info, warning = _messages(caplog, logging.INFO), _messages(caplog, logging.WARNING)
    info_keys = [
        "steps_per_print",
        "wall_clock_breakdown",
        "zero_allow_untested_optimizer",
        "seq_parallel_communication_data_type",
        "log_level",
        "disable_python_gc",
        "zero_optimization.round_robin_gradients",
        "zero_optimization.elastic_checkpoint",
        "zero_optimization.load_from_fp32_weights",
        "zero_optimization.ignore_unused_parameters",
        "zero_optimization.allgather_partitions",
        "zero_optimization.use_multi_rank_bucket_allreduce",
        "zero_optimization.memory_efficient_linear",
        "bf16.immediate_grad_update",
    ]
    warning_keys = [
        "zero_optimization.mics_shard_size",
        "fp16.auto_cast",
    ]
    for keys, text in ((info_keys, info), (warning_keys, warning)):
        listed = text.split(": ", 1)[1].split(", ")
        assert sorted(listed) == sorted(keys), text
    assert sum("without effect" in r.getMessage() for r in caplog.records) == 2


def test_torch_adamw_params_are_read_or_logged(caplog: pytest.LogCaptureFixture) -> None:
    """What DeepSpeed hands torch.optim.AdamW with torch_adam: amsgrad and maximize are read; foreach, fused
    (implementation choices) and fp32_optimizer_states true (the state is fp32) are listed at INFO without effect."""
    params = {"torch_adam": True, "amsgrad": True, "maximize": True, "foreach": None, "fused": True}
    config = {"optimizer": {"type": "AdamW", "params": {**params, "fp32_optimizer_states": True}}}
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        opt = ZeroConfig.from_deepspeed(config).optimizer
    assert (opt.amsgrad, opt.maximize) == (True, True)
    assert ZeroConfig.from_deepspeed({"optimizer": {"type": "Adam"}}).optimizer.amsgrad is False
    info = _messages(caplog, logging.INFO)
    listed = info.split("without effect in zero_kernels: ", 1)[1].split("\n")[0].split(", ")
    assert listed == [f"optimizer.params.{k}" for k in ("foreach", "fp32_optimizer_states", "fused")], info
    assert "without effect" not in _messages(caplog, logging.WARNING)


@pytest.mark.parametrize(
    "key, value, level",
    [
        ("torch_autocast", {"enabled": True}, logging.WARNING),
        ("torch_autocast", {"enabled": True, "dtype": "bfloat16"}, logging.WARNING),
        ("torch_autocast", {"enabled": False}, logging.INFO),
        ("torch_autocast", {}, logging.INFO),  # DeepSpeed's default: off
        ("torch_autocast", None, logging.INFO),
        ("fp32_allreduce", True, logging.WARNING),
        ("fp32_allreduce", False, logging.INFO),
    ],
)
def test_an_engine_key_is_warned_about_when_it_asks_for_what_is_not_done(
    caplog: pytest.LogCaptureFixture, key: str, value: object, level: int
) -> None:
    """Keys DeepSpeed's engine acts on: ``torch_autocast`` enabled runs the forward under torch.autocast,
    ``fp32_allreduce`` all-reduces 16-bit gradients in fp32 (``communication_data_type`` does that here); neither
    happens through them, so they are listed at WARNING. DeepSpeed's defaults (autocast off, gradients reduced in
    their dtype) ask for what happens here anyway and are listed at INFO (they were listed at WARNING whatever they
    said)."""
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        ZeroConfig.from_deepspeed({key: value})
    listed = {lv for lv in (logging.INFO, logging.WARNING) if "without effect" in _messages(caplog, lv)}
    assert listed == {level}, caplog.text
    assert key in _messages(caplog, level)


@pytest.mark.parametrize("config", [{"aio": None}, {"bf16": None}, {"bfloat16": None}, {"optimizer": None}])
def test_a_null_section_is_read_as_absent(config: dict) -> None:
    """DeepSpeed 0.19.8 reads "aio": null and "bf16": null as their defaults (its "bfloat16" and "optimizer" null
    fail there with a bare error: taken as absent here)."""
    assert ZeroConfig.from_deepspeed(config) == ZeroConfig.from_deepspeed({})


def test_offload_spellings_that_mean_none() -> None:
    assert ZeroOptions.from_dict({"cpu_offload": False, "cpu_offload_param": False}).offload_optimizer.device == "none"
    assert ZeroOptions.from_dict({"offload_optimizer": None}).offload_optimizer.device == "none"
    assert ZeroOptions.from_dict({"offload_param": "None"}).offload_param.device == "none"


def test_zero_options_round_trip_through_from_dict() -> None:
    options = ZeroConfig.from_deepspeed(FULL, world_size=2).zero
    assert ZeroOptions.from_dict(dataclasses.asdict(options)) == options


def _batch(world: int, batch, micro, accum) -> tuple:
    config = {
        k: v
        for k, v in (
            ("train_batch_size", batch),
            ("train_micro_batch_size_per_gpu", micro),
            ("gradient_accumulation_steps", accum),
        )
        if v is not None
    }
    cfg = ZeroConfig.from_deepspeed(config, world_size=world)
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


@pytest.mark.parametrize("world", [1, 2, 4])
def test_batch_sizes_derived_as_deepspeed_does(world: int) -> None:
    assert _batch(world, 8 * world, 2, 4) == (8 * world, 2, 4)
    assert _batch(world, 8 * world, 2, None) == (8 * world, 2, 4)
    assert _batch(world, 8 * world, None, 2) == (8 * world, 4, 2)
    assert _batch(world, None, 2, 4) == (8 * world, 2, 4)
    assert _batch(world, 8 * world, None, None) == (8 * world, 8, 1)
    assert _batch(world, None, 2, None) == (2 * world, 2, 1)
    assert _batch(world, None, None, 3) == (None, None, 3)
    assert _batch(world, None, None, None) == (None, None, 1)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_batch_sizes_must_agree_with_world_size(world: int) -> None:
    with pytest.raises(ValueError) as err:
        _batch(world, 10, 3, 1)
    assert "train_batch_size=10 must equal" in str(err.value)
    assert f"3 * 1 * {world} = {3 * world}" in str(err.value)
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu=0 \(derived\) is invalid"):
        _batch(world, 1, None, 2)


def test_a_derived_batch_size_below_one_names_the_sizes_given() -> None:
    """train_batch_size 8 with a micro-batch of 4 on 4 ranks: the error named only the derived accumulation (0)."""
    with pytest.raises(ValueError) as err:
        _batch(4, 8, 4, None)
    assert str(err.value).startswith("gradient_accumulation_steps=0 (derived) is invalid: batch sizes must be >= 1")
    assert "train_batch_size=8, train_micro_batch_size_per_gpu=4, world_size=4" in str(err.value)
    assert "train_batch_size must equal train_micro_batch_size_per_gpu * gradient_accumulation_steps" in str(err.value)


def test_world_size_defaults_to_one_without_process_group() -> None:
    assert not torch.distributed.is_initialized()
    assert ZeroConfig.from_deepspeed({"train_micro_batch_size_per_gpu": 3}).train_batch_size == 3


STAGE = "from 0 to 3"
BAD = [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4", STAGE),
    ({"zero_optimization": {"stage": -1}}, "zero_optimization.stage=-1", STAGE),
    ({"zero_optimization": {"stage": 2.5}}, "zero_optimization.stage=2.5", STAGE),
    ({"zero_optimization": {"stage": "two"}}, "zero_optimization.stage='two'", STAGE),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage=True", STAGE),
    ({"zero_optimization": {"stage": "auto"}}, 'zero_optimization.stage="auto"', STAGE),
    ({"zero_optimization": 2}, "zero_optimization=2", "a JSON object"),
    ({"zero_optimization": None}, "zero_optimization=None", "a JSON object"),
    ({"fp16": None}, "fp16=None", "a JSON object"),
    ({"zero_optimization": {"reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size=0", ">= 1"),
    ({"zero_optimization": {"reduce_bucket_size": -5e8}}, "zero_optimization.reduce_bucket_size=-5", ">= 1"),
    ({"zero_optimization": {"reduce_bucket_size": 2.5}}, "zero_optimization.reduce_bucket_size=2.5", "integer"),
    ({"zero_optimization": {"allgather_bucket_size": 0}}, "zero_optimization.allgather_bucket_size=0", ">= 1"),
    ({"zero_optimization": {"stage3_prefetch_bucket_size": -1}}, "stage3_prefetch_bucket_size=-1", ">= 0"),
    ({"zero_optimization": {"stage3_max_live_parameters": 1.5}}, "stage3_max_live_parameters=1.5", "integer"),
    ({"zero_optimization": {"overlap_comm": "yes"}}, "zero_optimization.overlap_comm='yes'", "true or false"),
    ({"zero_optimization": {"reduce_scatter": 1}}, "zero_optimization.reduce_scatter=1", "true or false"),
    (
        {"zero_optimization": {"reduce_bucket_sise": 1}},
        "'reduce_bucket_sise' in zero_optimization",
        "'reduce_bucket_size'",
    ),
    ({"zero_optimizaton": {}}, "'zero_optimizaton' at the top level", "did you mean 'zero_optimization'"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled", "at most one"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type='Lamb'", "'Adam', 'AdamW'"),
    ({"optimizer": {"params": {}}}, "optimizer.type is missing", "'Adam', 'AdamW'"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, "optimizer.params.betas=[0.9]", "pair"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}}}, "betas=[0.9, 1.0]", ">= 0 and < 1"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [-0.1, 0.9]}}}, "betas=[-0.1, 0.9]", ">= 0 and < 1"),
    ({"optimizer": {"type": "Adam", "params": {"betas": 0.9}}}, "optimizer.params.betas=0.9", "pair"),
    ({"optimizer": {"type": "Adam", "params": {"lr": -1e-3}}}, "optimizer.params.lr=-0.001", ">= 0"),
    ({"optimizer": {"type": "Adam", "params": {"eps": -1e-8}}}, "optimizer.params.eps=-1e-08", ">= 0"),
    ({"optimizer": {"type": "Adam", "params": {"weight_decay": -0.1}}}, "weight_decay=-0.1", ">= 0"),
    ({"optimizer": {"type": "Adam", "params": {"lr": "fast"}}}, "optimizer.params.lr='fast'", "finite number"),
    ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1}}}, "max_grad_norm=1", "gradient_clipping"),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": 1}}}, "params.amsgrad=1", "true or false"),
    ({"optimizer": {"type": "Adam", "params": {"foreach": "yes"}}}, "params.foreach='yes'", "true, false or null"),
    (
        {"optimizer": {"type": "Adam", "params": {"fp32_optimizer_states": False}}},
        "params.fp32_optimizer_states=False is not supported",
        "set it to true or leave it out",
    ),
    ({"optimizer": {"type": "Adam", "params": {"lrate": 1}}}, "'lrate' in optimizer.params", "'lr', 'betas'"),
    ({"optimizer": {"type": "Adam", "params": {"bettas": 1}}}, "'bettas' in optimizer.params", "mean 'betas'"),
    ({"zero_optimization": {"offload_param": {"device": "gpu"}}}, "offload_param.device='gpu'", "'cpu', 'nvme'"),
    ({"zero_optimization": {"offload_param": 3}}, "zero_optimization.offload_param=3", '{"device": "cpu"}'),
    ({"fp16": {"loss_scale": -1}}, "fp16.loss_scale=-1", ">= 0"),
    ({"fp16": {"hysteresis": 0}}, "fp16.hysteresis=0", ">= 1"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale=0", ">= 1 with dynamic loss scaling"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window=0", ">= 1 with dynamic"),
    ({"fp16": {"min_loss_scale": 0.5}}, "fp16.min_loss_scale=0.5", "an integer, or a string holding one"),
    ({"fp16": {"min_loss_scale": "2.5"}}, "fp16.min_loss_scale='2.5'", "an integer, or a string holding one"),
    ({"fp16": {"initial_scale_power": "x"}}, "fp16.initial_scale_power='x'", "an integer from 0 to 1023, or a"),
    # 2**1024 is no float: the loss scaler failed later with a bare OverflowError naming no key
    ({"fp16": {"enabled": True, "initial_scale_power": 1024}}, "fp16.initial_scale_power=1024", "from 0 to 1023"),
    ({"fp16": {"loss_scale": "abc"}}, "fp16.loss_scale='abc'", "a finite number >= 0, or a string holding one"),
    ({"fp16": {"loss_scale": "inf"}}, "fp16.loss_scale='inf'", "a finite number >= 0"),
    ({"fp16": {"loss_scale": True}}, "fp16.loss_scale=True", "a finite number >= 0"),
    ({"fp16": {"enabled": "true"}}, "fp16.enabled='true'", "true or false"),
    ({"gradient_clipping": -1.0}, "gradient_clipping=-1.0", ">= 0"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0", ">= 1"),
    ({"train_batch_size": 2.5}, "train_batch_size=2.5", "integer"),
    ({"communication_data_type": "fp8"}, "communication_data_type='fp8'", "'fp32', 'fp16', 'bf16', null"),
    # an empty list, 0, "" or false for the params object: DeepSpeed fails building the schedule (** of a non-mapping)
    ({"scheduler": {"type": "WarmupLR", "params": []}}, "scheduler.params=[]", "a JSON object"),
    ({"scheduler": {"type": "WarmupLR", "params": 0}}, "scheduler.params=0", "a JSON object"),
    ({"scheduler": {"type": "StepLR", "params": False}}, "scheduler.params=False", "a JSON object"),
    # a deprecated offload key true beside the block that replaced it (it read as device cpu over "none")
    *(
        ({"zero_optimization": {"stage": 3, old: True, new: block}}, f"zero_optimization.{old}=true", f"only {new}")
        for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param"))
        for block in ({"device": "none"}, "none", {"device": "cpu"}, {"device": "nvme", "nvme_path": "/x"})
    ),
]


@pytest.mark.parametrize("config, where, allowed", BAD, ids=[w for _, w, _ in BAD])
def test_bad_values_name_key_value_and_allowed(config: dict, where: str, allowed: str) -> None:
    with pytest.raises(ValueError) as err:
        ZeroConfig.from_deepspeed(config)
    assert where in str(err.value) and allowed in str(err.value), str(err.value)


def test_zero_integers_written_as_strings_are_read_as_deepspeed_reads_them() -> None:
    # DeepSpeed's zero_optimization model takes "1000", " 1000", "+1000" and "1000.0" for its integers
    counts = {
        "reduce_bucket_size": "1000",
        "allgather_bucket_size": " 2000 ",
        "stage3_prefetch_bucket_size": "+0",
        "stage3_param_persistence_threshold": "100.0",
        "stage3_max_live_parameters": "7",
        "stage3_max_reuse_distance": "8",
        "sub_group_size": "9",
    }
    zero = ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3, **counts, "zero_hpz_partition_size": "1"}}).zero
    assert {k: getattr(zero, k) for k in counts} == {k: int(float(v)) for k, v in counts.items()}
    assert zero.hpz_partition_size == 1 and type(zero.reduce_bucket_size) is int
    for bad in ("5e8", "0.5", "-1"):  # refused by DeepSpeed too
        with pytest.raises(ValueError, match=f"reduce_bucket_size='{bad}' is invalid: expected an integer >= 1, or a"):
            ZeroConfig.from_deepspeed({"zero_optimization": {"reduce_bucket_size": bad}})


def test_zero_options_from_dict_uses_the_given_path() -> None:
    expected = r"^ShardedFusedAdam\.stage=9 is invalid: expected an integer from 0 to 3, or a string holding one"
    with pytest.raises(ValueError, match=expected):
        ZeroOptions.from_dict({"stage": 9}, path="ShardedFusedAdam")
    with pytest.raises(ValueError, match=r"^unknown key 'bucket' at the top level"):
        ZeroOptions.from_dict({"bucket": 9}, path="")
    assert ZeroOptions.from_dict({"stage": 2, "reduce_bucket_size": 1000}, path="").reduce_bucket_size == 1000


def test_objects_are_frozen_and_hold_tuples() -> None:
    cfg = ZeroConfig.from_deepspeed({"optimizer": {"type": "AdamW", "params": {"betas": [0.5, 0.6]}}})
    assert cfg.optimizer.betas == (0.5, 0.6) and isinstance(cfg.optimizer.betas, tuple)
    for obj, name in ((cfg, "bf16"), (cfg.zero, "stage"), (cfg.optimizer, "lr"), (cfg.fp16, "enabled")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, 1)


@pytest.mark.parametrize(
    "build, fragment",
    [
        (lambda: ZeroOptions(stage=5), "ZeroOptions.stage=5"),
        (lambda: ZeroOptions(offload_optimizer="cpu", stage=0), "offload_optimizer.device='cpu' needs stage 1"),
        (lambda: OptimizerConfig(type="AdamW", adamw=False), "contradicts type='AdamW'"),
        (lambda: OptimizerConfig(type="SGD"), "OptimizerConfig.type='SGD'"),
        (lambda: FP16Config(hysteresis=0), "FP16Config.hysteresis=0"),
        (lambda: ZeroConfig(bf16=True, fp16=FP16Config(enabled=True)), "fp16.enabled and bf16.enabled"),
        (lambda: ZeroConfig(train_batch_size=3, train_micro_batch_size_per_gpu=2), "train_batch_size=3 must equal"),
        (lambda: ZeroConfig(zero={"stage": 1}), "ZeroConfig.zero="),
        (lambda: ZeroConfig(gradient_clipping=-1.0), "ZeroConfig.gradient_clipping=-1.0"),
        (lambda: ZeroConfig(gradient_accumulation_steps=0), "ZeroConfig.gradient_accumulation_steps=0"),
    ],
)
def test_direct_construction_is_validated_too(build, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        build()
    assert fragment in str(err.value), str(err.value)


def test_direct_construction_defaults() -> None:
    assert OptimizerConfig(type="AdamW").weight_decay == 1e-2
    assert OptimizerConfig(type="Adam", adamw=False).weight_decay == 0.0
    assert ZeroOptions(stage=3).overlap_comm is True


def test_file_sources(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(FULL))
    assert ZeroConfig.from_deepspeed(path, world_size=2) == ZeroConfig.from_deepspeed(str(path), world_size=2)
    assert ZeroConfig.from_deepspeed(path, world_size=2) == ZeroConfig.from_deepspeed(FULL, world_size=2)


def test_file_errors(tmp_path: pathlib.Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text('{\n  "zero_optimization": {\n    "stage": 2,\n  }\n')  # the last brace missing
    with pytest.raises(ValueError, match=r"broken\.json' is not valid JSON.*at line 4, column 3"):
        ZeroConfig.from_deepspeed(broken)
    with pytest.raises(ValueError, match=r"missing\.json' does not exist"):
        ZeroConfig.from_deepspeed(tmp_path / "missing.json")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a list, expected a JSON object"):
        ZeroConfig.from_deepspeed(listed)
    twice = tmp_path / "twice.json"
    twice.write_text('{"zero_optimization": {"stage": 1, "stage": 2}}')
    with pytest.raises(ValueError, match="duplicate key 'stage'"):
        ZeroConfig.from_deepspeed(twice)
    with pytest.raises(ValueError, match="a file path or a mapping, not int"):
        ZeroConfig.from_deepspeed(3)


@pytest.mark.parametrize("flag, stage", [(True, 1), (False, 0)])
def test_the_deprecated_boolean_form_reads_as_deepspeed_reads_it(flag: bool, stage: int, caplog) -> None:
    """``"zero_optimization": true`` (DeepSpeed's first form): stage 1, false: stage 0, with one warning."""
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        cfg = ZeroConfig.from_deepspeed({"train_micro_batch_size_per_gpu": 1, "zero_optimization": flag})
    assert cfg.zero.stage == stage
    assert f'write "zero_optimization": {{"stage": {stage}}}' in caplog.text
