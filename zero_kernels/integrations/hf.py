"""``ZeroTrainer``: the Hugging Face ``transformers.Trainer`` training with ``ShardedFusedAdam`` (stages 0-3).

Needs ``transformers`` and ``accelerate`` (``pip install 'zero_kernels[hf]'``). A script written for
the Trainer with DeepSpeed changes one name, ``Trainer`` -> ``ZeroTrainer``; the DeepSpeed config
stays where it was::

    from zero_kernels.integrations.hf import ZeroTrainer
    args = TrainingArguments(..., deepspeed="ds_config.json")  # or ZeroTrainer(..., config="ds_config.json")
    trainer = ZeroTrainer(model=model, args=args, train_dataset=ds)

Launch with ``torchrun --nproc_per_node N`` as for any Trainer script. What the subclass owns:

- the config: a whole DeepSpeed config, from ``TrainingArguments(deepspeed=...)`` or ``config=``,
  is read as the Trainer with DeepSpeed reads it: its optimizer, scheduler, clipping and bf16
  sections, ``"auto"`` values from ``TrainingArguments`` and the model's hidden size, mismatches
  refused (``hf_config``); one log line at WARNING says where each value came from. DeepSpeed
  itself is switched off (the Trainer gets a copy of the arguments without it). With only
  ``zero_optimization=`` keys (a mapping or a ``ZeroOptions``) the rest comes from the arguments;
- the optimizer: ``ShardedFusedAdam`` with the config's optimizer over every trainable parameter,
  or without one with the arguments' ``learning_rate``, ``adam_beta1``, ``adam_beta2``,
  ``adam_epsilon`` and ``weight_decay`` (not applied to biases and norms, as the Trainer does); or
  a ``ShardedFusedAdam`` passed as ``optimizers=(opt, scheduler)`` (not with a whole config); or one sharing the
  param groups of the ``torch.optim.AdamW``/``Adam`` a ``create_optimizer`` override built (a client optimizer, as
  the Trainer with DeepSpeed takes it; not beside a config's optimizer section);
- the DDP wrap: the optimizer reduces gradients itself, so the model is prepared by Accelerate
  without ``DistributedDataParallel`` (mixed-precision autocast and device placement still apply; with a whole
  config no autocast, as Accelerate under DeepSpeed: the config's bf16 casts the model itself);
  gradient-accumulation micro-batches but the last run under ``opt.no_sync()`` (not where every micro-batch
  reduces: stages 2 and 3, ``ShardedFusedAdam.reduces_micro_steps``);
- zero_grad: the Trainer's ``model.zero_grad()`` is enough, as ``step()`` clears the optimizer's
  own gradient state;
- clipping and the logged ``grad_norm``: ``opt.clip_grad_norm_``, the global norm of the reduced
  gradients, to the config's ``gradient_clipping`` (DeepSpeed's default 1.0 when a whole config
  leaves it out), else to ``max_grad_norm``;
- saving: ``save_model`` writes full weights at stages 0-2, and at stage 3 when
  ``stage3_gather_16bit_weights_on_model_save`` is true (gathered on every rank, written by rank
  0: ``from_pretrained`` loads them). At stage 3 without it, as DeepSpeed, no weights file is
  written: the sharded checkpoint in ``<output_dir>/zero_kernels`` holds them
  (``python -m zero_kernels consolidate`` turns it into a state dict). Checkpoints
  (``save_strategy``) hold that sharded checkpoint of model and optimizer, written by every rank;
- loading: ``train(resume_from_checkpoint=...)`` restores model and optimizer from it, at any
  world size and stage;
- ``total_flos``: at stage 3 from each parameter's full size (the Trainer's count reads the freed ones as empty);
- generation in evaluation: with a ``Seq2SeqTrainer`` (``class T(ZeroTrainer, Seq2SeqTrainer)``),
  ``predict_with_generate`` at stage 3 on several ranks generates with ``synced_gpus=True`` unless given.

Not supported: fp16 (``fp16=True`` or in the config: ``ZeroTrainer`` does not drive the Trainer's
``GradScaler`` yet; use bf16 or fp32) and FSDP.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn
from transformers import Seq2SeqTrainer, Trainer, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

from .. import checkpoint
from ..config import ZeroConfig, ZeroOptions, client_optimizer
from ..config.at_updates import counting, gate
from ..optim.optimizer import ShardedFusedAdam
from ..stages import adopt
from ..stages.stage3 import generates_synced, register_external_parameter
from ..stages.stage3.consolidated import model_state_dict
from . import hf_config
from .save import agree, sharded_params

__all__ = ["ZeroTrainer", "CHECKPOINT_DIR"]

CHECKPOINT_DIR = "zero_kernels"  # inside a Trainer checkpoint folder: the sharded model + optimizer checkpoint
log = logging.getLogger("zero_kernels")


class ZeroTrainer(Trainer):
    """``transformers.Trainer`` with ZeRO-sharded AdamW; see the module docstring.

    Args:
        *args: as ``transformers.Trainer``.
        config: a whole DeepSpeed config (path of a JSON file, or a dict), read as the Trainer with
            DeepSpeed reads it (``hf_config``); or give it as ``TrainingArguments(deepspeed=...)``.
        zero_optimization: only DeepSpeed ``zero_optimization`` keys (``{"stage": 2, ...}``) or a
            ``ZeroOptions`` (the rest from ``TrainingArguments``); a whole config or its path is taken as
            ``config``. None of the three: stage 1.
        **kwargs: as ``transformers.Trainer``.
    """

    def __init__(
        self,
        *args: Any,
        config: Union[str, os.PathLike, Mapping[str, Any], None] = None,
        zero_optimization: Union[str, os.PathLike, Mapping[str, Any], ZeroOptions, None] = None,
        **kwargs: Any,
    ):
        args = list(args)
        at = _arguments_at(args)
        training_args = args[at] if at is not None else kwargs.get("args")
        self.zero_source = hf_config.find(config, zero_optimization, training_args)
        if training_args is not None:
            detached = hf_config.without_deepspeed(training_args)
            if at is not None:
                args[at] = detached
            else:
                kwargs["args"] = detached
        given = kwargs.get("optimizers", (None, None))[0]
        if given is not None and not isinstance(given, ShardedFusedAdam):
            raise ValueError(
                f"ZeroTrainer: optimizers=({type(given).__name__}, ...): pass a ShardedFusedAdam, or no optimizer "
                "(the trainer builds one from the arguments and zero_optimization)"
            )
        if given is not None:
            _check_counts_no_micro_steps(given, "optimizers=(...) holds")
            _refuse_a_group_of_some_ranks(given)
        if given is not None and self.zero_source.whole:
            raise ValueError(
                f"ZeroTrainer: optimizers=(...) and a DeepSpeed config ({self.zero_source.origin}) both say how to "
                "train: pass one (the Trainer with DeepSpeed refuses optimizers= too)"
            )
        self.zero_optimizer: Optional[ShardedFusedAdam] = given
        self.zero_given = given is not None  # optimizers=(ShardedFusedAdam, ...): the config does not build it
        self.zero_config: Optional[ZeroConfig] = None  # the config resolved when training starts
        self._zero_built = False  # this trainer's create_optimizer built the optimizer from the config
        self._sources_logged = False  # ``_log_sources`` done
        super().__init__(*args, **kwargs)
        for flag in ("fp16", "fsdp"):
            if getattr(self.args, flag):
                raise ValueError(
                    f"ZeroTrainer: TrainingArguments({flag}=...) is not supported: ZeroTrainer shards the optimizer "
                    "itself (use bf16=True or fp32 for mixed precision: it does not drive the Trainer's GradScaler yet)"
                )
        _refuse_deepspeed_partitioned(self.model)
        self._gather_policy_for_ref_sync()

    def _gather_policy_for_ref_sync(self) -> None:
        """TRL's ``sync_ref_model`` (``SyncRefModelCallback``) mixes the policy's ``p.data`` into the reference model
        every ``ref_model_sync_steps``; under DeepSpeed's ZeRO-3 it gathers the parameters first. At stage 3 the sync
        runs here inside ``gathered_params()`` (a collective: the callback runs on every rank); before, it read the
        freed, empty parameters and raised at the first sync. Run at ``__init__`` and when the optimizer is built
        (a TRL trainer first in the class adds the callback after ``ZeroTrainer.__init__``)."""
        for callback in self.callback_handler.callbacks:
            sync = getattr(callback, "sync_target_model", None)
            if type(callback).__name__ != "SyncRefModelCallback" or sync is None or isinstance(sync, functools.partial):
                continue
            callback.sync_target_model = functools.partial(_synced_gathered, self, callback.sync_target_model)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """As the Trainer's; the optimizer built for the model it replaces comes off that model and goes, with the
        resolved config (a hyper-parameter search trial may change the arguments), so that ``train()`` builds them
        again for the new model (the Trainer drops ``self.optimizer`` there; the second ``train()`` stepped the
        first model's parameters).

        Args:
            trial: as ``Trainer.call_model_init``.
        """
        model = super().call_model_init(trial)
        if self.zero_optimizer is not None and not self.zero_given:
            self.zero_optimizer._detach()
            self.zero_optimizer, self.zero_config = None, None
            self._zero_built = self._sources_logged = False
        return model

    @property
    def zero_options(self) -> ZeroOptions:
        """The ``zero_optimization`` options: the optimizer's, once it exists."""
        if self.zero_optimizer is not None:
            return self.zero_optimizer.options
        return self._resolved_config().zero

    # ---------------------------------------------------------------- optimizer and DDP
    def create_accelerator_and_postprocess(self) -> None:
        """As the Trainer's, with Accelerate preparing the model without a DDP wrapper (nor DeepSpeed)."""
        hf_config.accelerate_without_deepspeed()
        super().create_accelerator_and_postprocess()
        if self.zero_source.whole:
            # as Accelerate under DeepSpeed: the config says the precision (bf16 weights), no autocast around forwards
            self.accelerator.native_amp = False
        prepare_model = self.accelerator.prepare_model

        def prepare_without_ddp(model: nn.Module, device_placement: Optional[bool] = None, evaluation_mode=False):
            return prepare_model(model, device_placement=device_placement, evaluation_mode=True)

        self.accelerator.prepare_model = prepare_without_ddp

    def create_optimizer(self, model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
        """Build the ``ShardedFusedAdam`` (once), from the config's optimizer section or from the arguments; or take
        the optimizer a subclass set before calling this, or the one ``optimizer_cls_and_kwargs`` builds
        (``_adopt``).

        Args:
            model: the model (default: ``self.model``).
        """
        source = "a create_optimizer override"
        if self.zero_optimizer is None and self.optimizer is None and self.optimizer_cls_and_kwargs is not None:
            super().create_optimizer(model)  # the Trainer's groups with the class and kwargs given
            source = "optimizer_cls_and_kwargs"
        if self.zero_optimizer is None and self.optimizer is not None:  # or set by a subclass, which then calls this
            self.zero_optimizer = self._adopt(self.optimizer, self.model if model is None else model, source)
        if self.zero_optimizer is None:
            model = self.model if model is None else model
            config = self._resolved_config()
            self._cast(model, config)
            groups, hyper = self._groups(model, config)
            self.zero_optimizer = ShardedFusedAdam(groups, module=model, **hyper, **config.sharded_options())
            self._zero_built = True
        self.optimizer = self.zero_optimizer
        self._gather_head_for_fused_loss(self.model if model is None else model)
        self._gather_policy_for_ref_sync()
        return self.optimizer

    def _cast(self, model: nn.Module, config: ZeroConfig) -> None:
        """The model in the precision the config trains it in, before its optimizer is built: bf16 weights for a whole
        config with bf16 (as DeepSpeed; the fp32 master weights are the optimizer's), and a TRL trainer's
        ``ref_model`` with it (TRL's ``prepare_deepspeed`` gives it the same config: kept in fp32 it differed from the
        bf16 policy it starts as); fp16 refused."""
        if config.fp16.enabled:
            raise ValueError(
                f"ZeroTrainer: fp16 is enabled in {self.zero_source.origin}: the Trainer's loop cannot apply "
                "zero_kernels' loss scaling; use bf16 (or fp32)"
            )
        if config.bf16 and self.zero_source.whole:
            _parameters_to_bf16(model)
            ref = getattr(self, "ref_model", None)  # TRL's reference model: DeepSpeed casts it with the same config
            if isinstance(ref, nn.Module) and ref is not model:
                _parameters_to_bf16(ref)

    def _groups(self, model: nn.Module, config: ZeroConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Param groups and hyper-parameters: the config's optimizer over every trainable parameter (as
        DeepSpeed), else the Trainer's AdamW without weight decay on biases and norms."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        opt = config.optimizer if self.zero_source.whole else None
        if opt is not None:
            hyper = dict(lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay)
            hyper.update(amsgrad=opt.amsgrad, maximize=opt.maximize)
            return [{"params": [p for _, p in named]}], {**hyper, "adam_w_mode": opt.adamw}
        check_optim(self.args.optim)
        decay = set(self.get_decay_parameter_names(model))
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        hyper = dict(lr=self.args.learning_rate, betas=(self.args.adam_beta1, self.args.adam_beta2))
        return [g for g in groups if g["params"]], {**hyper, "eps": self.args.adam_epsilon}

    def create_scheduler(
        self, num_training_steps: int, optimizer: Optional[torch.optim.Optimizer] = None
    ) -> torch.optim.lr_scheduler.LRScheduler:
        """The config's scheduler section when it has one (DeepSpeed's schedules), else the Trainer's; either
        advances only after an applied update, as DeepSpeed's engine steps it: the Trainer skips its
        ``lr_scheduler.step()`` on a step Accelerate's GradScaler skipped, not on one this optimizer skipped for
        inf/NaN gradients (``at_updates``). A scheduler passed in ``optimizers=`` is left as given.

        Args:
            num_training_steps: as ``Trainer.create_scheduler``.
            optimizer: as ``Trainer.create_scheduler``.
        """
        if self.optimizer is not None:
            self._sharded()  # a torch AdamW a create_optimizer override built is replaced before a scheduler uses it
        config = self._resolved_config()
        if self.lr_scheduler is None and self.zero_source.whole and config.scheduler is not None:
            self.lr_scheduler = config.scheduler.build(self.optimizer if optimizer is None else optimizer)
            self._created_lr_scheduler = True
        else:
            created = self.lr_scheduler is None
            scheduler = super().create_scheduler(num_training_steps, optimizer)
            if created and _gateable(scheduler):
                self.lr_scheduler = gate(scheduler)
        self._log_sources()
        return self.lr_scheduler

    def _resolved_config(self) -> ZeroConfig:
        """The config with its ``"auto"`` values filled, kept once the training length is known."""
        if self.zero_config is not None:
            return self.zero_config
        steps = self.state.max_steps or self.args.max_steps
        steps = steps if steps and steps > 0 else None
        config = hf_config.resolve(self.zero_source, self.args, self.model, steps)
        if steps is not None:  # known once training starts: before, nothing is kept
            self.zero_config = config
        return config

    def _log_sources(self) -> None:
        """Log, once, where each value came from (``hf_config.describe``): after ``create_scheduler``, when the
        optimizer is known (given, built here from the config, or by a ``create_optimizer`` override)."""
        if self._sources_logged or self.zero_config is None or self.optimizer is None:
            return
        self._sources_logged = True
        where = (self.zero_source, self.zero_config, self.args, self.model, self.state.max_steps or self.args.max_steps)
        if self._zero_built:
            log.warning("%s", hf_config.describe(*where))
        else:
            by = "optimizers=" if self.zero_given else "create_optimizer"
            log.warning("%s", hf_config.describe(*where, (self._sharded(), self.lr_scheduler), by))

    def _sharded(self) -> ShardedFusedAdam:
        """The ``ShardedFusedAdam`` this trainer steps: the one it built, or the one a subclass's own
        ``create_optimizer`` built, or made from the ``torch.optim.AdamW``/``Adam`` it built (``_adopt``), put in
        its place inside Accelerate's wrapper."""
        if self.zero_optimizer is None:
            wrapper = self.optimizer
            built = getattr(wrapper, "optimizer", wrapper)  # Accelerate's wrapper holds it
            self.zero_optimizer = self._adopt(built, self.model)
            self._gather_head_for_fused_loss(self.model)
            if wrapper is built:
                self.optimizer = self.zero_optimizer
            else:
                wrapper.optimizer = self.zero_optimizer
        return self.zero_optimizer

    def _gather_head_for_fused_loss(self, model: nn.Module) -> None:
        """Stage 3, under a trainer whose loss reads the output embeddings' parameters in the model's forward
        without calling that module (TRL's trainers' fused LM-head loss, ``use_liger_kernel``): those parameters are
        registered for the model (``register_external_parameter``), as TRL gathers them under DeepSpeed's ZeRO-3.
        Unregistered they are empty there, and a kernel that reads only their shape computes a loss of nothing: no
        error, and nothing trains."""
        reason = _fused_loss(self)
        if self.zero_optimizer is None or self.zero_optimizer.options.stage != 3 or not reason:
            return
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT's wrapper
        head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
        if head is None:
            return
        for name, parameter in head.named_parameters():
            register_external_parameter(inner, parameter)
            log.info(
                "ZeroTrainer: stage 3: %s.%s is gathered for %s's forward, where %s reads it without calling %s",
                type(head).__name__, name, type(inner).__name__, reason, type(head).__name__,
            )  # fmt: skip

    def _adopt(self, built: Any, model: nn.Module, source: str = "a create_optimizer override") -> ShardedFusedAdam:
        """The ``ShardedFusedAdam`` to train with, given the optimizer ``source`` built: itself, or one sharing the
        param groups of a ``torch.optim.AdamW``/``Adam`` (a client optimizer, as the Trainer with DeepSpeed hands
        the one ``create_optimizer`` built to ``deepspeed.initialize``: its groups' lrs, LoRA+'s among them, are
        kept); ``TypeError`` for any other optimizer."""
        if isinstance(built, ShardedFusedAdam):
            _check_counts_no_micro_steps(built, "create_optimizer built")
            return built
        if type(built) not in client_optimizer.CLIENT_CLASSES:
            raise TypeError(
                f"ZeroTrainer: the optimizer ({type(built).__name__}) that {source} builds is not taken: it must be "
                "a torch.optim.AdamW or Adam (its param groups are kept) or a zk.ShardedFusedAdam (module=self.model "
                "at stage 3)"
            )
        config = self._resolved_config()
        if self.zero_source.whole and config.optimizer is not None:
            raise ValueError(
                f"ZeroTrainer: {source} builds torch.optim.{type(built).__name__} and {self.zero_source.origin} has "
                'an "optimizer" section: both say how to train (the Trainer with DeepSpeed would take the section and '
                "drop the optimizer built, its param groups with it): remove the section, or build no optimizer"
            )
        self._cast(model, config)
        restore = client_optimizer.keep(built)
        try:
            sharded = ShardedFusedAdam(
                client_optimizer.groups(built),
                module=model,
                **client_optimizer.hyper(built),
                **config.sharded_options(),
            )
        except BaseException:
            restore()
            raise
        client_optimizer.adopt_state(built, sharded)
        client_optimizer.retire(built, sharded)
        return sharded

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """As the Trainer's; micro-batches before the last of an accumulation step do not communicate, but where
        the optimizer adds them up reduced (``reduces_micro_steps``: stages 2 and 3), as the Trainer with DeepSpeed
        does."""
        opt = self._sharded()
        local = not self.accelerator.sync_gradients and not opt.reduces_micro_steps
        with opt.no_sync() if local else contextlib.nullcontext():
            return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: Optional[list[str]] = None,
        **gen_kwargs: Any,
    ) -> Any:
        """As the Trainer's. A ``Seq2SeqTrainer`` generating (``predict_with_generate``) passes ``synced_gpus``
        itself, False outside DeepSpeed and FSDP: where stage 3 syncs the model's ``generate`` (on several ranks)
        it is True unless given, or ranks whose generations differ in length hang."""
        if self._generates_synced(prediction_loss_only):
            gen_kwargs = dict(gen_kwargs or getattr(self, "_gen_kwargs", {}))
            if gen_kwargs.get("synced_gpus") is None:
                gen_kwargs["synced_gpus"] = True
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)

    def _generates_synced(self, prediction_loss_only: bool) -> bool:
        generating = isinstance(self, Seq2SeqTrainer) and getattr(self.args, "predict_with_generate", False)
        return generating and not prediction_loss_only and generates_synced(self.model)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """As the Trainer's (``total_flos``), from each parameter's full size at stage 3: the Trainer's count reads
        ``numel()``, which is 0 for a parameter freed between uses (only the persistent ones counted).

        Args:
            inputs: as ``Trainer.floating_point_ops``.
        """
        main = getattr(self.model, "main_input_name", "input_ids")
        opt = self.zero_optimizer
        if opt is None or opt.options.stage != 3 or main not in inputs or not hasattr(self.model, "num_parameters"):
            return super().floating_point_ops(inputs)
        return 6 * inputs[main].numel() * _full_parameter_count(self.model)

    # ---------------------------------------------------------------- clipping
    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self._clip()

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return self._clip() if grad_norm is None else grad_norm

    def _clip(self) -> torch.Tensor:
        """Clip to the config's gradient_clipping (a whole config), else to max_grad_norm; the norm before."""
        limit = hf_config.clipping(self.zero_source, self._resolved_config(), self.args)
        return self._sharded().clip_grad_norm_(float("inf") if limit is None else limit)

    # ---------------------------------------------------------------- saving and loading
    def _gathers_on_save(self) -> bool:
        return self.zero_options.stage < 3 or self.zero_options.stage3_gather_16bit_weights_on_model_save

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Write the model for ``from_pretrained`` (a collective: every rank calls it); see the module docstring.

        Args:
            output_dir: where (default: ``args.output_dir``).
            _internal_call: set by the Trainer's own checkpointing.
        """
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if self.zero_optimizer is None:  # not trained yet: nothing is sharded
            super().save_model(output_dir, _internal_call)
            return
        if self._gathers_on_save():
            ok = False
            try:
                if sharded_params(self.zero_optimizer):  # a unit at a time, into the writer's host memory
                    state = model_state_dict(self.zero_optimizer.pipeline, self.model, keep=self.args.should_save)
                    self._save(output_dir, state_dict=state)
                else:
                    with self.zero_optimizer.gathered_params():
                        self._save(output_dir)
                ok = True
            finally:
                agree(self.zero_optimizer, ok, "save_model")
        else:
            warnings.warn(
                "ZeroTrainer.save_model at stage 3 with stage3_gather_16bit_weights_on_model_save=false writes no "
                f"weights file: they are in the sharded checkpoint {os.path.join(output_dir, CHECKPOINT_DIR)} "
                "(python -m zero_kernels consolidate DIR OUT.pt gives a state dict); set the key to true for "
                "from_pretrained",
                stacklevel=2,
            )
            if self.args.should_save:
                os.makedirs(output_dir, exist_ok=True)
                if hasattr(self.model, "config"):
                    self.model.config.save_pretrained(output_dir)
            if not _internal_call or self.args.save_only_model:
                checkpoint.save(os.path.join(output_dir, CHECKPOINT_DIR), self.model, self.zero_optimizer)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        checkpoint.save(os.path.join(output_dir, CHECKPOINT_DIR), self.model, self.zero_optimizer)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[nn.Module] = None) -> None:
        if os.path.isdir(os.path.join(resume_from_checkpoint, CHECKPOINT_DIR)):
            return  # the sharded checkpoint restores the model with the optimizer
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's sharded checkpoint restores the model (with the
        optimizer, as DeepSpeed's engine does), at every stage; without one, the Trainer's own load."""
        best = self.state.best_model_checkpoint
        if self.zero_optimizer is None or not best or not os.path.isdir(os.path.join(best, CHECKPOINT_DIR)):
            super()._load_best_model()
            return
        log.info("ZeroTrainer: loading the best model from %s (score: %s)", best, self.state.best_metric)
        self._load_sharded(os.path.join(best, CHECKPOINT_DIR))

    def _load_sharded(self, sharded: str) -> None:
        """Model and optimizer from the sharded checkpoint ``sharded``."""
        pipeline = self.zero_optimizer.pipeline
        adopt.follow_replaced(pipeline, pipeline.name_of)  # Accelerate's model.to(device) copied the parameters
        checkpoint.load(sharded, self.model, self.zero_optimizer)

    def _load_optimizer_and_scheduler(self, checkpoint_dir: Optional[str]) -> None:
        if checkpoint_dir is None:
            return
        sharded = os.path.join(checkpoint_dir, CHECKPOINT_DIR)
        optimizer_file = os.path.join(checkpoint_dir, OPTIMIZER_NAME)
        if not os.path.isdir(sharded) and os.path.isfile(optimizer_file):
            # the Trainer's own checkpoint (DDP or one process): torch.optim.AdamW's state dict, whole on every rank,
            # in the layout load_state_dict takes at any stage; its groups are the ones built here from the arguments
            log.info("ZeroTrainer: resuming the optimizer from the Trainer's %s", optimizer_file)
            state = torch.load(optimizer_file, map_location="cpu", weights_only=True)
            saved = state.get("param_groups", [])
            kept = list(range(len(saved)))
            if len(saved) != len(self.zero_optimizer.param_groups):
                # the Trainer keeps an empty group (LoRA: nothing without weight decay), the groups built here do not
                kept = [i for i, g in enumerate(saved) if g["params"]]
                state = {**state, "param_groups": [saved[i] for i in kept]}
            try:
                self.zero_optimizer.load_state_dict(state)
            except ValueError as e:
                raise ValueError(
                    f"ZeroTrainer: {optimizer_file} (the Trainer's AdamW state) does not fit this optimizer's param "
                    f"groups ({e}); build it as the Trainer did (no optimizer section in the config), or resume the "
                    "model only: load its weights with from_pretrained and train without resume_from_checkpoint"
                ) from e
            self._load_scheduler(checkpoint_dir, kept if len(kept) != len(saved) else None, len(saved))
            return
        if not os.path.isdir(sharded) and os.path.isfile(os.path.join(checkpoint_dir, "latest")):
            raise ValueError(
                f"ZeroTrainer: {checkpoint_dir} is a checkpoint of the Trainer with DeepSpeed (its optimizer state is "
                "in the DeepSpeed checkpoint named by its 'latest' file), which ZeroTrainer does not read in place: "
                f"python -m zero_kernels import-deepspeed {checkpoint_dir} OUT_DIR writes a zero_kernels checkpoint "
                "of it; load that with zk.checkpoint.load before training, or resume from a ZeroTrainer checkpoint"
            )
        if not os.path.isdir(sharded) and _holds_weights(checkpoint_dir):
            warnings.warn(
                f"ZeroTrainer: {checkpoint_dir} holds the model's weights but no optimizer state (saved with "
                "save_only_model=True?): the model resumes from them, the optimizer and scheduler start afresh, as "
                "the Trainer does",
                stacklevel=2,
            )
            return
        if not os.path.isdir(sharded):
            raise ValueError(
                f"ZeroTrainer: {checkpoint_dir} has no {CHECKPOINT_DIR}/ sharded checkpoint; it was not written by "
                "ZeroTrainer, so the optimizer state cannot be restored"
            )
        self._load_sharded(sharded)
        self._load_scheduler(checkpoint_dir)

    def _load_scheduler(self, checkpoint_dir: str, kept: Optional[list[int]] = None, groups: int = 0) -> None:
        """``scheduler.pt``; ``kept``: the saved param groups kept (of ``groups``), whose per-group lists stay."""
        scheduler = os.path.join(checkpoint_dir, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            state = torch.load(scheduler, weights_only=True)
            if kept is not None:
                state = {k: [v[i] for i in kept] if isinstance(v, list) and len(v) == groups else v
                         for k, v in state.items()}  # fmt: skip
            self.lr_scheduler.load_state_dict(state)


ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused", "adamw_torch_xla",
                "adamw_torch_npu_fused")  # TrainingArguments.optim values that are plain AdamW  # fmt: skip


def _synced_gathered(trainer: "ZeroTrainer", sync: Any, model: nn.Module, target: nn.Module, alpha: float) -> None:
    """TRL's reference-model sync, the policy gathered at stage 3 (``_gather_policy_for_ref_sync``)."""
    opt = trainer.zero_optimizer
    held = opt.gathered_params() if opt is not None and opt.options.stage == 3 else contextlib.nullcontext()
    with held:
        sync(model, target, alpha)


def _parameters_to_bf16(model: nn.Module) -> None:
    """The parameters in bf16, the buffers left in their dtype (rotary ``inv_freq`` stays fp32), as DeepSpeed 0.19 casts
    a module for a bf16 config; ``model.to(torch.bfloat16)`` cast the buffers too, which moved a Llama's rotary angles
    off DeepSpeed's."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            parameter.data = parameter.data.to(torch.bfloat16)


def _fused_loss(trainer: Trainer) -> str:
    """What reads the output embeddings' parameters in the model's forward without calling that module, in words
    ("" where nothing does): TRL's trainers (their fused LM-head loss) or the Trainer's ``use_liger_kernel``."""
    trl = next((c.__name__ for c in type(trainer).__mro__ if c.__module__.split(".")[0] == "trl"), None)
    if trl is not None:
        return f"TRL's {trl} (its fused LM-head loss)"
    return "use_liger_kernel (Liger's fused cross-entropy)" if getattr(trainer.args, "use_liger_kernel", False) else ""


def _arguments_at(args: list[Any]) -> Optional[int]:
    """Where the ``TrainingArguments`` are among a trainer's positional arguments (None: not there): second for
    the Trainer, third for TRL's ``DPOTrainer(model, ref_model, args)`` and ``GRPOTrainer(model, reward_funcs,
    args)`` in a class that puts ``ZeroTrainer`` first."""
    return next((i for i, value in enumerate(args) if isinstance(value, TrainingArguments)), None)


def _refuse_a_group_of_some_ranks(opt: ShardedFusedAdam) -> None:
    """The Trainer saves its model and checkpoints on the job's rank 0 only: an optimizer on a ``process_group`` of
    some of the ranks would train the other groups' models and never write them."""
    engine = opt.pipeline.engine
    if not engine.distributed or engine.world_size == torch.distributed.get_world_size():
        return
    raise ValueError(
        f"ZeroTrainer: optimizers=(...) holds a ShardedFusedAdam on a process_group of some of the ranks (global "
        f"ranks {list(engine.global_ranks)} of {torch.distributed.get_world_size()}): the Trainer saves the model and "
        "its checkpoints on global rank 0 only, so the other groups' models would never be written. Build it on "
        "every rank's default group, or train each group in a loop of your own (zk.initialize(..., "
        "process_group=...)) and save with zk.checkpoint.save or zk.save_pretrained, one directory per group"
    )


def _check_counts_no_micro_steps(opt: ShardedFusedAdam, where: str) -> None:
    """``ValueError`` for an optimizer that counts accumulation micro-steps itself: the Trainer counts them
    (``TrainingArguments.gradient_accumulation_steps``) and steps the optimizer once per window."""
    if opt.gradient_accumulation_steps > 1:
        raise ValueError(
            f"ZeroTrainer: {where} a ShardedFusedAdam with gradient_accumulation_steps="
            f"{opt.gradient_accumulation_steps}: the Trainer counts the micro-steps itself "
            "(TrainingArguments.gradient_accumulation_steps) and steps the optimizer once per window; build the "
            "optimizer without gradient_accumulation_steps"
        )


def check_optim(optim: Any) -> None:
    """``ValueError`` unless ``TrainingArguments.optim`` is plain AdamW, which ``ShardedFusedAdam`` is."""
    name = str(getattr(optim, "value", optim))
    if name not in ADAMW_OPTIMS:
        raise ValueError(
            f"ZeroTrainer: TrainingArguments(optim={name!r}): ZeroTrainer trains with ShardedFusedAdam (AdamW); "
            f"allowed: {', '.join(ADAMW_OPTIMS)}, or give the config an optimizer section (Adam/AdamW)"
        )


def _full_parameter_count(model: nn.Module) -> int:
    """``num_parameters(exclude_embeddings=True)`` of a Hugging Face model with stage 3's full sizes (``ds_numel``)."""
    embeddings = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, nn.Embedding)}
    params = (p for name, p in model.named_parameters() if name not in embeddings)
    return sum(getattr(p, "ds_numel", p.numel()) for p in params)


def _holds_weights(checkpoint_dir: str) -> bool:
    """Whether ``checkpoint_dir`` holds a model's weights file as the Trainer writes them (one file or an index)."""
    names = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")
    return any(os.path.isfile(os.path.join(checkpoint_dir, name)) for name in names)


def _gateable(scheduler: Any) -> bool:
    """Whether the Trainer's ``scheduler`` steps per update on a ``ShardedFusedAdam``, which ``train()`` has wrapped
    in Accelerate's optimizer by then (ReduceLROnPlateau steps on metrics: the Trainer leaves it out of the
    per-update call)."""
    return (
        isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)
        and not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        and isinstance(counting(scheduler.optimizer), ShardedFusedAdam)
    )


def _refuse_deepspeed_partitioned(model: Optional[nn.Module]) -> None:
    """A model whose parameters DeepSpeed ZeRO-3 partitioned cannot be trained here: say why and what to do."""
    if model is not None and any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ValueError(
            "ZeroTrainer: the model's parameters were partitioned by DeepSpeed ZeRO-3 (from_pretrained does that "
            "while a TrainingArguments(deepspeed=<a stage-3 config>) exists): load the model before building the "
            "TrainingArguments, or give the config as ZeroTrainer(config=...) instead of in TrainingArguments"
        )
