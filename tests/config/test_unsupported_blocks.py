"""Blocks training tools hand DeepSpeed that zero_kernels cannot honour, and the keys DeepSpeed 0.19 removed (it
refuses them): refused with what they would change, accepted (logged) when turned off, and a misspelling of one
still gets a "did you mean"."""

from __future__ import annotations

import logging

import pytest

from zero_kernels.config import ZeroConfig

ALST = {"enabled": True, "size": 4, "mode": "ulysses", "ulysses": {"degree": 4, "seq_length_is_variable": True}}


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("sequence_parallel", ALST, "splits every sample's sequence over several ranks"),
        ("sequence_parallel", {"size": 4}, 'remove the block or write "enabled": false'),
        ("sequence_parallel_size", 2, "DeepSpeed divides the world size by it"),
        ("fp8", {"enabled": True, "loss_scale_window": 1000}, "runs the matrix multiplications in fp8"),
        ("tensor_parallel", {"autotp_size": 2}, "splits the model's linear layers over autotp_size ranks"),
        ("tensor_parallel", {"tp": {"tp_size": 4}}, "remove the block or write autotp_size 1"),
        ("tensor_parallel", True, "divides the world size by it"),
        ("amp", {"enabled": True, "opt_level": "O1"}, "DeepSpeed 0.19 removed NVIDIA Apex AMP mixed precision"),
        ("amp", {"opt_level": "O1"}, "use fp16 or bf16"),
        ("sparse_gradients", True, "DeepSpeed 0.19 removed the sparse reduction of dense nn.Embedding gradients"),
        ("elasticity", {"enabled": True, "max_train_batch_size": 64}, "DeepSpeed 0.19 removed elastic training"),
        ("nebula", {"enabled": True}, 'remove it, or write false, {} or "enabled": false'),
        ("compression_training", {"weight_quantization": {}}, "removed the compression library"),
        ("quantize_training", {"enabled": True}, "removed Mixture-of-Quantization training"),
        ("eigenvalue", {"enabled": True}, "removed eigenvalue-based Mixture-of-Quantization"),
        ("sparse_attention", {"mode": "fixed"}, "removed Sparse Attention"),
        ("graph_harvesting", True, "removed graph harvesting"),
        ("curriculum_learning", {"enabled": True}, "data_efficiency.data_sampling.curriculum_learning"),
        ("progressive_layer_drop", {"enabled": True}, "removed Progressive Layer Dropping"),
        ("gradient_allreduce_op", "sum", "adds the data-parallel ranks' gradients instead of averaging them"),
        ("gradient_allreduce_op", "max", 'remove it or write "mean"'),
        ("managed_gradient_accumulation", False, "every step() call apply an update"),
    ],
)
def test_refused_with_what_they_would_change(key: str, value: object, says: str) -> None:
    with pytest.raises(ValueError) as err:
        ZeroConfig.from_deepspeed({key: value, "bf16": {"enabled": True}})
    assert str(err.value).startswith(f"{key}={value!r} is not supported by zero_kernels: ")
    assert says in str(err.value)


def test_turned_off_they_are_accepted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    config = {
        "sequence_parallel": {"enabled": False, "size": 4},
        "sequence_parallel_size": 1,
        "fp8": None,
        "tensor_parallel": {"autotp_size": 1},
        "amp": {"enabled": False, "opt_level": "O1"},
        "sparse_gradients": False,
        "elasticity": {"enabled": False},
        "sparse_attention": {},
        "nebula": None,
    }
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        assert ZeroConfig.from_deepspeed(config).stage == 0
    assert any(
        "without effect in zero_kernels: amp, elasticity, fp8, nebula, sequence_parallel, sequence_parallel_size, "
        "sparse_attention, sparse_gradients, tensor_parallel" in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.parametrize("value", ["mean", "MEAN", None])
def test_deepspeeds_default_gradient_allreduce_op_is_taken(value: object) -> None:
    """DeepSpeed's ``TestGradientAllreduceOp`` configs: ``"gradient_allreduce_op": "mean"`` (its default, read
    case-insensitively) averages as zero_kernels does; it was an unknown key ("did you mean
    'gradient_predivide_factor'")."""
    assert ZeroConfig.from_deepspeed({"gradient_allreduce_op": value, "zero_optimization": {"stage": 2}}).stage == 2


def test_deepspeeds_default_managed_gradient_accumulation_is_taken() -> None:
    """DeepSpeed's ``TestUnmanagedGradientAccumulation`` baseline: ``"managed_gradient_accumulation": true`` (its
    default) counts micro-steps as zero_kernels does; it was an unknown key."""
    cfg = {"managed_gradient_accumulation": True, "gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 1}
    assert ZeroConfig.from_deepspeed(cfg).gradient_accumulation_steps == 4


def test_a_misspelt_one_is_an_unknown_key_with_a_hint() -> None:
    with pytest.raises(ValueError, match="unknown key 'sequence_paralel' at the top level of the config; did you mean "
                       "'sequence_parallel'"):  # fmt: skip
        ZeroConfig.from_deepspeed({"sequence_paralel": ALST})


def test_a_top_level_comment_key_is_accepted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    """LLaMA-Factory's templates carry ``"_comment"``; DeepSpeed ignores unknown top-level keys. Inside a
    section, where DeepSpeed refuses unknown keys, it is refused too."""
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        assert ZeroConfig.from_deepspeed({"_comment": "tp 2", "zero_optimization": {"stage": 2}}).stage == 2
    assert any("_comment" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="unknown key '_comment' in zero_optimization"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2, "_comment": "x"}})
