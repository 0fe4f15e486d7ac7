"""ZeRO++ keys: carried with DeepSpeed's meaning, checked per stage, named in every error."""

from __future__ import annotations

import copy
import dataclasses
import logging
import pickle

import pytest

from zero_kernels.config import ZeroConfig, ZeroOptions, zero_config
from zero_kernels.config.schema import LocoParam

ZEROPP = {
    "stage": 3,
    "zero_quantized_weights": True,
    "zero_hpz_partition_size": 2,
    "zero_quantized_gradients": True,
    "zeropp_loco_param": {"err_beta": 0.5, "reset_T": 64},
}


def test_keys_are_carried_not_ignored(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        cfg = ZeroConfig.from_deepspeed({"zero_optimization": ZEROPP}, world_size=4)
    z = cfg.zero
    assert (z.quantized_weights, z.hpz_partition_size, z.quantized_gradients) == (True, 2, True)
    assert z.loco_param == LocoParam(err_beta=0.5, reset_T=64)
    assert z.quantized_nontrainable_weights is False
    assert not any("without effect" in r.getMessage() for r in caplog.records)


def test_defaults_are_deepspeeds() -> None:
    z = ZeroOptions.from_dict({"stage": 3})
    assert (z.quantized_weights, z.quantized_nontrainable_weights, z.hpz_partition_size) == (False, False, 1)
    assert (z.quantized_gradients, z.loco_param) == (False, None)
    assert ZeroOptions.from_dict(
        {"stage": 3, "zero_quantized_gradients": True, "zeropp_loco_param": {}}
    ).loco_param == (LocoParam())


def test_keyword_spellings_and_round_trip() -> None:
    by_field = ZeroOptions.from_dict({"stage": 3, "quantized_weights": True, "hpz_partition_size": 2})
    by_key = ZeroOptions.from_dict({"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2})
    assert by_field == by_key
    options = ZeroOptions.from_dict(ZEROPP)
    assert ZeroOptions.from_dict(dataclasses.asdict(options)) == options


def test_off_values_are_accepted_at_every_stage() -> None:
    for stage in range(4):
        off = {"zero_quantized_weights": False, "zero_hpz_partition_size": 1, "zero_quantized_gradients": False}
        ZeroOptions.from_dict({"stage": stage, **off, "zero_hpz_partition_size": 0, "zeropp_loco_param": None})
    assert ZeroOptions.from_dict({"stage": 1, "zero_quantized_weights": True}).quantized_weights
    assert ZeroOptions.from_dict({"stage": 2, "zero_quantized_gradients": True}).quantized_gradients


def test_loco_param_is_deepspeeds_dict_read_only() -> None:
    loco = ZeroOptions.from_dict(ZEROPP).loco_param
    assert loco == {"err_beta": 0.5, "reset_T": 64} and isinstance(loco, dict)
    assert (loco.err_beta, loco.reset_T) == (0.5, 64)
    with pytest.raises(TypeError, match="read-only"):
        loco["err_beta"] = 0.1
    hash(ZeroOptions.from_dict(ZEROPP))
    assert copy.deepcopy(loco) == pickle.loads(pickle.dumps(loco)) == loco
    assert type(pickle.loads(pickle.dumps(loco))) is LocoParam


@pytest.mark.parametrize(
    "zero, fragments",
    [
        ({"stage": 0, "zero_quantized_weights": True}, ("zero_optimization.zero_quantized_weights", "stages 1-3")),
        ({"stage": 2, "zero_hpz_partition_size": 2}, ("zero_optimization.zero_hpz_partition_size=2", "stage 3 only")),
        ({"stage": 1, "zero_quantized_gradients": True}, ("zero_quantized_gradients", "stages 2-3", "stage is 1")),
        ({"stage": 3, "zeropp_loco_param": {"err_beta": 0.8}}, ("zeropp_loco_param", "zero_quantized_gradients")),
        ({"stage": 3, "zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 1.5}}, ("err_beta=1.5",)),
        (
            {"stage": 3, "zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 1.0}},
            ("zero_optimization.zeropp_loco_param.err_beta=1.0", "< 1"),
        ),
        ({"stage": 3, "zero_quantized_gradients": True, "zeropp_loco_param": {"reset": 3}}, ("unknown key 'reset'",)),
        ({"stage": 3, "zero_quantized_gradients": True, "zeropp_loco_param": 3}, ("zeropp_loco_param=3",)),
        ({"stage": 3, "zero_hpz_partition_size": -1}, ("zero_hpz_partition_size=-1", ">= 0")),
        ({"stage": 3, "zero_quantized_weights": 1}, ("zero_quantized_weights=1", "true or false")),
        ({"stage": 2, "zero_quantized_nontrainable_weights": True}, ("zero_quantized_nontrainable_weights", "stage 3")),
        ({"stage": 0, "zero_quantized_nontrainable_weights": True}, ("zero_quantized_nontrainable_weights", "stage 3")),
        ({"stage": 3, "zero_quantized_nontrainable_weights": 1}, ("zero_quantized_nontrainable_weights=1",)),
    ],
)
def test_bad_values_name_the_key(zero: dict, fragments: tuple) -> None:
    with pytest.raises(ValueError) as err:
        ZeroConfig.from_deepspeed({"zero_optimization": zero}, world_size=4)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_hpz_must_divide_the_world_size() -> None:
    with pytest.raises(ValueError, match=r"zero_hpz_partition_size=3 must divide the world size 4"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}, world_size=4)
    assert ZeroConfig.from_deepspeed({"zero_optimization": ZEROPP}, world_size=2).zero.hpz_partition_size == 2


def test_quantized_nontrainable_weights_is_carried_at_stage_3() -> None:
    cfg = ZeroConfig.from_deepspeed(
        {"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}}, world_size=2
    )
    assert cfg.zero.quantized_nontrainable_weights is True


@pytest.mark.parametrize(
    "stage, keys, effect",
    [
        (1, ("zero_quantized_weights",), "the int8 all-gather's"),
        (2, ("zero_quantized_weights",), "the int8 all-gather's"),
        (2, ("zero_quantized_gradients",), "the gradients are reduced in int4 blocks"),
    ],
)
def test_below_stage_3_a_config_is_warned_that_deepspeed_ignores_the_key(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, stage: int, keys: tuple, effect: str
) -> None:
    """DeepSpeed 0.19 builds its stage 1-2 optimizer without the ZeRO++ switches: the same JSON would train unquantized
    there, so a DeepSpeed config that turns them on below stage 3 is warned once per process (and still honoured);
    stage 3 is not warned, nor are ``ShardedFusedAdam``'s keyword arguments (``ZeroOptions.from_dict``), which are no
    DeepSpeed config."""
    monkeypatch.setattr(zero_config, "_ZEROPP_WARNED", set())
    zero = {"stage": stage, **dict.fromkeys(keys, True)}
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        options = ZeroOptions.from_dict(zero)
        assert not caplog.records, "keyword use"
        for _ in range(2):
            config = ZeroConfig.from_deepspeed({"zero_optimization": zero})
        ZeroConfig.from_deepspeed({"zero_optimization": {**zero, "stage": 3}})
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert f"{keys[0]}=true at stage {stage}: zero_kernels quantizes" in warned[0]
    assert "DeepSpeed 0.19 ignores it below stage 3" in warned[0]
    assert effect in warned[0]
    assert options == config.zero and (options.quantized_weights or options.quantized_gradients)
