"""``ZeroTrainer`` at stage 3 under a trainer whose loss reads the LM head's weight in the model's forward without
calling the head (TRL's trainers' fused LM-head loss; the Trainer's ``use_liger_kernel``): the head's parameters are
gathered for the model's forward, and training matches the plain Trainer with ``torch.optim.AdamW``.

The fused loss here does what TRL's does (``trl.trainer.utils``: the model's forward patched to run the backbone,
then a chunked log-sum-exp over ``lm_head.weight``, the vocabulary size read from the weight's shape): on a freed
stage-3 parameter (empty) it loops over no chunk and returns -inf without an error, and nothing trained (the
adapters of a LoRA run stayed zero, the Trainer logging the loss as 0).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.integrations.test_hf import _args, _close, _data, _llama, _one_process, _weights

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow  # each case builds and trains Trainers: seconds even on an idle core

CHUNK = 16


def _fused_loss(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the next token from the backbone's hidden states and ``lm_head.weight``, chunk by chunk."""
    hidden = model.model(input_ids=input_ids).last_hidden_state[:, :-1]
    targets = labels[:, 1:]
    weight = model.lm_head.weight
    lse = hidden.new_full(targets.shape, float("-inf"))
    picked = hidden.new_zeros(targets.shape)
    for start in range(0, weight.shape[0], CHUNK):
        logits = hidden @ weight[start : start + CHUNK].T
        lse = torch.logaddexp(lse, logits.logsumexp(-1))
        inside = (targets >= start) & (targets < start + logits.shape[-1])
        index = (targets - start).clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
        picked = picked + torch.where(inside, logits.gather(-1, index).squeeze(-1), 0.0)
    return (lse - picked).mean()


def _fused_trainer() -> type:
    from transformers import Trainer

    class FusedLossTrainer(Trainer):
        """As TRL's SFTTrainer: the model's forward computes the loss from the head's weight (its module here
        says where such a trainer comes from, as ZeroTrainer reads it)."""

        def __init__(self, model, *args, **kwargs):
            def forward(input_ids=None, labels=None, **_):
                return {"loss": _fused_loss(model, input_ids, labels)}

            model.forward = forward
            super().__init__(model, *args, **kwargs)

    FusedLossTrainer.__module__ = "trl.trainer.sft_trainer"
    return FusedLossTrainer


@pytest.mark.parametrize("order", ["zero first", "trl first"])
def test_a_fused_lm_head_loss_trains_at_stage3(tmp_path, monkeypatch, caplog, order: str) -> None:
    from zero_kernels.integrations.hf import ZeroTrainer

    _one_process(monkeypatch)
    fused = _fused_trainer()
    bases = (ZeroTrainer, fused) if order == "zero first" else (fused, ZeroTrainer)
    zero_fused = type("ZeroFused", bases, {})
    weights, losses = [], []
    for cls, extra in (
        (fused, {}),
        (
            zero_fused,
            {"zero_optimization": {"stage": 3, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0}},
        ),
    ):
        model = _llama()
        with warnings.catch_warnings(), caplog.at_level("INFO", logger="zero_kernels"):
            warnings.simplefilter("ignore")
            trainer = cls(model=model, args=_args(str(tmp_path / cls.__name__), ddp_backend=None),
                          train_dataset=_data(), **extra)  # fmt: skip
            trainer.train()
        weights.append(_weights(model, trainer if cls is zero_fused else None))
        losses.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    assert all(torch.isfinite(torch.tensor(losses[1]))) and losses[1] == pytest.approx(losses[0], rel=1e-5), losses
    _close(weights[1], weights[0], f"ZeroTrainer at stage 3 with a fused LM-head loss ({order})", tol=1e-5)
    assert "lm_head" not in caplog.text or "Linear.weight is gathered for LlamaForCausalLM's forward" in caplog.text
    assert "TRL's FusedLossTrainer (its fused LM-head loss)" in caplog.text, caplog.text
