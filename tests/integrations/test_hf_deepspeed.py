"""``ZeroTrainer`` with a whole DeepSpeed config, against the Hugging Face Trainer with DeepSpeed itself.

1. One import changed (``Trainer`` -> ``ZeroTrainer``), the config left in
   ``TrainingArguments(deepspeed=...)``: a tiny Llama on 2 gloo ranks, ZeRO-2 and ZeRO-3, 60 steps,
   a config of ``"auto"`` values with its own optimizer, ``WarmupLR`` scheduler and clipping:
   every step's loss, gradient norm and learning rate, and the final weights, match the Trainer
   with DeepSpeed 0.19 (``"torch_adam": true``) on the same config. Needs deepspeed (skipped
   without it: ``pip install deepspeed``).
2. Without deepspeed, on one process: ``ZeroTrainer(config=...)`` (a dict or a JSON path, also
   through ``zero_optimization=``) builds what the config says (its optimizer over every
   parameter, its scheduler, its clipping, bucket sizes from the hidden size) and logs where each
   value came from; an explicit value that disagrees with ``TrainingArguments`` is refused, as the
   Trainer with DeepSpeed refuses it; ``"auto"`` bucket sizes in ``zero_optimization=`` come from the
   model's hidden size, not DeepSpeed's defaults.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os

import pytest
import torch

from tests.integrations.test_hf import _env, _llama

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS, BATCH, SEQ, VOCAB, HIDDEN, LR = 60, 2, 8, 64, 16, 5e-3
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _config(stage: int) -> dict:
    """A config as the Hugging Face docs write it: "auto" wherever the Trainer fills values."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
        },
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
        "steps_per_print": 1 << 30,
    }


def _data(count: int) -> list:
    """``count`` examples cycling through 16 token sequences: the loss falls steadily, so that the runs compared
    stay within fp32 noise of each other instead of amplifying it."""
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, VOCAB, (SEQ,), generator=g) for _ in range(16)]
    return [{"input_ids": seqs[i % 16], "labels": seqs[i % 16]} for i in range(count)]


def _args(output_dir: str, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=BATCH,
                gradient_accumulation_steps=2, learning_rate=LR, weight_decay=0.1, max_grad_norm=0.5,
                adam_epsilon=1e-3, warmup_steps=5, logging_steps=1, save_strategy="no", report_to=[],
                use_cpu=True, ddp_backend="gloo", disable_tqdm=True, seed=0, dataloader_num_workers=0)  # fmt: skip
    return TrainingArguments(**{**base, **kw})


def _history(trainer) -> list[tuple[float, float, float]]:
    return [(h["loss"], h["grad_norm"], h["learning_rate"]) for h in trainer.state.log_history if "loss" in h]


def _no_shm_build() -> None:
    """DeepSpeed's CPU shared-memory op serves only its inference all-reduce: do not build it (minutes)."""
    import deepspeed.comm.torch as ds_torch_comm

    ds_torch_comm.build_shm_op = lambda: None


def _against_deepspeed(rank: int, world: int, out: str) -> None:
    """Item 1, on each rank: the Trainer with DeepSpeed, then ZeroTrainer, at stages 2 and 3."""
    _env(rank, world)
    _no_shm_build()
    import deepspeed
    from transformers import Trainer

    from zero_kernels.integrations.hf import ZeroTrainer

    data = _data(STEPS * BATCH * 2 * world)
    for stage in (2, 3):
        ref_model = _llama()
        ref = Trainer(model=ref_model, args=_args(os.path.join(out, f"ds{stage}"), deepspeed=_config(stage)),
                      train_dataset=data)  # fmt: skip
        ref.train()
        with deepspeed.zero.GatheredParameters(list(ref_model.parameters())):  # stage 3: full parameters
            expected = {k: v.detach().clone() for k, v in ref_model.state_dict().items()}
        expected_log = _history(ref)
        del ref

        model = _llama()
        args = _args(os.path.join(out, f"zk{stage}"), deepspeed=_config(stage))
        trainer = ZeroTrainer(model=model, args=args, train_dataset=data)
        trainer.train()
        assert trainer.model_wrapped is model, f"stage {stage}: wrapped in {type(trainer.model_wrapped).__name__}"
        assert trainer.zero_options.stage == stage and trainer.zero_options.reduce_bucket_size == HIDDEN * HIDDEN
        if stage == 3:  # "auto" sizes from the hidden size: most parameters are sharded, not kept whole
            full = sum(4 * p.numel() for p in _llama().parameters())
            held = trainer.zero_optimizer.memory_report()["params"]
            assert held < 0.6 * full, f"stage 3 holds {held} of the {full} parameter bytes"
        got_log = _history(trainer)
        assert len(got_log) == len(expected_log) == STEPS, (got_log, expected_log)
        assert max(n for _, n, _ in expected_log) > 0.5, f"clipping never active: {expected_log}"
        # The Trainer with DeepSpeed logs the learning rate after DeepSpeed's engine stepped its scheduler (the
        # next step's); ZeroTrainer logs the one the step used, as the Trainer without DeepSpeed does.
        for step in range(1, STEPS):
            assert got_log[step][2] == pytest.approx(expected_log[step - 1][2], rel=1e-6), f"stage {stage}: lr"
        for step, (mine, theirs) in enumerate(zip(got_log, expected_log)):
            assert mine[0] == pytest.approx(theirs[0], rel=1e-5), f"stage {stage} step {step}: loss {mine} {theirs}"
            assert mine[1] == pytest.approx(theirs[1], rel=1e-5), f"stage {stage} step {step}: norm {mine} {theirs}"
        with trainer.zero_optimizer.gathered_params():
            got = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for name, value in expected.items():
            scale = value.abs().max().item()
            assert torch.allclose(got[name], value, rtol=1e-5, atol=1e-5 * scale), f"stage {stage}: {name} differs"


@pytest.mark.distributed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs deepspeed (pip install deepspeed) to run the Trainer with it")
def test_matches_the_trainer_with_deepspeed(spawn, tmp_path) -> None:
    spawn(_against_deepspeed, 2, str(tmp_path), timeout_s=900.0)


def _built(tmp_path, caplog, **trainer_kwargs):
    """A ZeroTrainer on one process whose optimizer and scheduler are built as train() builds them."""
    from zero_kernels.integrations.hf import ZeroTrainer

    args = trainer_kwargs.pop("args", None) or _args(str(tmp_path), max_steps=20, ddp_backend=None)
    trainer = ZeroTrainer(model=_llama(), args=args, train_dataset=_data(8), **trainer_kwargs)
    trainer.state.max_steps = args.max_steps
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        trainer.create_optimizer()
        trainer.create_scheduler(num_training_steps=args.max_steps)
    return trainer


@pytest.mark.parametrize("given", ["config", "path", "zero_optimization path"])
def test_whole_config_is_honoured(tmp_path, caplog, given: str) -> None:
    """Item 2: the config's optimizer (one group), scheduler, clipping and sizes, and the log line."""
    from zero_kernels.schedulers import WarmupLR

    config = _config(3)
    config["gradient_clipping"] = 0.25  # explicit: it must equal max_grad_norm, as the Trainer requires
    args = _args(str(tmp_path), max_steps=20, max_grad_norm=0.25, ddp_backend=None)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    source = {"config": {"config": config}, "path": {"config": str(path)}}.get(given, {"zero_optimization": path})
    trainer = _built(tmp_path, caplog, args=args, **source)
    opt = trainer.zero_optimizer
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["weight_decay"] == 0.1, "one group, decay everywhere"
    assert opt.param_groups[0]["eps"] == 1e-3 and opt.options.stage == 3
    assert opt.options.reduce_bucket_size == HIDDEN * HIDDEN
    assert opt.options.stage3_param_persistence_threshold == 10 * HIDDEN
    assert isinstance(trainer.lr_scheduler, WarmupLR) and trainer.lr_scheduler.warmup_num_steps == 5
    assert trainer.zero_config.gradient_clipping == 0.25
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ZeroTrainer:")]
    assert len(line) == 1, caplog.text
    for fragment in ("stage=3 [config]", "reduce_bucket_size=256 [auto: hidden_size=16]",
                     f"lr={LR} [auto: TrainingArguments.learning_rate]", "scheduler=WarmupLR [config]",
                     "gradient_clipping=0.25 [config]"):  # fmt: skip
        assert fragment in line[0], line[0]


def test_whole_config_passes_amsgrad_and_maximize(tmp_path, caplog) -> None:
    """The config's AdamW params that DeepSpeed hands to torch.optim.AdamW (torch_adam) reach the optimizer."""
    config = _config(2)
    config["optimizer"]["params"].update(amsgrad=True, maximize=True, foreach=None, fp32_optimizer_states=True)
    trainer = _built(tmp_path, caplog, config=config)
    assert [(g["amsgrad"], g["maximize"]) for g in trainer.zero_optimizer.param_groups] == [(True, True)]


def test_missing_sections_follow_the_trainer(tmp_path, caplog) -> None:
    """Item 2: no optimizer or scheduler section: the Trainer's (decay groups, linear); clipping: DeepSpeed's 1.0."""
    config = {"zero_optimization": {"stage": 2}}
    trainer = _built(tmp_path, caplog, config=config)
    assert [g["weight_decay"] for g in trainer.zero_optimizer.param_groups] == [0.1, 0.0]
    assert isinstance(trainer.lr_scheduler, torch.optim.lr_scheduler.LambdaLR)
    assert trainer.zero_config.gradient_clipping == 1.0  # a whole config without the key: DeepSpeed's default
    assert "no optimizer section" in caplog.text and "gradient_clipping=1.0 [DeepSpeed's default]" in caplog.text


def test_mismatch_is_refused_as_by_the_trainer(tmp_path, caplog) -> None:
    """Item 2: an explicit value that disagrees with TrainingArguments is an error naming both."""
    config = _config(2)
    config["optimizer"]["params"]["lr"] = 1e-3
    with pytest.raises(ValueError, match=r"optimizer\.params\.lr=0\.001 in the config disagrees with.*learning_rate"):
        _built(tmp_path, caplog, config=config)


@pytest.mark.parametrize(
    "warmup,shown",
    [
        (0, "training_args.warmup_steps=0 (0 warmup steps of 20, which the Trainer fills in as 1)"),
        (0.25, "training_args.warmup_steps=0.25 (5 warmup steps of 20)"),
        (4, "training_args.warmup_steps=4;"),
    ],
)
def test_warmup_mismatch_names_the_trainers_value(tmp_path, caplog, warmup: float, shown: str) -> None:
    """Item 2: an explicit warmup_num_steps against TrainingArguments' warmup names the arguments as given, and the
    step count the Trainer derives from them where it differs (at least 1: the Trainer's floor)."""
    config = _config(2)
    config["scheduler"]["params"]["warmup_num_steps"] = 3
    args = _args(str(tmp_path), max_steps=20, warmup_steps=warmup, ddp_backend=None)
    with pytest.raises(ValueError, match="scheduler.params.warmup_num_steps=3 in the config disagrees with ") as error:
        _built(tmp_path, caplog, config=config, args=args)
    assert shown in str(error.value)


def test_zero_section_auto_sizes_from_hidden_size(tmp_path, caplog) -> None:
    """Item 4: "auto" sizes in zero_optimization= come from the hidden size, as through zk.initialize."""
    section = {"stage": 3, "reduce_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
               "stage3_prefetch_bucket_size": "auto"}  # fmt: skip
    options = _built(tmp_path, caplog, zero_optimization=section).zero_optimizer.options
    assert options.reduce_bucket_size == HIDDEN * HIDDEN
    assert options.stage3_prefetch_bucket_size == int(0.9 * HIDDEN * HIDDEN)
    assert options.stage3_param_persistence_threshold == 10 * HIDDEN


def test_config_given_twice_is_refused(tmp_path) -> None:
    from zero_kernels.integrations.hf import ZeroTrainer

    with pytest.raises(ValueError, match="given twice"):
        args = _args(str(tmp_path), ddp_backend=None)
        ZeroTrainer(model=_llama(), args=args, config=_config(2), zero_optimization={"stage": 2})


def test_log_line_names_a_given_optimizer(tmp_path, caplog) -> None:
    """optimizers=(ShardedFusedAdam, scheduler): the log line gives that optimizer's options and groups, not the
    arguments' (which the Trainer does not use for it)."""
    import zero_kernels as zk

    model = _llama()
    opt = zk.ShardedFusedAdam(model.parameters(), lr=0.02, eps=1e-6, weight_decay=0.3, stage=2, reduce_bucket_size=512)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    from zero_kernels.integrations.hf import ZeroTrainer

    args = _args(str(tmp_path), max_steps=20, ddp_backend=None)
    trainer = ZeroTrainer(model=model, args=args, train_dataset=_data(8), optimizers=(opt, sched))
    trainer.state.max_steps = args.max_steps
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        trainer.create_optimizer_and_scheduler(num_training_steps=args.max_steps)
        trainer._resolved_config()
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ZeroTrainer:")]
    assert len(line) == 1, caplog.text
    wanted = ("optimizers=(ShardedFusedAdam, ...)", "stage=2 [optimizer]", "reduce_bucket_size=512 [optimizer]",
              "group 0: lr=0.02, betas=(0.9, 0.999), eps=1e-06, weight_decay=0.3", "scheduler=StepLR")  # fmt: skip
    for fragment in wanted:
        assert fragment in line[0], line[0]
    assert f"lr={LR}" not in line[0], line[0]


class _InfThirdStep(torch.nn.Module):
    """A regression whose third forward's loss (so its gradients) is inf."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 1)
        self.calls = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        self.calls += 1
        loss = (self.lin(x).squeeze(-1) - labels).pow(2).mean()
        return {"loss": loss * torch.inf if self.calls == 3 else loss}


@pytest.mark.parametrize("section", [False, True], ids=["trainer's scheduler", "config's scheduler"])
def test_scheduler_advances_only_at_applied_updates(tmp_path, section: bool) -> None:
    """In train(), a step this optimizer skips for inf/NaN gradients does not advance the scheduler (the Trainer's
    own or the config's), as DeepSpeed's engine does not: the Trainer calls lr_scheduler.step() anyway
    (Accelerate sees no skip without a GradScaler), on a scheduler built after Accelerate wrapped the optimizer."""
    from transformers import TrainerCallback, TrainingArguments

    from zero_kernels.integrations.hf import ZeroTrainer

    lrs = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
            lrs.append(lr_scheduler.get_last_lr()[0])

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=5, learning_rate=1e-2,
                             lr_scheduler_type="linear", report_to=[], use_cpu=True, save_strategy="no")  # fmt: skip
    section_config = {"scheduler": {"type": "StepLR", "params": {"step_size": 1, "gamma": 0.5}}}
    config = {"zero_optimization": {"stage": 2}, **(section_config if section else {})}
    data = [{"x": torch.randn(8), "labels": torch.randn(())} for _ in range(10)]
    trainer = ZeroTrainer(model=_InfThirdStep(), args=args, train_dataset=data, config=config, callbacks=[Record()])
    trainer.train()
    assert trainer.zero_optimizer.skipped_steps == 1, "the inf step was not skipped"
    moved = [b != a for a, b in zip(lrs, lrs[1:])]
    assert moved == [True, False, True, True], f"lr after each step {lrs}: it moved on the skipped step (the 3rd)"


def test_a_whole_config_runs_the_forward_without_autocast(tmp_path) -> None:
    """A whole config with bf16 and ``bf16=True``: the bf16 model runs without Accelerate's autocast and its outputs
    stay bf16, as under the Trainer with DeepSpeed (Accelerate turns autocast off there). Before, the forward ran
    under autocast with its outputs turned to fp32, so a ``compute_loss_func`` reading the logits computed another
    loss: 9.4e-4 off the Trainer with DeepSpeed at the first step (GPT-2, ZeRO-3, 2 CPU ranks), its gradient norm
    1.4e-3 off."""
    from zero_kernels.integrations.hf import ZeroTrainer

    seen = []

    def loss_func(outputs, labels, num_items_in_batch=None):
        seen.append(outputs.logits.dtype)
        logits = outputs.logits[:, :-1].flatten(0, 1)
        return torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten())

    config = {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto",
              "train_micro_batch_size_per_gpu": "auto"}  # fmt: skip
    args = _args(str(tmp_path), max_steps=1, ddp_backend=None, bf16=True)
    trainer = ZeroTrainer(model=_llama(), args=args, train_dataset=_data(8), config=config, compute_loss_func=loss_func)
    trainer.train()
    assert seen == [torch.bfloat16, torch.bfloat16], seen  # two accumulation micro-batches


def test_a_whole_bf16_config_casts_the_parameters_and_keeps_the_buffers(tmp_path, caplog) -> None:
    """bf16 parameters, buffers in their own dtype (a Llama's rotary ``inv_freq`` fp32), as DeepSpeed 0.19 casts the
    module. Before, ``model.to(torch.bfloat16)`` cast the rotary frequencies too: TRL's SFT and DPO on a tiny Llama
    (ZeRO-3, 2 CPU ranks) lost 4.6e-7 and 3.2e-6 of their first loss against the Trainer with DeepSpeed, the DPO
    gradient norm 1.2e-4; now the weights are DeepSpeed's bit for bit without accumulation."""
    config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    trainer = _built(tmp_path, caplog, config=config, args=_args(str(tmp_path), max_steps=20, ddp_backend=None,
                                                                 bf16=True))  # fmt: skip
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in trainer.model.buffers()} == {torch.float32}


def test_arguments_found_after_another_positional_argument(tmp_path, caplog) -> None:
    """A trainer taking ``(model, ref_model, args)`` (TRL's DPOTrainer; GRPOTrainer's ``(model, reward_funcs,
    args)``) with ``ZeroTrainer`` first in its bases: the config in its arguments is the one trained (the reference
    model was read as the arguments: ZeroTrainer logged no DeepSpeed config and built stage 1, and the Trainer
    then set up DeepSpeed itself)."""
    from transformers import Trainer

    from zero_kernels.integrations.hf import ZeroTrainer

    class PairTrainer(Trainer):
        def __init__(self, model, ref_model, args=None, **kwargs):
            self.ref_model = ref_model
            super().__init__(model=model, args=args, **kwargs)

    class ZeroPair(ZeroTrainer, PairTrainer):
        pass

    args = _args(str(tmp_path), max_steps=20, ddp_backend=None)
    args.deepspeed = {"zero_optimization": {"stage": 2}}  # as TrainingArguments(deepspeed=...) keeps it
    ref = _llama()
    trainer = ZeroPair(_llama(), ref, args, train_dataset=_data(8))
    assert trainer.ref_model is ref and trainer.args.deepspeed is None and trainer.zero_source.whole
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        trainer.create_optimizer()
    assert trainer.zero_optimizer.options.stage == 2


@pytest.mark.parametrize("wider", [True, False])
def test_stage_2_reduces_every_micro_batch(tmp_path, wider: bool) -> None:
    """A whole bf16 config at stage 2: every micro-batch's backward reduces into the gradient shard, as the Trainer
    with DeepSpeed runs it (the micro-batch before the last used to run under ``no_sync()``, the whole local gradient
    added up in bf16 ``p.grad``); with ``data_types.grad_accum_dtype: fp32`` into an fp32 shard (the key, and
    ``communication_data_type`` and ``skip_nonfinite_steps``, used to never reach the optimizer)."""
    from zero_kernels.integrations.hf import ZeroTrainer

    trainers, synced = [], []

    def loss_func(outputs, labels, num_items_in_batch=None):
        synced.append(trainers[0].zero_optimizer.pipeline.sync_enabled)
        logits = outputs.logits[:, :-1].flatten(0, 1).float()
        return torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten())

    config = {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto",
              "train_micro_batch_size_per_gpu": "auto"}  # fmt: skip
    if wider:  # with the other top-level keys the Trainer's optimizer left out
        config.update(
            data_types={"grad_accum_dtype": "fp32"}, communication_data_type="fp32", skip_nonfinite_steps=False
        )
    args = _args(str(tmp_path), max_steps=1, ddp_backend=None, bf16=True)
    trainers.append(ZeroTrainer(model=_llama(), args=args, train_dataset=_data(8), config=config,
                                compute_loss_func=loss_func))  # fmt: skip
    trainers[0].train()
    assert synced == [True, True], synced
    opt = trainers[0].zero_optimizer
    kept = (opt.grad_accum_dtype, opt.communication_data_type, opt.skip_nonfinite_steps)
    assert kept == ((torch.float32, torch.float32, False) if wider else (None, None, True)), kept
