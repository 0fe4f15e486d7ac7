"""Blocks copied from templates that DeepSpeed accepts and that change only its logging and monitoring, and the fp16
block's loss-scaling keys copied into a bf16 block: accepted with their values checked as DeepSpeed types them,
listed once among the keys without effect (WARNING where they turn something on), a static bf16 scale refused."""

from __future__ import annotations

import logging

import pytest

from zero_kernels.config import ZeroConfig

# LLaMA-Factory's examples/deepspeed/ds_z3_alst_config.json, its sequence parallelism turned off (refused when on:
# test_unsupported_blocks.py).
ALST = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}},
    "sequence_parallel": {"enabled": False, "size": 4, "mode": "ulysses"},
    "bf16": {"enabled": True, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16,
             "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
    "comms_logger": {"enabled": False},
    "comms_config": {"verbose": False},
    "monitor_config": {"enabled": True, "tag": "DeepSpeedMonitor", "csv_monitor": {"enabled": False}},
}  # fmt: skip
LOSS_SCALING = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                "min_loss_scale": 1, "consecutive_hysteresis": False, "auto_cast": False}  # fmt: skip


def _without_effect(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    """The keys of the one record at ``level`` listing keys without effect (none: [])."""
    found = [r.getMessage() for r in caplog.records if r.levelno == level and "without effect" in r.getMessage()]
    assert len(found) <= 1, found
    return sorted(found[0].split(": ", 1)[1].split(", ")) if found else []


def test_the_alst_template_loads_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        cfg = ZeroConfig.from_deepspeed(ALST)
    assert cfg.bf16 and cfg.zero.stage == 3 and cfg.zero.offload_optimizer.device == "cpu"
    scaling = [f"bf16.{key}" for key in LOSS_SCALING if key != "consecutive_hysteresis"]
    assert _without_effect(caplog, logging.WARNING) == sorted(scaling + ["monitor_config"])
    quiet = ["comms_config", "comms_logger", "sequence_parallel", "steps_per_print", "wall_clock_breakdown"]
    quiet += ["zero_optimization.contiguous_gradients", "zero_optimization.overlap_comm"]  # what stage 3 does anyway
    assert _without_effect(caplog, logging.INFO) == quiet


@pytest.mark.parametrize("value, level", [(False, logging.WARNING), (True, logging.INFO)])
def test_load_from_fp32_weights_false_is_a_warning(value: bool, level: int, caplog: pytest.LogCaptureFixture) -> None:
    """With false DeepSpeed rebuilds the fp32 masters from the 16-bit weights at a checkpoint load; loads here take the
    checkpoint's masters, so false is listed at WARNING, true (what is done anyway) at INFO."""
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2, "load_from_fp32_weights": value}})
    assert _without_effect(caplog, level) == ["zero_optimization.load_from_fp32_weights"]


@pytest.mark.parametrize(
    "key, value",
    [
        ("comms_logger", {"enabled": True, "verbose": False, "prof_all": True, "debug": False}),
        ("comms_logger", {"enabled": True, "prof_all": False, "prof_ops": ["all_reduce", "all_gather"]}),
        ("tensorboard", {"enabled": True, "output_path": "runs/", "job_name": "sft"}),
        ("wandb", {"enabled": True, "group": None, "team": "lab", "project": "sft"}),
        ("csv_monitor", {"enabled": True, "output_path": "logs/", "job_name": "sft"}),
        ("comet", {"enabled": True, "samples_log_interval": 50, "project": "sft", "online": False, "mode": "get"}),
        ("monitor_config", {"enabled": True, "tag": "DeepSpeedMonitor"}),
    ],
)
def test_a_logging_block_is_accepted_with_a_warning_when_on(
    key: str, value: dict, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        ZeroConfig.from_deepspeed({key: value})
    assert _without_effect(caplog, logging.WARNING) == [key]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        ZeroConfig.from_deepspeed({key: {**value, "enabled": False}})
    assert _without_effect(caplog, logging.WARNING) == [] and _without_effect(caplog, logging.INFO) == [key]


@pytest.mark.parametrize("block", ["bf16", "bfloat16"])
def test_loss_scaling_keys_in_a_bf16_block_are_accepted_with_a_warning(
    block: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        assert ZeroConfig.from_deepspeed({block: {"enabled": True, **LOSS_SCALING}}).bf16
    assert _without_effect(caplog, logging.WARNING) == sorted(f"{block}.{key}" for key in LOSS_SCALING)


@pytest.mark.parametrize("value, level", [(False, logging.WARNING), (True, logging.INFO)])
def test_bf16_check_grad_overflow_false_is_a_warning(value: bool, level: int, caplog: pytest.LogCaptureFixture) -> None:
    """DeepSpeed applies inf/NaN gradients with false; zero_kernels still skips such steps (skip_nonfinite_steps),
    so false, which asks for something not done, is listed at WARNING; true, what is done anyway, at INFO."""
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        assert ZeroConfig.from_deepspeed({"bf16": {"enabled": True, "check_grad_overflow": value}}).bf16
    assert _without_effect(caplog, level) == ["bf16.check_grad_overflow"]


@pytest.mark.parametrize(
    "config, fragments",
    [
        ({"bf16": {"enabled": True, "loss_scale": 128}},
         ["bf16.loss_scale=128 is invalid: expected 0 (dynamic: bf16 training has no loss scaling",
          "0.17 onwards refuses it): remove it or write 0"]),
        ({"bf16": {"loss_scale": -1}}, ["bf16.loss_scale=-1 is invalid: expected 0"]),
        ({"bf16": {"enabled": True, "hysteresis": 0}}, ["bf16.hysteresis=0 is invalid: expected an integer >= 1"]),
        ({"bfloat16": {"min_loss_scale": 0.5}}, ["bfloat16.min_loss_scale=0.5 is invalid: expected an integer"]),
        ({"bf16": {"enabled": True, "check_grad_overflow": 0}},
         ["bf16.check_grad_overflow=0 is invalid: expected true or false"]),
        ({"bf16": {"enabled": True, "check_overflow": True}},
         ["unknown key 'check_overflow' in bf16; did you mean 'check_grad_overflow'"]),
        ({"bf16": {"enabled": True, "zzz": 1}},
         ["unknown key 'zzz' in bf16; expected one of 'enabled', 'immediate_grad_update', "
          "'bf16_master_weights_and_grads', 'bf16_optimizer_states', 'loss_scale', 'initial_scale_power', "
          "'loss_scale_window', 'hysteresis', 'min_loss_scale', 'consecutive_hysteresis', 'auto_cast', "
          "'check_grad_overflow'"]),
        ({"bf16": {"auto_cast": "no"}}, ["bf16.auto_cast='no' is invalid: expected true or false"]),
        ({"comms_logger": {"enabled": True, "verbose": "no"}},
         ["comms_logger.verbose='no' is invalid: expected true or false"]),
        ({"comms_logger": {"prof_ops": "all_reduce"}},
         ["comms_logger.prof_ops='all_reduce' is invalid: expected a list of strings"]),
        ({"tensorboard": {"enabled": True, "output_path": 3}},
         ["tensorboard.output_path=3 is invalid: expected a string"]),
        ({"comet": {"samples_log_interval": 1.5}}, ["comet.samples_log_interval=1.5 is invalid: expected an integer"]),
        ({"wandb": {"entity": "lab"}},
         ["unknown key 'entity' in wandb; expected one of 'enabled', 'group', 'team', 'project'"]),
        ({"csv_monitor": True}, ["csv_monitor=True is invalid: expected a JSON object"]),
    ],
)  # fmt: skip
def test_a_bad_value_names_the_key_and_what_is_allowed(config: dict, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        ZeroConfig.from_deepspeed(config)
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} missing from: {err.value}"
