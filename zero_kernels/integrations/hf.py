"""``ZeroTrainer``: the Hugging Face ``transformers.Trainer`` training with ``ShardedFusedAdam`` (stages 0-3).

Needs ``transformers`` and ``accelerate`` (``pip install 'zero_kernels[hf]'``). The two lines a
script changes::

    from zero_kernels.integrations.hf import ZeroTrainer
    trainer = ZeroTrainer(model=model, args=args, train_dataset=ds, zero_optimization={"stage": 3})

Launch with ``torchrun --nproc_per_node N`` as for any Trainer script. What the subclass owns:

- the optimizer: ``ShardedFusedAdam`` with the arguments' ``learning_rate``, ``adam_beta1``,
  ``adam_beta2``, ``adam_epsilon`` and ``weight_decay`` (not applied to biases and norms, as the
  Trainer does), and the ``zero_optimization`` keys given (a mapping, or ``ZeroOptions``); or a
  ``ShardedFusedAdam`` passed as ``optimizers=(opt, scheduler)``;
- the DDP wrap: the optimizer reduces gradients itself, so the model is prepared by Accelerate
  without ``DistributedDataParallel`` (mixed-precision autocast and device placement still apply);
  gradient-accumulation micro-batches but the last run under ``opt.no_sync()``;
- zero_grad: the Trainer's ``model.zero_grad()`` is enough, as ``step()`` clears the optimizer's
  own gradient state;
- clipping and the logged ``grad_norm``: ``opt.clip_grad_norm_(max_grad_norm)``, the global norm of
  the reduced gradients (``clip_grad_norm_`` on the model sees none at stages 2-3);
- saving: ``save_model`` writes full weights at stages 0-2, and at stage 3 when
  ``stage3_gather_16bit_weights_on_model_save`` is true (gathered on every rank, written by rank
  0: ``from_pretrained`` loads them). At stage 3 without it, as DeepSpeed, no weights file is
  written: the sharded checkpoint in ``<output_dir>/zero_kernels`` holds them
  (``python -m zero_kernels consolidate`` turns it into a state dict). Checkpoints
  (``save_strategy``) hold that sharded checkpoint of model and optimizer, written by every rank;
- loading: ``train(resume_from_checkpoint=...)`` restores model and optimizer from it, at any
  world size and stage.

Not supported: ``fp16=True`` (``ZeroTrainer`` does not drive the Trainer's ``GradScaler`` yet; use
``bf16=True`` or fp32), ``deepspeed=...`` and FSDP (``ZeroTrainer`` replaces them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import warnings
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME

from .. import checkpoint
from ..config import ZeroOptions
from ..optim import ShardedFusedAdam
from ..stages import adopt
from . import agree

__all__ = ["ZeroTrainer", "CHECKPOINT_DIR"]

CHECKPOINT_DIR = "zero_kernels"  # inside a Trainer checkpoint folder: the sharded model + optimizer checkpoint
log = logging.getLogger("zero_kernels")


def _options(zero_optimization: Union[Mapping[str, Any], ZeroOptions, None]) -> ZeroOptions:
    if zero_optimization is None:
        return ZeroOptions(stage=1)
    if isinstance(zero_optimization, ZeroOptions):
        return zero_optimization
    if not isinstance(zero_optimization, Mapping):
        raise ValueError(
            "ZeroTrainer: zero_optimization must be a mapping of DeepSpeed zero_optimization keys or a ZeroOptions, "
            f"got {type(zero_optimization).__name__}"
        )
    return ZeroOptions.from_dict(zero_optimization)


class ZeroTrainer(Trainer):
    """``transformers.Trainer`` with ZeRO-sharded AdamW; see the module docstring.

    Args:
        *args: as ``transformers.Trainer``.
        zero_optimization: DeepSpeed ``zero_optimization`` keys (``{"stage": 2, ...}``) or a ``ZeroOptions``;
            None: stage 1.
        **kwargs: as ``transformers.Trainer``.
    """

    def __init__(self, *args: Any, zero_optimization: Union[Mapping[str, Any], ZeroOptions, None] = None, **kwargs):
        self.zero_options = _options(zero_optimization)
        given = kwargs.get("optimizers", (None, None))[0]
        if given is not None and not isinstance(given, ShardedFusedAdam):
            raise ValueError(
                f"ZeroTrainer: optimizers=({type(given).__name__}, ...): pass a ShardedFusedAdam, or no optimizer "
                "(the trainer builds one from the arguments and zero_optimization)"
            )
        self.zero_optimizer: Optional[ShardedFusedAdam] = given
        super().__init__(*args, **kwargs)
        for flag in ("fp16", "deepspeed", "fsdp"):
            if getattr(self.args, flag):
                raise ValueError(
                    f"ZeroTrainer: TrainingArguments({flag}=...) is not supported: ZeroTrainer shards the optimizer "
                    "itself (use bf16=True or fp32 for mixed precision: it does not drive the Trainer's GradScaler yet)"
                )

    # ---------------------------------------------------------------- optimizer and DDP
    def create_accelerator_and_postprocess(self) -> None:
        """As the Trainer's, with Accelerate preparing the model without a DDP wrapper."""
        super().create_accelerator_and_postprocess()
        prepare_model = self.accelerator.prepare_model

        def prepare_without_ddp(model: nn.Module, device_placement: Optional[bool] = None, evaluation_mode=False):
            return prepare_model(model, device_placement=device_placement, evaluation_mode=True)

        self.accelerator.prepare_model = prepare_without_ddp

    def create_optimizer(self, model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
        """Build the ``ShardedFusedAdam`` (once), with the Trainer's weight-decay groups.

        Args:
            model: the model (default: ``self.model``).
        """
        if self.zero_optimizer is None:
            model = self.model if model is None else model
            decay = set(self.get_decay_parameter_names(model))
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [
                {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
            ]
            options = {f.name: getattr(self.zero_options, f.name) for f in dataclasses.fields(ZeroOptions)}
            self.zero_optimizer = ShardedFusedAdam(
                [g for g in groups if g["params"]],
                lr=self.args.learning_rate,
                betas=(self.args.adam_beta1, self.args.adam_beta2),
                eps=self.args.adam_epsilon,
                module=model,
                **options,
            )
        self.optimizer = self.zero_optimizer
        return self.optimizer

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """As the Trainer's; micro-batches before the last of an accumulation step do not communicate."""
        sync = self.accelerator.sync_gradients
        with self.zero_optimizer.no_sync() if not sync else contextlib.nullcontext():
            return super().training_step(model, inputs, num_items_in_batch)

    # ---------------------------------------------------------------- clipping
    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self.zero_optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return self.zero_optimizer.clip_grad_norm_(float("inf")) if grad_norm is None else grad_norm

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

    def _load_optimizer_and_scheduler(self, checkpoint_dir: Optional[str]) -> None:
        if checkpoint_dir is None:
            return
        sharded = os.path.join(checkpoint_dir, CHECKPOINT_DIR)
        if not os.path.isdir(sharded):
            raise ValueError(
                f"ZeroTrainer: {checkpoint_dir} has no {CHECKPOINT_DIR}/ sharded checkpoint; it was not written by "
                "ZeroTrainer, so the optimizer state cannot be restored"
            )
        pipeline = self.zero_optimizer.pipeline
        adopt.follow_replaced(pipeline, pipeline.name_of)  # Accelerate's model.to(device) copied the parameters
        checkpoint.load(sharded, self.model, self.zero_optimizer)
        scheduler = os.path.join(checkpoint_dir, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
