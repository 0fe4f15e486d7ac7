"""The Hugging Face Trainer with ``ZeroTrainer`` on 2 gloo ranks, against the Trainer with ``torch.optim.AdamW``.

Tiny models built from configs (random weights, no download). One spawn runs every case:

- Llama, stages 0-3 (stage 3 with gathered units), 2 accumulation micro-batches per step, clipping
  active: the weights after training match the plain Trainer's run (its DDP wrap + AdamW) to
  fp32 noise, and so do the logged losses and gradient norms. (Llama has no biases: GPT-2's
  attention key bias gets a gradient that is rounding noise, which Adam turns into full steps.
  For the same reason ``adam_epsilon`` is 1e-3: an embedding element whose gradient cancels to
  ~1e-7 of its row's would, with eps 1e-8, take a step of ~0.6 x lr whose size hangs on that
  noise, so the last-ulp differences between the fused C++ kernel and AdamW grow to 1e-4.)
- GPT-2 (tied embeddings) at stage 3: a Trainer checkpoint taken halfway resumes, on a model built
  from another seed, to the same weights as the uninterrupted run; ``save_model`` +
  ``from_pretrained`` round-trips the weights exactly; without
  ``stage3_gather_16bit_weights_on_model_save`` no weights file is written and a warning says where
  they are.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow  # each case builds and trains Trainers: seconds even on an idle core

STEPS, BATCH, SEQ, VOCAB = 4, 2, 8, 64


def _env(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")


def _data(count: int = STEPS * BATCH * 2 * 2) -> list:
    g = torch.Generator().manual_seed(7)
    return [{"input_ids": (ids := torch.randint(0, VOCAB, (SEQ,), generator=g)), "labels": ids} for _ in range(count)]


def _gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def _llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=SEQ, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _args(output_dir: str, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=BATCH,
                gradient_accumulation_steps=2, learning_rate=2e-2, weight_decay=0.1, max_grad_norm=0.5,
                adam_epsilon=1e-3,
                lr_scheduler_type="linear", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                ddp_backend="gloo", disable_tqdm=True, seed=0, dataloader_num_workers=0)  # fmt: skip
    return TrainingArguments(**{**base, **kw})


def _weights(model, trainer=None) -> dict[str, torch.Tensor]:
    held = trainer.zero_optimizer.gathered_params() if trainer is not None else torch.no_grad()
    with held:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _close(a: dict, b: dict, what: str, tol: float) -> None:
    """Element-wise within ``tol`` relative, plus ``tol`` x the tensor's largest magnitude for elements near zero."""
    assert a.keys() == b.keys(), what
    for k in a:
        atol = tol * b[k].abs().max().item()
        diff = (a[k] - b[k]).abs().max().item()
        assert torch.allclose(a[k], b[k], rtol=tol, atol=atol), f"{what}: {k} differs by up to {diff:.3g}"


def _history(trainer) -> list[tuple[float, float]]:
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def _matrix(out: str) -> None:
    """Llama at every stage against the Trainer with DDP + AdamW."""
    from transformers import Trainer

    from zero_kernels.integrations.hf import ZeroTrainer

    ref_model = _llama()
    ref = Trainer(model=ref_model, args=_args(os.path.join(out, "ref")), train_dataset=_data())
    ref.train()
    expected, expected_log = _weights(ref_model), _history(ref)
    assert len(expected_log) == STEPS and max(n for _, n in expected_log) > 0.5, f"clipping inactive: {expected_log}"
    for stage in (0, 1, 2, 3):
        model = _llama()
        zero = {"stage": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 100}
        trainer = ZeroTrainer(model=model, args=_args(os.path.join(out, f"s{stage}")), train_dataset=_data(),
                              zero_optimization=zero)  # fmt: skip
        trainer.train()
        assert trainer.model_wrapped is model, f"stage {stage}: wrapped in {type(trainer.model_wrapped).__name__}"
        _close(_weights(model, trainer), expected, f"stage {stage} weights", tol=1e-5)
        for (loss, norm), (rloss, rnorm) in zip(_history(trainer), expected_log):
            assert loss == pytest.approx(rloss, rel=1e-5) and norm == pytest.approx(rnorm, rel=1e-4), (
                f"stage {stage}: log {_history(trainer)} vs {expected_log}"
            )


def _resume_and_save(out: str) -> None:
    """GPT-2 at stage 3: checkpoint, resume, save_model, from_pretrained."""
    from transformers import GPT2LMHeadModel

    from zero_kernels.integrations.hf import CHECKPOINT_DIR, ZeroTrainer

    zero = {"stage": 3, "stage3_param_persistence_threshold": 100, "stage3_gather_16bit_weights_on_model_save": True}
    args = dict(save_strategy="steps", save_steps=STEPS // 2, output_dir=os.path.join(out, "run"))
    model = _gpt2()
    trainer = ZeroTrainer(model=model, args=_args(**args), train_dataset=_data(), zero_optimization=zero)
    trainer.train()
    final = _weights(model, trainer)
    assert os.path.isdir(os.path.join(out, "run", f"checkpoint-{STEPS // 2}", CHECKPOINT_DIR))

    resumed = _gpt2(seed=1)
    again = ZeroTrainer(model=resumed, args=_args(**args), train_dataset=_data(), zero_optimization=zero)
    again.train(resume_from_checkpoint=os.path.join(out, "run", f"checkpoint-{STEPS // 2}"))
    _close(_weights(resumed, again), final, "resumed from checkpoint", tol=1e-6)

    saved = os.path.join(out, "saved")
    trainer.save_model(saved)
    loaded = GPT2LMHeadModel.from_pretrained(saved).state_dict()
    for k, v in loaded.items():
        assert torch.equal(v, final[k]), f"from_pretrained: {k} differs"

    no_gather = {**zero, "stage3_gather_16bit_weights_on_model_save": False}
    quiet = ZeroTrainer(model=_gpt2(), args=_args(output_dir=os.path.join(out, "q"), max_steps=1),
                        train_dataset=_data(), zero_optimization=no_gather)  # fmt: skip
    quiet.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.save_model(os.path.join(out, "sharded"))
    assert any("stage3_gather_16bit_weights_on_model_save" in str(w.message) for w in caught)
    assert not os.path.exists(os.path.join(out, "sharded", "model.safetensors"))
    assert os.path.isdir(os.path.join(out, "sharded", CHECKPOINT_DIR))


def _all_cases(rank: int, world: int, out: str) -> None:
    _env(rank, world)
    out = os.path.join(out, "shared")
    _matrix(out)
    _resume_and_save(out)


@pytest.mark.distributed
def test_trainer_matches_adamw_resumes_and_saves(spawn, tmp_path) -> None:
    spawn(_all_cases, 2, str(tmp_path), timeout_s=600.0)


def _one_process(monkeypatch) -> None:
    for key, value in dict(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false").items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("stage", [2, 3])
def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path, monkeypatch, stage: int) -> None:
    """``load_best_model_at_end`` (the highest eval loss is the best here, so it is not the last checkpoint): the
    model after training evaluates to the best metric exactly, at stage 3 too (from the sharded checkpoint; the
    Trainer's own load refuses the empty stage-3 parameters)."""
    from zero_kernels.integrations.hf import ZeroTrainer

    _one_process(monkeypatch)
    args = _args(str(tmp_path), eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                 load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True,
                 ddp_backend=None)  # fmt: skip
    zero = {"stage": stage, "reduce_bucket_size": 700, "stage3_param_persistence_threshold": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = ZeroTrainer(model=_llama(), args=args, train_dataset=_data(), eval_dataset=_data(8),
                              zero_optimization=zero)  # fmt: skip
        trainer.train()
        last = max((d for d in os.listdir(tmp_path) if d.startswith("checkpoint-")), key=lambda d: int(d[11:]))
        assert os.path.basename(trainer.state.best_model_checkpoint) != last
        assert trainer.evaluate()["eval_loss"] == trainer.state.best_metric


def _weights_only_checkpoint(output_dir: Path, zero: dict) -> Path:
    """A ``ZeroTrainer`` run on one process saving with ``save_only_model`` (weights, no optimizer state): its
    checkpoint after step 2."""
    from zero_kernels.integrations.hf import ZeroTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = _args(str(output_dir), save_strategy="steps", save_steps=2, save_only_model=True, ddp_backend=None)
        ZeroTrainer(model=_llama(), args=args, train_dataset=_data(), zero_optimization=zero).train()
    return output_dir / "checkpoint-2"


def test_a_checkpoint_with_weights_only_resumes_the_model_as_the_trainer_does(tmp_path, monkeypatch) -> None:
    """A checkpoint saved with ``save_only_model`` (weights, no optimizer state): the resume loads the weights and
    starts the optimizer afresh, with a warning, as the Trainer does (it was refused)."""
    from zero_kernels.integrations.hf import ZeroTrainer

    _one_process(monkeypatch)
    zero = {"stage": 2, "reduce_bucket_size": 700}
    saved = _weights_only_checkpoint(tmp_path / "a", zero)
    again = ZeroTrainer(model=_llama(seed=5), args=_args(str(tmp_path / "b"), ddp_backend=None), train_dataset=_data(),
                        zero_optimization=zero)  # fmt: skip
    with pytest.warns(UserWarning, match="holds the model's weights but no optimizer state"):
        again.train(resume_from_checkpoint=str(saved))
    assert again.state.global_step == STEPS


class _StopAt:
    """A Trainer callback that stops training once, at ``step`` (an interrupted run)."""

    def __new__(cls, step: int):
        from transformers import TrainerCallback

        class Stop(TrainerCallback):
            fired = False

            def on_step_end(self, args, state, control, **kw):
                if state.global_step == step and not self.fired:
                    self.fired = control.should_training_stop = True

        return Stop()


def _lora_llama(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_llama(seed), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed))
    return model


@pytest.mark.parametrize("stage, lora", [(2, False), (3, False), (3, True)])
def test_a_checkpoint_of_the_plain_trainer_resumes_its_adamw_state_and_schedule(
    tmp_path, monkeypatch, stage, lora
) -> None:
    """A checkpoint the Trainer wrote (DDP or one process + AdamW: ``optimizer.pt``, ``scheduler.pt``) resumed by
    ``ZeroTrainer``: the AdamW state and the schedule continue, to the Trainer's uninterrupted weights (they were
    dropped with a warning calling the checkpoint weights-only: the learning rate restarted from its first value
    and the moments from zero, 0.65 of a weight's largest magnitude apart after 6 steps). A LoRA model's checkpoint
    (an adapter, and an empty no-decay group in the Trainer's AdamW) too (it was refused as not ZeroTrainer's)."""
    from transformers import Trainer

    from zero_kernels.integrations.hf import ZeroTrainer

    if lora:
        pytest.importorskip("peft")
    build = _lora_llama if lora else _llama
    _one_process(monkeypatch)
    kw = dict(save_strategy="steps", save_steps=2, max_steps=6, ddp_backend=None)
    full = build()
    Trainer(model=full, args=_args(str(tmp_path / "full"), **kw), train_dataset=_data()).train()
    cut = Trainer(model=build(), args=_args(str(tmp_path / "cut"), **kw), train_dataset=_data(),
                  callbacks=[_StopAt(3)])  # fmt: skip
    cut.train()
    zero = {"stage": stage, "reduce_bucket_size": 700, "stage3_param_persistence_threshold": 0}
    model = build(seed=0 if lora else 5)  # a LoRA checkpoint holds the adapter only: the same base
    again = ZeroTrainer(model=model, args=_args(str(tmp_path / "again"), **kw), train_dataset=_data(),
                        zero_optimization=zero)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # not called weights-only
        warnings.filterwarnings("ignore", message=".*stage3_gather_16bit_weights_on_model_save")
        again.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-2"))
    _close(_weights(model, again), _weights(full), "resumed from the Trainer's checkpoint", tol=1e-5)


def test_a_checkpoint_of_the_trainer_with_deepspeed_is_refused_naming_the_import(tmp_path, monkeypatch) -> None:
    """A checkpoint the Trainer with DeepSpeed wrote (weights, a ``latest`` file naming its ``global_step`` folder):
    refused, naming ``import-deepspeed`` (it was taken for a weights-only checkpoint: the DeepSpeed optimizer state
    dropped with a warning saying there was none)."""
    from zero_kernels.integrations.hf import ZeroTrainer

    _one_process(monkeypatch)
    zero = {"stage": 2, "reduce_bucket_size": 700}
    saved = _weights_only_checkpoint(tmp_path / "a", zero)
    (saved / "global_step2").mkdir()
    (saved / "latest").write_text("global_step2")
    again = ZeroTrainer(model=_llama(seed=5), args=_args(str(tmp_path / "b"), ddp_backend=None), train_dataset=_data(),
                        zero_optimization=zero)  # fmt: skip
    with pytest.raises(ValueError, match="import-deepspeed"):
        again.train(resume_from_checkpoint=str(saved))


def test_an_optimizer_other_than_adamw_is_refused(tmp_path, monkeypatch) -> None:
    """``TrainingArguments(optim="sgd")`` without a config optimizer section: ZeroTrainer trains AdamW only, so it
    says so (it trained AdamW silently)."""
    from zero_kernels.integrations.hf import ZeroTrainer

    _one_process(monkeypatch)
    args = _args(str(tmp_path), optim="sgd", ddp_backend=None)
    trainer = ZeroTrainer(model=_llama(), args=args, train_dataset=_data(), zero_optimization={"stage": 2})
    with pytest.raises(ValueError, match="optim='sgd'.*allowed: adamw_torch"):
        trainer.train()


def test_an_optimizer_built_by_a_create_optimizer_override_is_stepped(tmp_path, monkeypatch, caplog) -> None:
    """A Trainer subclass building its own param groups in ``create_optimizer`` (LLaVA's pattern): a
    ``ShardedFusedAdam`` is stepped and clipped (it failed with 'NoneType' has no attribute 'clip_grad_norm_'), and
    the line saying where each value came from describes it (it described a stage-1 AdamW from the arguments); any
    other optimizer is refused naming what to build."""
    import zero_kernels as zk
    from zero_kernels.integrations.hf import ZeroTrainer

    class Custom(ZeroTrainer):
        def create_optimizer(self, model=None):
            if self.optimizer is None:
                params = [p for p in self.model.parameters() if p.requires_grad]
                self.optimizer = zk.ShardedFusedAdam([{"params": params}], module=self.model, lr=1e-2, stage=2)
            return super().create_optimizer()  # the Trainer's create_optimizer keeps an optimizer set before it

    class Plain(ZeroTrainer):
        def create_optimizer(self, model=None):
            self.optimizer = self.optimizer or torch.optim.SGD(self.model.parameters(), lr=1e-2)
            return self.optimizer

    _one_process(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = _args(str(tmp_path / "a"), ddp_backend=None, warmup_steps=2)  # the log shows lr 0.01, not the warmup's 0
        trainer = Custom(model=_llama(), args=args, train_dataset=_data())
        with caplog.at_level(logging.WARNING, logger="zero_kernels"):
            trainer.train()
    assert trainer.zero_optimizer is trainer.optimizer.optimizer and trainer.zero_optimizer.applied_steps == STEPS
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ZeroTrainer: ")]
    assert len(lines) == 1 and lines[0].startswith("ZeroTrainer: create_optimizer(): stage=2 [optimizer]"), lines
    assert "optimizer=ShardedFusedAdam [create_optimizer]: group 0: lr=0.01" in lines[0], lines
    plain = Plain(model=_llama(), args=_args(str(tmp_path / "b"), ddp_backend=None), train_dataset=_data())
    with pytest.raises(TypeError, match=r"the optimizer \(SGD\) that a create_optimizer override builds is not take"):
        plain.train()


def _lora_plus_groups(model) -> list[dict]:
    """Param groups of their own, as LoRA+ builds them: the embeddings at lr 0 (they must not move), the rest at
    the default lr, the norms without weight decay."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if "embed" in n], "lr": 0.0},
        {"params": [p for n, p in named if "embed" not in n and "norm" not in n]},
        {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0},
    ]


def _with_own_optimizer(base: type, calls_super: bool) -> type:
    """``base`` with a ``create_optimizer`` building ``torch.optim.AdamW`` over its own groups: LLaMA-Factory's
    form (set ``self.optimizer``, then ``super().create_optimizer()``) or one that returns it alone."""

    class Own(base):
        def create_optimizer(self, model=None):
            if self.optimizer is None:
                self.optimizer = torch.optim.AdamW(_lora_plus_groups(self.model), lr=2e-2, weight_decay=0.1, eps=1e-3)
            return super().create_optimizer() if calls_super else self.optimizer

    return Own


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("calls_super", [True, False], ids=["then-super", "alone"])
def test_a_torch_adamw_built_by_a_create_optimizer_override_trains_with_its_groups(
    tmp_path, monkeypatch, calls_super: bool, stage: int
) -> None:
    """A subclass building a ``torch.optim.AdamW`` over its own groups (LoRA+ in LLaMA-Factory) trains as the
    Trainer with that optimizer, group by group, as the Trainer with DeepSpeed takes it as a client optimizer; it
    was refused (returned alone) or silently replaced by an AdamW over the default groups (then ``super()``: the
    embeddings at lr 0 moved by 4e-2)."""
    from transformers import Trainer

    from zero_kernels.integrations.hf import ZeroTrainer

    _one_process(monkeypatch)
    weights = []
    zero = {"stage": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 100}
    for base, extra in ((Trainer, {}), (ZeroTrainer, {"zero_optimization": zero})):
        model = _llama()
        before = model.model.embed_tokens.weight.detach().clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = _with_own_optimizer(base, calls_super)(
                model=model, args=_args(str(tmp_path / base.__name__), ddp_backend=None), train_dataset=_data(), **extra
            )
            trainer.train()
        weights.append(_weights(model, trainer if base is ZeroTrainer else None))
        assert torch.equal(weights[-1]["model.embed_tokens.weight"], before), base.__name__
    _close(weights[1], weights[0], "ZeroTrainer with the override's AdamW", tol=1e-5)


def test_a_torch_adamw_built_by_an_override_beside_a_config_optimizer_section_is_refused(tmp_path, monkeypatch):
    from zero_kernels.integrations.hf import ZeroTrainer

    _one_process(monkeypatch)
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}  # fmt: skip
    trainer = _with_own_optimizer(ZeroTrainer, True)(
        model=_llama(), args=_args(str(tmp_path), ddp_backend=None), train_dataset=_data(), config=config
    )
    with pytest.raises(
        ValueError, match=r'create_optimizer override builds torch.optim.AdamW and .* "optimizer" section: both'
    ):
        trainer.train()


def test_a_given_optimizer_counting_micro_steps_is_refused(tmp_path) -> None:
    import zero_kernels as zk
    from zero_kernels.integrations.hf import ZeroTrainer

    model = _llama()
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=2, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="the Trainer counts the micro-steps itself"):
        ZeroTrainer(model=model, args=_args(str(tmp_path), ddp_backend=None), optimizers=(opt, None))


def test_optimizer_cls_and_kwargs_are_trained_as_the_trainer_trains_them(tmp_path, monkeypatch) -> None:
    """``Trainer(optimizer_cls_and_kwargs=(torch.optim.AdamW, {...}))``: the Trainer's groups with those kwargs, as
    the Trainer (with DeepSpeed too, as a client optimizer) builds them; they were ignored (the arguments' betas and
    eps trained instead). Another class is refused naming the argument."""
    from transformers import Trainer

    from zero_kernels.integrations.hf import ZeroTrainer

    _one_process(monkeypatch)
    given = (torch.optim.AdamW, {"lr": 3e-2, "betas": (0.8, 0.95), "eps": 1e-2})
    weights = []
    for base, extra in ((Trainer, {}), (ZeroTrainer, {"zero_optimization": {"stage": 2, "reduce_bucket_size": 500}})):
        model = _llama()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = base(model=model, args=_args(str(tmp_path / base.__name__), ddp_backend=None),
                           train_dataset=_data(), optimizer_cls_and_kwargs=given, **extra)  # fmt: skip
            trainer.train()
        weights.append(_weights(model, trainer if base is ZeroTrainer else None))
    _close(weights[1], weights[0], "ZeroTrainer with optimizer_cls_and_kwargs", tol=1e-5)
    sgd = ZeroTrainer(model=_llama(), args=_args(str(tmp_path / "sgd"), ddp_backend=None), train_dataset=_data(),
                      optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}))  # fmt: skip
    with pytest.raises(TypeError, match=r"the optimizer \(SGD\) that optimizer_cls_and_kwargs builds is not"):
        sgd.train()


@pytest.mark.parametrize("stage", [2, 3])
def test_model_init_trains_every_train_call_on_the_new_model(tmp_path, monkeypatch, stage: int) -> None:
    """``Trainer(model_init=...)`` builds a new model at each ``train()`` (a hyper-parameter search's trials): the
    second ``train()`` trains it as the Trainer does (it stepped the first model's parameters: the new one never
    moved)."""
    from transformers import Trainer

    from zero_kernels.integrations.hf import ZeroTrainer

    _one_process(monkeypatch)
    zero = {"stage": stage, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 100}
    weights = []
    for base, extra in ((Trainer, {}), (ZeroTrainer, {"zero_optimization": zero})):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = base(model_init=lambda: _llama(), args=_args(str(tmp_path / base.__name__), ddp_backend=None),
                           train_dataset=_data(), **extra)  # fmt: skip
            trainer.train()
            trainer.train()
        weights.append(_weights(trainer.model, trainer if base is ZeroTrainer else None))
    _close(weights[1], weights[0], "the second train() of ZeroTrainer(model_init=...)", tol=1e-5)


def test_total_flos_at_stage_3_counts_the_full_parameters(tmp_path, monkeypatch) -> None:
    """``total_flos`` (logged when training ends, kept in ``trainer_state.json``) at stage 3 is the Trainer's: the
    Trainer's count of a step's operations read the sizes of the parameters freed between uses (0): only the
    persistent ones counted (a 71st of the Trainer's with a persistence threshold of 100), none here."""
    from transformers import Trainer

    from zero_kernels.integrations.hf import ZeroTrainer

    _one_process(monkeypatch)
    flos = []
    zero = {"stage": 3, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0}
    for base, extra in ((Trainer, {}), (ZeroTrainer, {"zero_optimization": zero})):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = base(model=_llama(), args=_args(str(tmp_path / base.__name__), ddp_backend=None, max_steps=1),
                           train_dataset=_data(), **extra)  # fmt: skip
            trainer.train()
        flos.append(trainer.state.total_flos)
    assert flos[1] == flos[0] > 0, flos
