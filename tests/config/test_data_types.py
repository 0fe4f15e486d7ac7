"""The ``data_types`` block: ``grad_accum_dtype`` read and checked (DeepSpeed's spellings), the rest logged."""

from __future__ import annotations

import logging

import pytest
import torch

from zero_kernels.config import ZeroConfig


def _accum(data_types: object, **keywords: object) -> object:
    return ZeroConfig.from_deepspeed({"data_types": data_types}, **keywords).grad_accum_dtype


@pytest.mark.parametrize(
    "value, dtype",
    [
        ("fp32", torch.float32),
        ("FP32", torch.float32),
        ("float32", torch.float32),
        ("float", torch.float32),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("torch.bfloat16", torch.bfloat16),
        ("fp16", torch.float16),
        ("half", torch.float16),
        (None, None),
    ],
)
def test_grad_accum_dtype_forms(value: object, dtype: object) -> None:
    assert _accum({"grad_accum_dtype": value}) == dtype


def test_absent_means_the_gradients_dtype() -> None:
    assert ZeroConfig.from_deepspeed({}).grad_accum_dtype is None
    assert _accum({}) is None


def test_keyword_fills_a_missing_key_and_must_agree_with_a_written_one() -> None:
    assert ZeroConfig.from_deepspeed({}, grad_accum_dtype="fp32").grad_accum_dtype == torch.float32
    assert _accum({"grad_accum_dtype": "fp32"}, grad_accum_dtype="fp32") == torch.float32
    with pytest.raises(ValueError, match="data_types.grad_accum_dtype='bf16' in the config disagrees with keyword"):
        _accum({"grad_accum_dtype": "bf16"}, grad_accum_dtype="fp32")


@pytest.mark.parametrize(
    "data_types, message",
    [
        (
            {"grad_accum_dtype": "int8"},
            "data_types.grad_accum_dtype='int8' is invalid: expected one of 'fp32', 'fp16', ",
        ),
        ({"grad_accum_dtype": 32}, "data_types.grad_accum_dtype=32 is invalid: expected one of 'fp32'"),
        ({"grad_accum_dtype": "auto"}, 'data_types.grad_accum_dtype="auto" is not allowed here'),
        ({"grad_acum_dtype": "fp32"}, "unknown key 'grad_acum_dtype' in data_types; did you mean 'grad_accum_dtype'"),
        ("fp32", "data_types='fp32' is invalid: expected a JSON object"),
    ],
)
def test_errors_name_the_key_and_the_allowed_values(data_types: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        _accum(data_types)


def test_the_other_data_types_are_logged_as_without_effect(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        dtype = _accum({"grad_accum_dtype": "fp32", "param_dtype": "bf16", "buffer_dtype": "fp32"})
    assert dtype == torch.float32
    ignored = [r.getMessage() for r in caplog.records if "without effect" in r.getMessage()]
    assert ignored == ["DeepSpeed config keys accepted but without effect in zero_kernels: "
                       "data_types.buffer_dtype, data_types.param_dtype"]  # fmt: skip


def test_zero_config_checks_the_dtype() -> None:
    assert ZeroConfig(grad_accum_dtype=torch.float32).grad_accum_dtype == torch.float32
    with pytest.raises(ValueError, match="ZeroConfig.grad_accum_dtype=torch.int8: expected"):
        ZeroConfig(grad_accum_dtype=torch.int8)
