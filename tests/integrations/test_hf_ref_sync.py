"""``ZeroTrainer`` at stage 3 under a trainer that mixes the policy into its reference model between steps (TRL's
``sync_ref_model``: ``SyncRefModelCallback`` runs ``ref.data.mul_(1 - alpha).add_(policy.data, alpha=alpha)`` every
``ref_model_sync_steps``; under DeepSpeed's ZeRO-3 it gathers both models first): the policy is gathered for the sync,
and the reference and the policy match the plain Trainer with ``torch.optim.AdamW``.

The callback here is TRL's (``trl.trainer.callbacks``, trl 1.16) without its DeepSpeed branch. Before, the sync read
the freed (empty) stage-3 parameters and raised at the first sync, after step 2.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.integrations.test_hf import _args, _close, _data, _llama, _one_process, _weights

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow  # each case builds and trains Trainers: seconds even on an idle core

ALPHA = 0.6


def _sync_trainer():
    from transformers import Trainer, TrainerCallback

    class SyncRefModelCallback(TrainerCallback):
        def __init__(self, ref_model):
            self.ref_model = ref_model

        @staticmethod
        def _sync_target_model(model, target_model, alpha):
            for target_param, copy_param in zip(target_model.parameters(), model.parameters(), strict=True):
                target_param.data.mul_(1.0 - alpha).add_(copy_param.data, alpha=alpha)

        @staticmethod
        def sync_target_model(model, target_model, alpha):
            SyncRefModelCallback._sync_target_model(model, target_model, alpha)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % 2 == 0:
                self.sync_target_model(kwargs["model"], self.ref_model, ALPHA)

    class SyncTrainer(Trainer):
        def __init__(self, *args, ref_model=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.ref_model = ref_model
            self.add_callback(SyncRefModelCallback(ref_model))

    SyncRefModelCallback.__module__ = "trl.trainer.callbacks"
    return SyncTrainer


@pytest.mark.parametrize("order", ["zero first", "trl first"])
def test_a_reference_model_synced_from_the_policy_at_stage3(tmp_path, monkeypatch, order: str) -> None:
    from zero_kernels.integrations.hf import ZeroTrainer

    _one_process(monkeypatch)
    plain = _sync_trainer()
    zero = type("ZeroSync", (ZeroTrainer, plain) if order == "zero first" else (plain, ZeroTrainer), {})
    weights, refs = [], []
    for cls, extra in (
        (plain, {}),
        (zero, {"zero_optimization": {"stage": 3, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0}}),
    ):
        model, ref = _llama(), _llama(seed=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = cls(model=model, args=_args(str(tmp_path / cls.__name__), ddp_backend=None),
                          train_dataset=_data(), ref_model=ref, **extra)  # fmt: skip
            trainer.train()
        weights.append(_weights(model, trainer if cls is zero else None))
        refs.append({k: v.detach().clone() for k, v in ref.state_dict().items()})
    assert not torch.equal(refs[0]["lm_head.weight"], _llama(seed=1).lm_head.weight.detach())  # the sync ran
    _close(refs[1], refs[0], f"the reference model synced from ZeroTrainer's policy at stage 3 ({order})", tol=1e-5)
    _close(weights[1], weights[0], "the policy at stage 3 with a synced reference model", tol=1e-5)


def test_a_reference_model_is_cast_to_bf16_with_the_policy(tmp_path, monkeypatch) -> None:
    """A whole config with bf16 casts the policy to bf16 (fp32 masters in the optimizer); TRL's reference model goes
    to bf16 too, as DeepSpeed casts it (TRL's ``prepare_deepspeed`` gives it the same config): a reference kept in
    fp32 differs from the bf16 policy it starts as, so DPO's implicit rewards were not 0 at the first step (its loss
    0.693170 instead of ln 2 on a tiny Llama, 2 CPU ranks)."""
    from zero_kernels.integrations.hf import ZeroTrainer

    _one_process(monkeypatch)
    zero = type("ZeroSync", (ZeroTrainer, _sync_trainer()), {})
    config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}
    model, ref = _llama(), _llama(seed=1)
    want = {k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = zero(model=model, args=_args(str(tmp_path / "out"), ddp_backend=None, max_steps=1, bf16=True),
                       train_dataset=_data(), ref_model=ref, config=config)  # fmt: skip
        trainer.train()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    got = ref.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want), {k: got[k].dtype for k in got}
