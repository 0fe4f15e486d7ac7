"""``ZeroAccelerator``: Hugging Face Accelerate's ``Accelerator`` for models trained by ``ShardedFusedAdam``.

Needs ``accelerate`` (``pip install 'zero_kernels[hf]'``). The loop of any Accelerate script, with
one name changed::

    from zero_kernels.integrations.accelerate import ZeroAccelerator

    accelerator = ZeroAccelerator()  # takes Accelerator's arguments
    model.to(accelerator.device)  # first: the optimizer keeps its buffers on the parameters' device
    opt = zk.ShardedFusedAdam(model.parameters(), lr=3e-4, stage=2)  # stage 3: ShardedFusedAdam(model, ...)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()

What differs from ``Accelerator``, only for a model holding parameters that a live
``ShardedFusedAdam`` trains (build the optimizer after the ``ZeroAccelerator`` and before ``prepare``;
any other model is prepared as usual):

- ``prepare_model`` does not wrap it in ``DistributedDataParallel`` (the optimizer reduces the
  gradients itself; DDP would reduce them again), as ``ZeroTrainer`` does for the Trainer; device
  placement, mixed-precision autocast and ``torch.compile`` still apply;
- ``prepare`` refuses a ``ShardedFusedAdam`` that counts accumulation micro-steps itself (its
  ``gradient_accumulation_steps``) when the Accelerator counts them too: keep the count in one place;
- ``no_sync(model)``, which ``accumulate(model)`` enters for every micro-batch but the last, also
  enters the optimizer's ``no_sync()``: those backward passes accumulate locally (not where every micro-batch
  reduces, as DeepSpeed's: stages 2 and 3, ``ShardedFusedAdam.reduces_micro_steps``);
- ``backward(loss)``, for a prepared ``ShardedFusedAdam`` with fp16 loss scaling (its ``fp16`` config),
  divides the loss by Accelerate's accumulation steps, as Accelerate's, and runs ``opt.backward`` (which
  scales it; a plain ``loss.backward()`` is refused there); any other loss goes to Accelerate's;
- ``step()`` of a prepared ``ShardedFusedAdam`` without a GradScaler tells the wrapper whether the optimizer skipped
  the update (an fp16 overflow, inf/NaN gradients): ``step_was_skipped`` is then true and a prepared
  scheduler does not step, as Accelerate under DeepSpeed holds it;
- with a ``GradScaler`` (``mixed_precision="fp16"`` where Accelerate makes one: on a GPU), the step that Accelerate's
  wrapper hands it shows ``opt.step``'s signature (Accelerate's hides it, and the scaler then passes the scale as
  attributes, which the optimizer refuses), so the scaler passes itself: the step unscales and skips on every
  rank together (``amp``), and ``step_was_skipped`` says whether it updated (an Accelerate-prepared scheduler
  does not step on a skipped step);
- ``clip_grad_norm_(model.parameters(), max_norm)`` tells the optimizer of Accelerate's GradScaler (so that the
  first step's norm is the unscaled one too), unscales as Accelerate's, then calls torch's ``clip_grad_norm_``:
  for these parameters that is ``opt.clip_grad_norm_`` (``torch_clip``), the global norm of the reduced
  gradients, applied by the next step. (Accelerate's own, from 1.16, keeps
  only the parameters whose ``p.grad`` is set, which stages 2 and 3 leave ``None``: it would return 0
  and clip nothing.)
- ``get_state_dict(model)``, and so ``save_model(model, directory)``, returns a copy of every tensor
  of the state dict, taken inside the optimizer's ``gathered_params()`` (at stage 3 the full
  weights, in the writing process's host memory, gathered a unit at a time as DeepSpeed's ZeRO-3 does: a
  collective, call it on every rank; an empty state dict on the other processes, as Accelerate's under FSDP, so
  that ``save_pretrained(..., is_main_process=..., state_dict=accelerator.get_state_dict(model))`` on every rank
  writes nothing there); tied weights stay one tensor. Accelerate's own
  returns the parameters, views into the optimizer's flat buffer at stages 0-2, and its ``save_model`` then keeps
  one tensor per storage: one of the model's weights.

An optimizer built before the ``ZeroAccelerator`` (which starts the process group) has no group: a
world of one rank, which never reduces gradients across processes. ``prepare`` refuses it, naming
the order to use, where Accelerate runs several processes.

With a plain ``Accelerator`` on several processes the model is wrapped in DDP, and its first
forward raises an error that names ``ZeroAccelerator`` (``guards``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from accelerate import Accelerator
from torch import nn

from .. import live
from ..optim import ShardedFusedAdam
from ..optim.torch_clip import clip_sharded
from ..stages.stage3.consolidated import model_state_dict
from .save import sharded_params

__all__ = ["ZeroAccelerator"]


class ZeroAccelerator(Accelerator):
    """``accelerate.Accelerator`` that leaves models trained by a ``ShardedFusedAdam`` unwrapped; see the
    module docstring. Takes ``Accelerator``'s arguments."""

    def prepare_model(
        self, model: nn.Module, device_placement: Optional[bool] = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """As ``Accelerator.prepare_model``, without the DDP wrap for a model a ``ShardedFusedAdam`` trains.

        Args:
            model: the model.
            device_placement: as ``Accelerator.prepare_model``.
            evaluation_mode: as ``Accelerator.prepare_model``.
        """
        optimizers = live.training(model.parameters())
        for opt in optimizers:
            self._check_world(opt)
        if optimizers:
            evaluation_mode = True  # Accelerate's switch that leaves out the DDP/FSDP wrap, and nothing else
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Optional[bool] = None) -> Any:
        """As ``Accelerator.prepare_optimizer``; a ``ShardedFusedAdam`` must span Accelerate's processes.

        Args:
            optimizer: the optimizer.
            device_placement: as ``Accelerator.prepare_optimizer``.
        """
        ours = optimizer in live.optimizers()
        if ours:
            self._check_world(optimizer)
            self._check_accumulation(optimizer)
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        if ours and getattr(prepared, "scaler", None) is not None:
            prepared._optimizer_patched_step_method = _scaled_step(prepared, optimizer)
        elif ours:
            prepared.step = _reporting_skips(prepared, optimizer)
        return prepared

    def _check_accumulation(self, optimizer: Any) -> None:
        """``ValueError`` when both Accelerate and ``optimizer`` count accumulation micro-steps: Accelerate steps
        the optimizer only on the last micro-batch of its window, which the optimizer would count as one of its
        own (each update would span both counts, its gradients divided by both)."""
        if optimizer.gradient_accumulation_steps > 1 and self.gradient_accumulation_steps > 1:
            raise ValueError(
                f"both ZeroAccelerator(gradient_accumulation_steps={self.gradient_accumulation_steps}) and the "
                f"ShardedFusedAdam (gradient_accumulation_steps={optimizer.gradient_accumulation_steps}) count "
                "accumulation micro-steps: Accelerate steps the optimizer once per window, which the optimizer "
                "counts as one micro-step of its own. Keep the count in the Accelerator and build the optimizer "
                "without it (leave gradient_accumulation_steps out of its config)"
            )

    def _check_world(self, optimizer: Any) -> None:
        """``ValueError`` when Accelerate runs several processes and ``optimizer`` was built before the process
        group existed: it spans one, and each process would train alone (a process group of one rank given on
        purpose is taken)."""
        if not optimizer.pipeline.engine.distributed and self.num_processes > 1:
            raise ValueError(
                f"this ShardedFusedAdam spans 1 process while Accelerate runs {self.num_processes}: it was built "
                "before the process group existed, and every process would train on its own, gradients never "
                "reduced. Build ZeroAccelerator(...) first (it starts the process group), then the optimizer"
            )

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """As ``Accelerator.no_sync``; also the ``no_sync()`` of the ``ShardedFusedAdam`` that trains ``model``,
        unless it adds micro-batches up reduced (``reduces_micro_steps``: stages 2 and 3).

        Args:
            model: a model given to ``prepare``.
        """
        with contextlib.ExitStack() as stack:
            stack.enter_context(super().no_sync(model))
            for opt in live.training(model.parameters()):
                if not opt.reduces_micro_steps:  # else every micro-batch reduces into the shard, as DeepSpeed's
                    stack.enter_context(opt.no_sync())
            yield

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """As ``Accelerator.backward``; through ``opt.backward`` for a prepared ``ShardedFusedAdam`` whose fp16
        config scales the loss (see the module docstring).

        Args:
            loss: the loss of this micro-batch.
            **kwargs: as ``Accelerator.backward``.
        """
        scaling = [o for o in self._optimizers if isinstance(o.optimizer, ShardedFusedAdam) and o.optimizer.scales_loss]
        if not scaling:
            super().backward(loss, **kwargs)
            return
        if len(scaling) > 1:
            raise ValueError(
                f"ZeroAccelerator.backward: {len(scaling)} prepared ShardedFusedAdam optimizers scale the loss (fp16); "
                "call opt.backward(loss) on the one that trains this loss's parameters"
            )
        kwargs.pop("learning_rate", None)  # Accelerate's LOMO argument
        scaling[0].optimizer.backward(loss / self.gradient_accumulation_steps, **kwargs)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """As ``Accelerator.clip_grad_norm_``; for parameters a ``ShardedFusedAdam`` trains, its global norm of the
        reduced gradients (torch's ``clip_grad_norm_``, which routes to ``opt.clip_grad_norm_``), clipped at its step.

        Args:
            parameters: the parameters to clip (``model.parameters()``).
            max_norm: the largest norm after clipping.
            norm_type: the norm's order.
        """
        parameters = list(parameters)
        if live.training(parameters):
            return clip_sharded(self, parameters, max_norm, norm_type)
        return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """As ``Accelerator.get_state_dict``; for a model a ``ShardedFusedAdam`` trains, a copy of every tensor,
        full at every stage. At stage 3 a collective (call it on every rank) that gathers one unit at a time into
        the host memory of the process that writes (the main one; each node's with ``save_on_each_node``) and
        returns an empty state dict on the others, as Accelerate's under FSDP (``rank0_only``), so the ranks do not
        each hold a copy of the whole model. (Accelerate's under DeepSpeed's ZeRO-3 returns None there, and
        ``save_pretrained(..., state_dict=None)`` of transformers and PEFT then calls ``model.state_dict()``, which
        stage 3 refuses between uses; given the empty one they write nothing on those processes.)

        Args:
            model: a model given to ``prepare``.
            unwrap: as ``Accelerator.get_state_dict``.
        """
        optimizers = live.training(model.parameters())
        if not optimizers:
            return super().get_state_dict(model, unwrap=unwrap)
        if unwrap:
            model = self.unwrap_model(model)
        if len(optimizers) == 1 and sharded_params(optimizers[0]):  # a unit at a time, into host memory
            each_node = self.project_configuration.save_on_each_node
            keep = self.is_local_main_process if each_node else self.is_main_process
            state = model_state_dict(optimizers[0].pipeline, model, keep=keep)
            return collections.OrderedDict() if state is None else state  # nothing to write here, as FSDP's
        with contextlib.ExitStack() as stack:
            for opt in optimizers:
                stack.enter_context(opt.gathered_params())
            return _copies(model.state_dict())


def _scaled_step(prepared: Any, opt: ShardedFusedAdam) -> Callable[..., Any]:
    """The step Accelerate's wrapper hands its GradScaler (see the module docstring): ``opt.step``'s signature, so
    the scaler passes itself as ``grad_scaler``, and the wrapper told whether it updated (``step_was_skipped``)."""

    original = prepared._optimizer_original_step_method  # opt.step, which Accelerate replaces by this one

    @functools.wraps(original)
    def step(*args: Any, **kwargs: Any) -> Any:
        skipped = opt.skipped_steps
        result = original(*args, **kwargs)
        prepared._accelerate_step_called = opt.skipped_steps == skipped
        return result

    return step


def _reporting_skips(prepared: Any, opt: ShardedFusedAdam) -> Callable[..., Any]:
    """The prepared optimizer's step, telling it whether ``opt`` skipped the update (an fp16 overflow of its own loss
    scaling, inf/NaN gradients): Accelerate's wrapper learns that only from a GradScaler, and without one reported every
    step applied, so a prepared scheduler advanced over skipped ones (DeepSpeed's engine holds it there)."""

    original = prepared.step

    @functools.wraps(original)
    def step(*args: Any, **kwargs: Any) -> Any:
        skipped = opt.skipped_steps
        result = original(*args, **kwargs)
        if prepared.gradient_state.sync_gradients:  # Accelerate's wrapper steps the optimizer only then
            prepared._is_overflow = opt.skipped_steps != skipped
        return result

    return step


def _copies(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each tensor copied into storage of its own; entries that are the same tensor (tied
    weights) stay one copy, so that Accelerate drops the repeats as it does for any model (``save_model``; and
    ``save_state``, which does so only for an ``OrderedDict``, the type of ``state_dict()``)."""
    made: dict[tuple, torch.Tensor] = {}
    out: dict[str, Any] = collections.OrderedDict()
    for name, value in state.items():
        if torch.is_tensor(value) and value.numel() == 0:  # no storage to tell two apart by
            value = value.detach().clone()
        elif torch.is_tensor(value):
            key = (value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
            if key not in made:
                made[key] = value.detach().clone()
            value = made[key]
        out[name] = value
    return out
