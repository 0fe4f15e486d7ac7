"""``ShardedFusedAdam``: ZeRO stages 0-3 behind the ``torch.optim.AdamW`` contract, and ``initialize``.

The optimizer keeps the books (param groups, hyper-parameters read every step, loss scale,
accumulation counter, state dicts); the stage pipeline (``stages.pipeline_class(stage)``) owns
buffers, hooks and communication; the math is one ``kernels.adam_step`` call per bucket shard.

Training loop, unchanged from plain PyTorch::

    opt = ShardedFusedAdam(model, lr=1e-3, stage=2, reduce_bucket_size=50_000_000)
    loss.backward(); opt.step(); opt.zero_grad()

Param groups: pass them as to ``torch.optim.AdamW``; stage 3 also needs the model, given as
``module=`` (as ``deepspeed.initialize(model=..., model_parameters=groups)``)::

    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    opt = ShardedFusedAdam(groups, lr=1e-3, stage=3, module=model)

- Gradients: see each stage's module for what ``p.grad`` holds after backward (stage 0: the mean
  over ranks, as DDP; stage 1: the local gradient; stage 2: ``None``, as DeepSpeed; ``None`` at every stage with
  a ``grad_accum_dtype`` wider than the gradients: ``stages.grad_accum``).
- A parameter with no gradient on any rank in a step (``p.grad is None`` everywhere) is left
  alone, as ``torch.optim.AdamW`` does: value, m, v and its step count do not change.
- Accumulation: ``with opt.no_sync(): loss.backward()`` for all micro-steps but the last (grads
  accumulate locally; divide the loss yourself, as with DDP), or ``gradient_accumulation_steps=k``:
  call ``backward``/``step``/``zero_grad`` every micro-step; only every k-th ``step`` updates,
  ``zero_grad`` between is ignored, communication happens on the k-th at stages 0-1 and on every one at stages
  2-3 (``reduces_micro_steps``), and the gradients are averaged over the k micro-steps (DeepSpeed's rule).
- fp16: ``opt.backward(loss)`` scales the loss by ``opt.loss_scale / gradient_accumulation_steps`` (as
  DeepSpeed's ``engine.backward``); ``step`` unscales inside the kernel, skips the update on inf/NaN (on any
  rank) and adjusts the scale (``precision``). A plain ``loss.backward()`` is refused there (the step raises,
  as DeepSpeed does: ``stages.refusals``).
  Or ``torch.amp.GradScaler``, at every stage: ``scaler.step(opt)`` hands itself to ``step`` (``amp``).
- Clipping: ``max_grad_norm`` clips the global norm (summed over ranks in the step's exchange),
  folded into the kernel's gradient multiplier. The norm, that multiplier and the skip flag stay on
  the gradients' device (``stages.outcome``): ``opt.last_step`` reads them when asked, and the step
  counts, ``skipped_steps`` and the loss scale take the step into account when next read. Or call
  ``opt.clip_grad_norm_(max_norm)`` before ``step()``; once an optimizer exists,
  ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` calls it (``torch_clip``: torch's
  own would see no gradient at stages 2-3 and only this rank's at stage 1), and raises for a subset.
- Clearing: after every ``step()`` the optimizer forgets the step's gradients itself, so a loop
  that calls only ``model.zero_grad()`` (as the Hugging Face Trainer does) trains as with AdamW
  at every stage (``stages.grad_state``).
- Parameters replaced after construction (``model.to(...)`` copies, ``p.data = ...``) are followed
  at the next step; ``Parameter`` objects replaced in the model, or a new dtype, device or shape,
  raise ``ValueError`` naming the parameter (``stages.adopt``). A model wrapped in
  ``DistributedDataParallel`` is refused (``guards``), whatever the optimizer was given.
- AdamW's arguments: ``amsgrad`` and ``maximize`` work as in AdamW, per param group; ``foreach``
  and ``fused`` are accepted and change nothing (the update is always one fused kernel per shard);
  ``capturable=True`` and ``differentiable=True`` are refused (``optim.args``).
- ``opt.state[p]``: views of this rank's shards, reset the torch way (``state_view``); state dicts:
  ``optim.state_dicts``; ``copy.deepcopy``, pickle and ``torch.save(opt)``: ``optim.copies``.
- Non-finite gradients (fp32/bf16): with ``skip_nonfinite_steps`` (the default) a step whose
  gradients hold inf/NaN on any rank updates nothing on every rank, is counted in
  ``skipped_steps`` and logged at WARNING; with it off, they are applied as ``torch.optim.AdamW`` would.
- Ranks must agree: options and param groups are compared across ranks at construction, and the
  hyper-parameters, gradient scale and clipping norm at every step (``agreement``); a difference
  raises ``agreement.RanksDisagree`` on every rank, naming the key and every rank's value.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Union

import torch
from torch import nn

from .. import live
from ..comm import agreement, devices
from ..comm.engines import make_engine
from ..config import FP16Config, ZeroOptions
from ..config.schema import GRAD_ACCUM_DTYPES
from ..stages import (
    GroupHyper,
    Pipeline,
    StepResult,
    adopt,
    grad_state,
    norms,
    pipeline_class,
    requires_module,
    storage_bytes,
)
from ..stages import state_door as zstate
from ..stages.ownership import check_step
from . import (
    amp,
    dcp,
    foreign_steps,
    fragments,
    guards,
    mid_window,
    module_zero_grad,
    next_step,
    state_init,
    torch_clip,
)
from . import copies as optim_copy
from . import state_dicts as optim_state
from .args import (
    check_decay_mode,
    check_flags,
    check_group,
    check_group_values,
    check_groups_unchanged,
    check_hyper,
    check_impl,
    check_numbering_unchanged,
    check_ordered,
    check_process_group,
    checked_groups,
    data_type,
    decay_mode,
)
from .pending_clip import PendingClips
from .precision import LossScaler
from .state_view import ShardedState

__all__ = ["ShardedFusedAdam", "check_hyper"]
log = logging.getLogger("zero_kernels")
STATE_CHANGED = (
    "state_dict(): opt.state was reset or written since consolidate_state_dict(), so the whole state gathered then "
    "is out of date and this rank's shard is returned instead; call consolidate_state_dict() again (on every rank)"
)


class ShardedFusedAdam(torch.optim.Optimizer):
    """Adam/AdamW with ZeRO-sharded state and a fused update.

    Args:
        params_or_module: an ``nn.Module`` (its parameters form one group), or parameters / param-group
            dicts / ``(name, parameter)`` pairs, as for ``torch.optim.AdamW``. Trainable parameters are
            float32, bfloat16 or float16, dense, on one device; each appears once.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (same defaults and checks; ``lr`` and
            ``betas`` may be one-element tensors).
        amsgrad, maximize: as ``torch.optim.AdamW`` (per param group; the state gains ``max_exp_avg_sq``).
        foreach, fused: accepted for AdamW compatibility; no effect (the update is always fused).
        capturable, differentiable: must be False (CUDA-graph capture and autograd through the step
            are not supported).
        stage: ZeRO stage 0-3.
        process_group: data-parallel group (None: the default group, or a single process).
        impl: kernel backend, ``auto | triton | cpu | torch`` (None: ``ZERO_KERNELS_IMPL``).
        adam_w_mode: decoupled weight decay (AdamW) if True; L2 added to the gradient (Adam) if False. One mode
            for every group: a group's ``decoupled_weight_decay`` (torch's key) must agree with it.
        decoupled_weight_decay: ``torch.optim.Adam``'s name for ``adam_w_mode`` (None: ``adam_w_mode``'s value);
            ``adam_w_mode=False`` with ``decoupled_weight_decay=True`` is an error.
        max_grad_norm: clip the global gradient norm to this value (None or 0: no clipping).
        gradient_accumulation_steps: micro-steps per update (see the module docstring).
        fp16: an ``FP16Config`` (or its fields as a dict, on unless it holds ``"enabled": False``) enabling loss
            scaling; True: DeepSpeed's dynamic defaults (``FP16Config(enabled=True)``), False: none.
        skip_nonfinite_steps: skip (on every rank) a step whose gradients hold inf/NaN on some rank,
            and count it in ``skipped_steps``; False applies them, as ``torch.optim.AdamW`` does.
            fp16 loss scaling always skips such steps.
        communication_data_type: the dtype gradients are reduced in (DeepSpeed's key): ``"fp32"``, ``"fp16"``,
            ``"bf16"`` or a torch dtype; None (the default, as DeepSpeed's): the gradients' own dtype. With
            ``"fp32"`` bf16/fp16 gradients are reduced, and at stages 2-3 accumulated until the step, in fp32.
        grad_accum_dtype: the dtype gradients are accumulated in over micro-steps (DeepSpeed's
            ``data_types.grad_accum_dtype``), same values; None (the default, DeepSpeed 0.19's): their own dtype.
            At stages 2-3 a wider one (``"fp32"`` for bf16/fp16 gradients) makes each ``gradient_accumulation_steps``
            micro-step reduce its gradients and add them into an fp32 gradient shard; at stages 0-1 it makes the
            local gradient buffer fp32, which every backward adds into (``p.grad`` is None after backward) and the
            reduction reads (``stages.grad_accum``).
        module: the model the parameters belong to, when ``params_or_module`` lists parameters or
            groups: stage 3 needs it to gather parameters; other stages use it to name parameters in errors.
        **zero_options: ``zero_optimization`` keys, e.g. ``reduce_bucket_size`` (elements).
    """

    def __init__(
        self,
        params_or_module: Union[nn.Module, Iterable[Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        stage: int = 1,
        process_group: Any = None,
        impl: Optional[str] = None,
        adam_w_mode: bool = True,
        decoupled_weight_decay: Optional[bool] = None,
        max_grad_norm: Optional[float] = None,
        gradient_accumulation_steps: int = 1,
        fp16: Union[FP16Config, Mapping[str, Any], None] = None,
        skip_nonfinite_steps: bool = True,
        communication_data_type: Union[str, torch.dtype, None] = None,
        grad_accum_dtype: Union[str, torch.dtype, None] = None,
        module: Optional[nn.Module] = None,
        **zero_options: Any,
    ):
        check_hyper(lr, betas, eps, weight_decay, foreach=foreach and not capturable)
        flags = dict(amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=capturable,
                     differentiable=differentiable, fused=fused)  # fmt: skip
        check_flags(flags, "ShardedFusedAdam")
        check_impl(impl)
        check_process_group(process_group)
        self.options = ZeroOptions.from_dict({"stage": stage, **zero_options})
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(
                f"gradient_accumulation_steps must be an integer >= 1, got {gradient_accumulation_steps!r}"
            )
        if max_grad_norm is not None and not max_grad_norm >= 0:
            raise ValueError(f"max_grad_norm must be >= 0 or None, got {max_grad_norm!r}")
        module = _the_module(params_or_module, module)
        guards.refuse_ddp(module)
        if module is None and requires_module(self.options.stage):
            raise ValueError(
                f"stage {self.options.stage} gathers parameters with module hooks: pass the model "
                "(ShardedFusedAdam(model, ...)), or the parameters or groups with module=model"
            )
        if not isinstance(skip_nonfinite_steps, bool):
            raise ValueError(f"skip_nonfinite_steps must be True or False, got {skip_nonfinite_steps!r}")
        self.skip_nonfinite_steps = skip_nonfinite_steps
        self.communication_data_type = data_type(communication_data_type)
        self.grad_accum_dtype = data_type(grad_accum_dtype, "grad_accum_dtype", GRAD_ACCUM_DTYPES)
        self.skipped_steps = 0  # steps that updated nothing because some gradient was inf/NaN
        self.adam_w_mode = decay_mode(adam_w_mode, decoupled_weight_decay)
        self.max_grad_norm = max_grad_norm or None
        self.gradient_accumulation_steps = gradient_accumulation_steps
        fp16 = _fp16_config(fp16)
        self.loss_scaler = LossScaler.from_fp16_config(fp16) if fp16 is not None and fp16.enabled else None
        params = module.parameters() if module is not None and params_or_module is module else params_or_module
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **flags,
                        decoupled_weight_decay=self.adam_w_mode)  # fmt: skip
        self._build(params, defaults, module=module, process_group=process_group, impl=impl)

    def _build(
        self,
        params: Any,
        defaults: dict[str, Any],
        *,
        module: Optional[nn.Module],
        process_group: Any,
        impl: Optional[str],
        restore: Optional[optim_copy.Origin] = None,
    ) -> None:
        """Engine, pipeline and param groups: at construction, and when a copy is rebuilt (``restore``)."""
        self._names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
        self._micro_step = 0
        self._micro_arrivals = 0  # the pipeline's gradient arrivals at the last micro-step's step() (mid_window)
        self._no_sync_depth = 0
        self._step_marks: list[weakref.ref] = []  # optimizers whose step() each call of this one stands for
        self._clips = PendingClips()  # what clip_grad_norm_ asked of the coming step
        self._grad_factor = 1.0  # what scale_grads_ asked of the coming step
        self._unscaled_loaded = False  # a checkpoint brought gradients a GradScaler's unscale_ had divided
        self._warned_twice = False  # ``_warn_accumulated_twice`` spoke
        self._grad_scaler: Optional[weakref.ref] = None  # the torch.amp.GradScaler that last stepped this optimizer
        self._scaled_step = False  # the last step was driven by a GradScaler
        self.last_step: Optional[StepResult] = None
        self._consolidated: Optional[dict[str, Any]] = None
        self._consolidated_version = 0  # opt.state's version when it was consolidated
        self._restoring = restore is not None
        self._engine = make_engine(process_group)
        if restore is not None:
            restore.check(self._engine)
        check_ordered(params, self._engine.world_size)
        groups = checked_groups(params, defaults, self._describe)  # every group, before anything changes
        device = devices.parameters_device(groups)
        devices.check_current_device(self._engine, device, exchange=restore is None)  # before any other exchange
        self._pipeline = pipeline_class(self.options.stage)(
            self._engine, self.options, impl=impl, module=module, comm_dtype=self.communication_data_type,
            accum_dtype=self.grad_accum_dtype,
        )  # fmt: skip
        self._pipeline.device = device
        self._pipeline.index_name = weak_method(self._param_name)  # no reference cycle: `del opt` frees it
        self._pipeline.step_counts.on_settle = weak_method(self._account)
        self._pipeline.loss_scaled = self.scales_loss  # a plain loss.backward() is refused
        if self._pipeline.speculation is not None:
            self._pipeline.speculation.predict = next_step.predictor(self)
        self._applied_steps = 0  # steps of this object that updated the parameters (boundary, not skipped)
        self._late_group_checked = False  # the first boundary step looks once for a process group made after us
        self._built_groups: list[list[torch.Tensor]] = []  # each group's parameters as the buffers took them
        try:
            super().__init__(groups, defaults)
            if not self._restoring:
                agreement.check_optimizer(self, f"constructed with {len(self.param_groups)} param groups")
        except Exception:
            self._pipeline.close()  # the groups built before the one refused give their parameters back whole
            raise
        self._restoring = False
        self.state = ShardedState(self._pipeline, weak_method(self._params))
        self._update_sync()
        held = {id(p) for g in self.param_groups for p in g["params"]}
        self._held_names = {n: i for i, n in self._names.items() if i in held}
        live.register(self)
        torch_clip.install()
        module_zero_grad.install()
        foreign_steps.install()
        self._unwatch = guards.watch(self, module)
        weakref.finalize(self, self._unwatch).atexit = False  # its hook comes off the model once it is collected

    def _detach(self) -> None:
        """Take this optimizer off its model (an ``initialize`` that failed): the pipeline's hooks and the DDP
        guard come off, every parameter keeps its full value, and it no longer counts as training them."""
        self._pipeline.close()
        self._unwatch()
        live.forget(self)

    @property
    def state(self) -> Any:
        """AdamW's per-parameter state as views of this rank's shards (``state_view``)."""
        return self.__dict__["_state"]

    @state.setter
    def state(self, value: Any) -> None:
        """``opt.state = {}`` (or ``defaultdict(dict)``) resets every parameter's state, as with AdamW."""
        current = self.__dict__.get("_state")
        if isinstance(current, ShardedState) and value is not current:
            if not isinstance(value, Mapping):
                raise TypeError(f"opt.state must be set to a dict, not a {type(value).__name__}")
            current.replace(value)
        else:
            self.__dict__["_state"] = value  # torch's constructor, then _build

    # ---------------------------------------------------------------- param groups
    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _describe(self, p: torch.Tensor, names: Mapping[int, str]) -> str:
        name = self._names.get(id(p)) or names.get(id(p))
        return f"parameter {name!r}" if name else f"a parameter of shape {tuple(p.shape)}"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (checked like torch's); its parameters join the sharded buffers.

        Args:
            param_group: ``{"params": [...], **hyper-parameter overrides}``.
        """
        if self._pipeline.holding:
            raise ValueError(
                "add_param_group inside `with optimizer.gathered_params():` is not supported (the block's end writes "
                "back what it gathered): add the group after the block; nothing was added"
            )
        previous = [(g["params"], "param_names" in g) for g in self.param_groups]
        own = set(self._pipeline.where) | self._pipeline.frozen_partitioned()
        check_group(param_group, len(self.param_groups), previous, self.defaults, self._describe, own)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            first = sum(len(g["params"]) for g in self.param_groups[:-1])
            indices = list(range(first, first + len(group["params"])))
            if not self._restoring:
                g = len(self.param_groups) - 1
                agreement.check_optimizer(self, f"adding param group {g}", group=g, names=self._names)
                # a partitioned frozen parameter is this rank's chunk, the same split of the same values everywhere
                kept = [(p, i) for p, i in zip(group["params"], indices) if id(p) not in own]
                agreement.check_replicated(self._engine, [p for p, _ in kept], [i for _, i in kept], self._param_name)
            self._pipeline.add_group(len(self.param_groups) - 1, group["params"], indices)
        except Exception:
            self.param_groups.pop()  # the pipeline checks before it changes anything
            raise
        self._built_groups.append(list(group["params"]))
        if group["amsgrad"]:
            self._pipeline.allocate_max_exp_avg_sq(len(self.param_groups) - 1)

    def _param_name(self, index: int) -> str:
        i = index
        for g, group in enumerate(self.param_groups):
            if i < len(group["params"]):
                name = self._names.get(id(group["params"][i])) or (group.get("param_names") or [None] * (i + 1))[i]
                return f"parameter {index} ({name!r}, group {g})" if name else f"parameter {index} (group {g})"
            i -= len(group["params"])
        return f"parameter {index}"

    # ---------------------------------------------------------------- training loop
    def _update_sync(self) -> None:
        last_micro = self._micro_step == self.gradient_accumulation_steps - 1
        reduce = last_micro or self._pipeline.reduces_micro_steps
        self._pipeline.sync_enabled = reduce and self._no_sync_depth == 0
        self._pipeline.window_ends = last_micro

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside communicates. ``step()`` inside
        raises (DDP would step each rank on its own gradients, which sharded state cannot do; DeepSpeed's engine
        refuses it too)."""
        self._no_sync_depth += 1
        self._update_sync()
        try:
            yield
        finally:
            self._no_sync_depth -= 1
            self._update_sync()

    def join_hook(self, **kwargs: Any) -> None:
        """What ``torch.distributed.algorithms.Join([opt])`` asks of a ``Joinable`` (``ZeroRedundancyOptimizer`` is
        one, for uneven inputs): refused, as a rank out of batches cannot stand in for the reductions of the others'
        backward passes and steps."""
        raise RuntimeError(
            "ShardedFusedAdam does not support torch.distributed.algorithms.Join (uneven inputs across ranks): the "
            "gradient reductions of backward and the step's exchanges are collectives that every rank must run "
            "alike. Give every rank the same number of batches (DistributedSampler(..., drop_last=True)), or stop "
            "every rank once one runs out (all-reduce a 'has a batch' flag before each step); nothing was changed"
        )

    @property
    def reduces_micro_steps(self) -> bool:
        """Whether every backward pass between steps reduces its gradients at once, to add them up in the gradient
        shard (stages 2 and 3, as DeepSpeed's ZeRO-2 and ZeRO-3; in a wider ``grad_accum_dtype`` where one is set): a
        loop that runs its micro-batches under ``no_sync()`` would add them up in ``p.grad`` instead, the whole local
        gradient in the gradients' dtype, so the Trainer and Accelerate integrations leave ``no_sync()`` out then."""
        return self._pipeline.reduces_micro_steps

    @property
    def pipeline(self) -> Pipeline:
        """The stage pipeline that owns the flat buffers, the shards and the per-parameter step counts.

        An advanced, read-only accessor for code that works on the sharded layout itself, such as
        ``zero_kernels.checkpoint``; training code needs only the optimizer's own methods.
        """
        return self._pipeline

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16 loss scaling)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The fp16 way to run backward: ``(loss / gradient_accumulation_steps * loss_scale).backward(**kwargs)``,
        as DeepSpeed's ``engine.backward``, so the fp16 gradients summed over a window stay within the range
        DeepSpeed's do (the step then divides by the loss scale only). Without fp16 loss scaling:
        ``(loss * 1.0).backward(**kwargs)``, and the step divides by ``gradient_accumulation_steps``.

        Args:
            loss: the scalar loss of this micro-step.
            **kwargs: passed to ``Tensor.backward``; DeepSpeed's ``scale_wrt_gas=True`` (its default) is taken, False
                too where ``gradient_accumulation_steps`` is 1 (nothing is divided), else refused saying what to pass.
        """
        if not kwargs.pop("scale_wrt_gas", True) and self.gradient_accumulation_steps > 1:
            raise ValueError(
                "ShardedFusedAdam.backward: scale_wrt_gas=False (DeepSpeed's engine.backward) is not taken: the step "
                "divides every micro-step's gradients by gradient_accumulation_steps; to keep this micro-step's "
                "undivided, pass loss * optimizer.gradient_accumulation_steps"
            )
        if self.scales_loss:
            loss = loss / self.gradient_accumulation_steps
        self._pipeline.scaled_backward = True
        try:
            (loss * self.loss_scale).backward(**kwargs)
        finally:
            self._pipeline.scaled_backward = False

    @property
    def scales_loss(self) -> bool:
        """Whether fp16 loss scaling is on: backward must then run through ``backward`` (settles nothing)."""
        return self._loss_scaler is not None

    @property
    def _grad_divisor(self) -> float:
        """What the step divides the summed gradients by: the loss scale times the accumulation steps not already
        divided out in ``backward`` (all of them without fp16 loss scaling, none with it)."""
        if self.scales_loss:
            return self.loss_scale
        return float(self.gradient_accumulation_steps)

    _step_supports_amp_scaling = True  # torch.amp.GradScaler passes itself to step() (see ``amp``)

    @property
    def micro_step(self) -> int:
        """Micro-steps taken in the current ``gradient_accumulation_steps`` window (0 at a window's start)."""
        return self._micro_step

    @micro_step.setter
    def micro_step(self, value: int) -> None:
        """Where a resumed window continues (``zero_kernels.checkpoint`` sets it)."""
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.gradient_accumulation_steps:
            raise ValueError(f"micro_step must be in 0..{self.gradient_accumulation_steps - 1}, got {value!r}")
        self._micro_step = value
        mid_window.mark(self)
        self._update_sync()

    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, grad_scaler: Any = None) -> Optional[float]:
        """One optimizer step (or one accumulation micro-step, see the module docstring).

        Args:
            closure: re-evaluates the model and returns the loss (optional).
            grad_scaler: the ``torch.amp.GradScaler`` of ``scaler.step(opt)``, which passes it (see ``amp``).
        """
        if self._no_sync_depth:
            raise RuntimeError(
                "ShardedFusedAdam.step() inside no_sync(): DDP would step each rank on its own local gradients (the "
                "replicas drifting apart, as Accelerate's LocalSGD wants), which sharded optimizer state cannot do; "
                "this step would reduce them across ranks instead. Leave the no_sync() block, then step; nothing "
                "was changed"
            )
        self._refuse_unfinished_load("step()", "nothing was updated")
        guards.refuse_ddp_inside(self)
        self.check_param_groups()
        scaled = amp.begin(grad_scaler, self)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._warn_accumulated_twice()
        if not self._updates_at_next_step(closure is not None):
            self._pipeline.keep_failed_round()
            self._micro_step += 1
            mid_window.mark(self)
            self._update_sync()
            return loss
        hyper = [self._hyper(g, f"param group {i}") for i, g in enumerate(self.param_groups)]
        self._micro_step = 0
        self._warn_late_group()
        module_zero_grad.warn_part_left(self)
        self.wait_params()
        self._follow_replaced_params()
        scale = self._grad_factor / self._grad_divisor
        multiplier = self._clip_coefficient(scaled)
        unscale = None if scaled is None else scaled.multiplier  # 1 / the GradScaler's scale where still scaled
        if unscale is not None:
            multiplier = unscale if multiplier is None else multiplier * unscale
        fragments.rescale_set_grads(self, None if unscale is None else 1.0 / float(unscale))
        self._consolidated = None  # the state is about to change
        check_finite = self.loss_scaler is not None or self.skip_nonfinite_steps or scaled is not None
        self._pipeline.settle()  # the last step's outcome is accounted as that step's
        self._scaled_step = scaled is not None
        self.last_step = self._pipeline.step(
            hyper,
            grad_scale=scale,
            clip_coef=multiplier,
            max_grad_norm=self.max_grad_norm,
            clip_max_norm=self._clips.max_norm(),
            check_finite=check_finite,
        )
        self._forget_grad_edits()  # kept for a step refused before any update, called again
        if scaled is not None:
            scaled.record(self, self.last_step.skip_flag)
        self._update_sync()
        return loss

    def _updates_at_next_step(self, closure: bool) -> bool:
        """Whether the next ``step()`` call updates (or skips an update): not an accumulation micro-step. A call
        with a closure is never a state-making one (``state_init``): its hooks are decided before the closure's
        backward brings the gradients that would tell."""
        micro_step = self._micro_step + 1
        if micro_step >= self.gradient_accumulation_steps:
            return True
        return not closure and state_init.only_makes_state(self, micro_step)

    @staticmethod
    def profile_hook_step(func: Callable[..., Any]) -> Callable[..., Any]:
        """``torch.optim.Optimizer``'s wrapper of ``step`` (its profiler record, the step pre- and post-hooks, the
        optimizer's and torch's global ones), with the hooks run only around a call that updates, once per update
        as around ``torch.optim.AdamW.step()`` after its accumulated backward passes: an accumulation micro-step
        runs under the profiler record alone."""
        hooked = torch.optim.Optimizer.profile_hook_step(func)

        @functools.wraps(func)
        def step(self: "ShardedFusedAdam", *args: Any, **kwargs: Any) -> Any:
            for ref in self._step_marks:  # torch's check that optimizer.step() ran before lr_scheduler.step()
                marked = ref()
                if marked is not None:
                    marked._opt_called = True
            closure = args[0] if args else kwargs.get("closure")
            if self._updates_at_next_step(closure is not None):
                return hooked(self, *args, **kwargs)
            with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
                return func(self, *args, **kwargs)

        return step

    def check_param_groups(self, numbering: bool = False) -> None:
        """``ValueError`` when ``param_groups`` no longer hold the parameters the flat buffers were built for (a
        parameter or group added or removed by hand), which the buffers cannot follow (``args.check_groups_unchanged``).

        Args:
            numbering: only where the groups no longer number the parameters as built
                (``args.check_numbering_unchanged``): the state dicts and checkpoints key the state as built and the
                groups' params as edited.
        """
        if numbering:
            check_numbering_unchanged(self._built_groups, self.param_groups)
        else:
            check_groups_unchanged(self._built_groups, self.param_groups)

    def _warn_late_group(self) -> None:
        """Warn once when this optimizer, built before ``init_process_group``, steps while several ranks run:
        each process then trains alone, its updates never averaged with the others'."""
        if self._late_group_checked:
            return
        self._late_group_checked = True
        world = self._engine.late_world_size()
        if world > 1:
            log.warning(
                "zero_kernels: this optimizer was built before torch.distributed was initialised, so it trains "
                "this process's parameters alone (world size 1) while %d ranks run: build it after "
                "init_process_group (with Accelerate: after Accelerator(...)) to shard the state and average "
                "the gradients across them",
                world,
            )
            return
        launched = self._engine.launched_world_size()
        if launched > 1:
            log.warning(
                "zero_kernels: WORLD_SIZE=%d (a launcher such as torchrun started %d processes), but "
                "torch.distributed was never initialised, so this optimizer trains this process's parameters "
                "alone (world size 1), its gradients never averaged with the other processes': call "
                "torch.distributed.init_process_group() before building it",
                launched,
                launched,
            )

    def _warn_accumulated_twice(self) -> None:
        """Said once: several backward passes reached this ``step()`` call, which counts as one of
        ``gradient_accumulation_steps`` micro-steps: a loop that accumulates itself (PyTorch Lightning's
        ``accumulate_grad_batches``, a ``step()`` every k batches) then counts the window twice."""
        if not self._pipeline.step_called() or self.gradient_accumulation_steps == 1 or self._warned_twice:
            return
        self._warned_twice = True
        log.warning(
            "zero_kernels: several backward passes reached this step() call, which counts as one of "
            "gradient_accumulation_steps=%d micro-steps: if the loop accumulates itself (PyTorch Lightning's "
            "accumulate_grad_batches, step() called every k batches), each update takes k x %d batches and there are "
            "k times fewer updates. Count accumulation in one place (gradient_accumulation_steps 1 there, or step() "
            "after every backward); several losses' backward passes in one micro-step, or a parameter used in several "
            "reentrant checkpoint segments, are fine",
            self.gradient_accumulation_steps,
            self.gradient_accumulation_steps,
        )

    def _clip_coefficient(self, scaled: Optional[amp.ScaledStep]) -> Optional[torch.Tensor]:
        """The coefficient the clips asked for compose to (None: none), norms taken before a GradScaler was known
        corrected for it."""

        def correct(norm: torch.Tensor, scale_known: bool) -> torch.Tensor:
            return amp.correct_clip(norm, scaled, self) if scaled is not None and not scale_known else norm

        return self._clips.coefficient(correct)

    def _account(self, result: StepResult) -> None:
        """A step's outcome, once known (``Pipeline.settle``): count a skipped step, update the loss scale."""
        scaler = self._loss_scaler
        if result.skipped and scaler is not None:
            log.info("zero_kernels: fp16 overflow at loss scale %g: step skipped", scaler.scale)
        elif result.skipped and self._scaled_step:
            log.info("zero_kernels: inf/NaN gradients under torch.amp.GradScaler: step skipped")
        elif result.skipped:
            log.warning(
                "zero_kernels: step skipped on every rank: some gradient is inf or NaN (%d steps skipped so far; "
                "skip_nonfinite_steps=False applies such gradients)",
                self._skipped_steps + 1,
            )
        self._skipped_steps += int(result.skipped)
        self._applied_steps += int(not result.skipped)
        if scaler is not None:
            scaler.update(result.skipped)

    @property
    def skipped_steps(self) -> int:
        """Steps that updated nothing because some gradient was inf/NaN on some rank (the same on every rank);
        ``state_dict()`` and ``checkpoint.save`` keep it, their loads restore it, as DeepSpeed's checkpoints do."""
        self._pipeline.settle()
        return self._skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        count = optim_state.step_count(value, "skipped_steps")
        if getattr(self, "_pipeline", None) is not None:  # a step not yet counted counts before the new value
            self._pipeline.settle()
        self._skipped_steps = count

    @property
    def applied_steps(self) -> int:
        """Steps of this optimizer object that updated the parameters (accumulation boundaries not skipped);
        the scheduler ``initialize`` builds advances when it grows."""
        self._pipeline.settle()
        return self._applied_steps

    @property
    def loss_scaler(self) -> Optional[LossScaler]:
        """The fp16 loss-scale state (None without fp16), the last step's overflow accounted for."""
        if getattr(self, "_pipeline", None) is not None:
            self._pipeline.settle()
        return self._loss_scaler

    @loss_scaler.setter
    def loss_scaler(self, value: Optional[LossScaler]) -> None:
        self._loss_scaler = value

    def _hyper(self, g: Mapping[str, Any], where: str) -> GroupHyper:
        check_group_values(g, where)
        check_decay_mode(g, where, self.adam_w_mode)
        b1, b2 = (float(b) for b in g["betas"])
        return GroupHyper(
            float(g["lr"]), b1, b2, float(g["eps"]), float(g["weight_decay"]), self.adam_w_mode,
            amsgrad=bool(g.get("amsgrad", False)), maximize=bool(g.get("maximize", False)),
        )  # fmt: skip

    def _follow_replaced_params(self) -> None:
        """Re-adopt parameters whose ``.data`` was replaced since the last step (see ``stages.adopt``), once no
        optimizer built later took them (a stage-3 one empties them: taken for a replacement, an emptied parameter
        was refused as one whose shape changed)."""
        check_step(self._pipeline, self._pipeline.name_of)
        module = self._pipeline.module
        if module is not None:
            adopt.check_module_params(module, self._held_names)
        adopt.follow_replaced(self._pipeline, self._pipeline.name_of)
        adopt.check_unfrozen(self.param_groups, self._pipeline.has_grad, self._param_name)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global norm of this step's gradients to ``max_norm`` (applied by the next ``step()``).

        What ``torch.nn.utils.clip_grad_norm_`` does for a plain optimizer, for gradients that live in
        shards: the norm is taken over the reduced gradients of every rank (a collective: call it on
        every rank, after the last backward of the step and before ``step()``). Once this optimizer
        exists, ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` calls this (see
        ``torch_clip``).

        Args:
            max_norm: the largest global norm the gradients may have; ``inf`` only measures it.
            norm_type: the norm's order, as torch's: 2, another positive number, or ``inf`` (the largest
                ``|g|``); the norm is taken over the gradients of every rank, as ``norms`` describes.

        Returns:
            The global norm before clipping, as a 0-d float32 tensor.
        """
        _check_max_norm(max_norm)
        measured = self._measured_norm(norm_type, "clip_grad_norm_")
        norm = self._clips.seen(measured)
        self._ask_clip(max_norm, measured, measured=True)
        return norm.float()

    def scale_grads_(self, factor: Union[float, torch.Tensor]) -> None:
        """Multiply this step's gradients by ``factor`` (applied by the next ``step()``; a norm taken after this
        call sees it).

        What ``p.grad *= factor`` over the model's parameters does for a plain optimizer (torchtune's
        ``training.scale_grads``: gradients of a loss summed over tokens, divided by the token count once it is
        known), for gradients that live in shards: at stages 2 and 3 ``p.grad`` is None after backward, so such a
        loop scales nothing. Call it on every rank with the same factor (the step compares them), after the last
        backward of the step; a gradient that arrives after it is refused at the step, as after
        ``clip_grad_norm_``.

        Args:
            factor: a finite number >= 0 (or a 0-d tensor holding one).
        """
        value = float(factor)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(
                f"ShardedFusedAdam.scale_grads_: factor={value}: give a finite number >= 0 (to ascend a loss, negate "
                "the loss)"
            )
        if self._micro_step + 1 < self.gradient_accumulation_steps:
            raise RuntimeError(
                f"ShardedFusedAdam.scale_grads_ on accumulation micro-step {self._micro_step + 1} of "
                f"{self.gradient_accumulation_steps}: the later micro-steps' gradients would be scaled too; call it "
                "after the last backward of the step"
            )
        self._grad_factor *= value
        self._pipeline.clipped = True  # a later gradient is refused

    def grad_edits(self) -> Optional[dict[str, Any]]:
        """What ``clip_grad_norm_`` and ``scale_grads_`` asked of the coming step, as plain data (None: nothing):
        a checkpoint saved inside the accumulation window keeps it (``load_grad_edits``)."""
        unscaled = self._unscaled_loaded or amp.unscaled_in_p_grad(self)  # by a GradScaler's unscale_
        clips = self._clips.to_list()
        if not clips and self._grad_factor == 1.0 and not unscaled:
            return None
        return {"factor": self._grad_factor, "clips": clips, "unscaled": unscaled}

    def load_grad_edits(self, edits: Optional[dict[str, Any]]) -> None:
        """Ask again of the coming step what ``grad_edits`` gave (None: nothing); later gradients are refused, as
        after the calls themselves. Gradients a GradScaler's ``unscale_`` divided are not divided again by the next
        ``scaler.step(opt)``."""
        self._forget_grad_edits()
        if edits is not None:
            self._grad_factor = float(edits["factor"])
            self._clips.load_list(edits["clips"])
            self._unscaled_loaded = bool(edits.get("unscaled", False))
        self._pipeline.clipped = bool(self._clips) or self._grad_factor != 1.0  # as asked: a measure clips nothing

    def _forget_grad_edits(self) -> None:
        """Nothing asked of the coming step any more: its gradients were used, or dropped."""
        amp.forget_reduction(self)
        fragments.forget_set_grads(self)
        self._clips.clear()
        self._grad_factor = 1.0
        self._unscaled_loaded = False

    def _grad_norm(self, norm_type: float) -> torch.Tensor:
        """The global norm of order ``norm_type`` of this step's reduced gradients as clipped so far (the clips
        asked for since the last step, as torch's in-place clips would have left them), a 0-d float64 tensor (a
        collective); ``get_total_norm``'s."""
        return self._clips.seen(self._measured_norm(norm_type, "get_total_norm"))

    def _measured_norm(self, norm_type: float, what: str) -> torch.Tensor:
        """``_grad_norm`` before the clips asked for since the last step."""
        order = norms.norm_order(norm_type, what)
        if self._micro_step + 1 < self.gradient_accumulation_steps:
            raise RuntimeError(
                f"{what} on accumulation micro-step {self._micro_step + 1} of "
                f"{self.gradient_accumulation_steps}: the gradients are complete only before the step that "
                "updates; call it there (with Accelerate, the HF Trainer or Lightning, leave the count to them: "
                "Accelerator(gradient_accumulation_steps=...), TrainingArguments or Trainer(accumulate_grad_batches="
                "...), and build the optimizer without it, so that they clip only there), or set max_grad_norm"
            )
        scale = self._grad_factor / self._grad_divisor
        amp.note_reduction(self)
        factor, _ = amp.clip_factor(self)
        return grad_state.grad_norm(self._pipeline, scale if factor is None else factor * scale, order)

    def _clip_with_norm(self, max_norm: float, norm: Union[float, torch.Tensor]) -> None:
        """The next step scales the gradients by ``min(1, max_norm / (norm + 1e-6))`` (a non-finite norm: 1) besides
        the clips asked for before, ``norm`` taken as given (``clip_grads_with_norm_``)."""
        self._ask_clip(max_norm, norm, measured=False)

    def _ask_clip(self, max_norm: float, norm: Union[float, torch.Tensor], measured: bool) -> None:
        """Record a clip for the next step (``PendingClips``), ``norm`` corrected there when it was taken before a
        GradScaler was known (``amp``)."""
        _check_max_norm(max_norm)
        _, scale_known = amp.clip_factor(self)
        self._clips.ask(norm, max_norm, scale_known, measured)
        self._pipeline.clipped = self._pipeline.clipped or math.isfinite(float(max_norm))  # a later gradient is refused

    @torch.compiler.disable  # as step(): at stage 3 the freed parameters must not reach Dynamo
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; ignored between accumulation micro-steps, except after a
        backward that raised: then it drops the whole window (every micro-step's gradients, the failed pass's
        included) and the window starts again at micro-step 0, as ``torch.optim`` clears ``p.grad``. Refused
        between micro-steps after a backward that came after the last micro-step's ``step()`` (``mid_window``).

        Not needed between steps: ``step()`` clears the gradient state the optimizer keeps for itself,
        so a loop that calls only ``model.zero_grad()`` trains the same (see ``stages.grad_state``); and
        ``model.zero_grad()`` of a module that holds all of this optimizer's parameters calls it
        (``module_zero_grad``).

        Args:
            set_to_none: drop the gradients (``p.grad = None``) instead of zeroing them.
        """
        with torch.autograd.profiler.record_function(self._zero_grad_profile_name):  # torch's record
            if self._micro_step != 0:
                if not self._pipeline.failed_round_open:
                    mid_window.refuse(self, "ShardedFusedAdam.zero_grad()")
                    return
                self._drop_window()
            self._forget_grad_edits()
            self._pipeline.zero_grad(set_to_none)

    def _drop_window(self) -> None:
        """``zero_grad()`` after a backward that raised mid-window: the window restarts at micro-step 0."""
        log.warning(
            "zero_kernels: zero_grad() after a backward that raised on accumulation micro-step %d of %d: the whole "
            "window's gradients are dropped (the earlier micro-steps' too) and the window starts again",
            self._micro_step + 1,
            self.gradient_accumulation_steps,
        )
        self._micro_step = 0
        self._update_sync()

    def wait_params(self) -> None:
        """Finish the parameter all-gathers that ``overlap_param_gather`` leaves in flight after a step (stages
        1-2; otherwise there are none). Every use of a parameter waits by itself; call this before reading a
        tensor taken from a parameter before the step (a kept ``p.data`` or ``model.state_dict()``)."""
        self._pipeline.wait_params()

    def gathered_params(self, modifier_rank: Optional[int] = None) -> contextlib.AbstractContextManager:
        """Full parameters inside the block (stage 3 gathers them; stages 0-2 always have them).

        Args:
            modifier_rank: None: edits made inside the block are kept as each rank made them (make the same
                edit on every rank). An int ``k`` in ``[0, world size)`` of the optimizer's process group: at the
                block's end every rank takes rank ``k``'s values of the model's parameters (those this optimizer
                holds, and the model's frozen ones when it was given the model), bit for bit: DeepSpeed's
                ``GatheredParameters(params, modifier_rank=k)``, where rank ``k`` alone edits.
        """
        return self._pipeline.gathered_params(modifier_rank)

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds, measured from the storages: ``params``, ``grads`` and ``optimizer``
        state (the model states of DESIGN.md's formula), and ``buffers``, the idle gradient buckets
        kept for reuse by stages 2 and 3 (a few ``reduce_bucket_size`` buckets), and ``secondary``, ZeRO++'s
        copies of parameters at stage 3: hpZ's secondary partition and qwZ's int8 copy of this rank's shard. With
        ``offload_optimizer`` (or stage 3's ``offload_param``), ``optimizer`` counts only what stays on the
        parameters' device and the two other tiers count: ``host`` (the state in host memory, with the tier's
        host copies of the parameter and gradient shards, stage 3's parameter shards in host memory, and the pool
        that its parameter shards in files are read through) and ``disk`` (the files under ``nvme_path``: the
        state's, and with ``offload_param`` on nvme the parameter shards'); without offload both are 0 (every key is
        there at every stage)."""
        held = self._pipeline.memory_tensors()
        params = [p for g in self.param_groups for p in g["params"]]
        report = {
            "params": storage_bytes(held["params"] + params),
            "grads": storage_bytes(held["grads"] + [p.grad for p in params]),
            "optimizer": storage_bytes(held["optimizer"]),
            "buffers": storage_bytes(held["buffers"]),
            "secondary": storage_bytes(held["secondary"]),
            "host": storage_bytes(held.get("host", [])),
            "disk": self._pipeline.disk_bytes(),
        }
        return report

    # ---------------------------------------------------------------- state dicts
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the state (reload with the same world size, stage and model); on the
        rank given to ``consolidate_state_dict(to=...)``, the whole state it gathered, until the next
        step, load, or reset or write through ``opt.state`` (then the shard, with a warning); asked by
        ``torch.distributed.checkpoint``'s state-dict helpers, the whole state on every rank (``dcp``). Registered
        state-dict hooks run as in ``torch.optim.Optimizer.state_dict``."""
        self.check_param_groups(numbering=True)  # the state is keyed as built, the groups' params as edited
        self._refuse_unfinished_load("state_dict()", "nothing was read")
        self.wait_params()
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        if self._consolidated is not None and self.state.version != self._consolidated_version:
            log.warning(STATE_CHANGED)
            self._consolidated = None
        if self._pipeline.num_shards > 1 and dcp.asked_by_dcp():  # collective: on rank ``to`` too, not the kept state
            if self._pipeline.dequantized_copies():
                raise ValueError(dcp.OUTSIDE_GATHERED)
            state_dict = optim_state.full(self)
        elif self._consolidated is not None:
            state_dict = optim_state.with_whole_meta(self, self._consolidated)
        else:
            state_dict = optim_state.sharded(self)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def full_state_dict(self) -> dict[str, Any]:
        """The whole state in ``torch.optim.AdamW``'s layout (a collective: call it on every rank)."""
        self.check_param_groups(numbering=True)
        self._refuse_unfinished_load("full_state_dict()", "nothing was read")
        self.wait_params()
        return optim_state.full(self)

    def _refuse_unfinished_load(self, action: str, left: str) -> None:
        """Raise while the last checkpoint load stopped part way (every rank holds the same: ``checkpoint.load``):
        what ``action`` would read is partly the checkpoint's (a state dict of it would pass for a whole one)."""
        refusal = zstate.unfinished_load(self._pipeline, f"ShardedFusedAdam.{action}")
        if refusal is not None:
            raise RuntimeError(f"{refusal}; {left}")

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole state (AdamW's layout) on rank ``to``, as ``ZeroRedundancyOptimizer`` does:
        a collective, call it on every rank; then ``state_dict()`` on rank ``to`` returns it (until the
        next step or load), in host memory as ``ZeroRedundancyOptimizer`` keeps it. Every rank holds one state kind
        of one flat buffer of it at a time on the device, and the other ranks keep nothing.

        Args:
            to: the rank (in this optimizer's process group) that receives the state.
        """
        world = self._engine.world_size
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < world:
            raise ValueError(f"consolidate_state_dict: to={to!r} is not a rank of this process group (0..{world - 1})")
        keep = self._engine.rank == to
        self.check_param_groups(numbering=True)
        self.wait_params()
        state = zstate.gather_full_state(self._pipeline, keep=keep, host=True)
        self._consolidated = state if keep else None
        self._consolidated_version = self.state.version

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()`` (same world size and stage) or ``full_state_dict()``/AdamW's (any).

        Registered load-state-dict hooks run as in ``torch.optim.Optimizer.load_state_dict`` (the pre
        hooks get a shallow copy and may return a replacement).

        Args:
            state_dict: a sharded or a full state; checked against this optimizer's parameters
                before anything changes (errors name the first mismatching parameter).
        """
        if not isinstance(state_dict, Mapping):
            kind = type(state_dict).__name__
            raise ValueError(f"load_state_dict: expected a dict with 'state' and 'param_groups', not a {kind}")
        state_dict = dict(state_dict)
        self.check_param_groups(numbering=True)
        self.wait_params()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._follow_replaced_params()  # model.to(...) copies: load into what the model reads
        optim_state.load(self, state_dict)
        self._consolidated = None
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # ---------------------------------------------------------------- copies
    def __getstate__(self) -> dict[str, Any]:
        """For pickle and ``torch.save(opt)``: a snapshot of this rank's part (see ``optim.copies``)."""
        self.wait_params()
        return optim_copy.snapshot(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild from ``__getstate__``'s snapshot on the same rank of a same-size process group: the settings,
        then engine, pipeline and param groups as at construction, then this rank's shards."""
        optim_copy.check(state)
        for key, value in optim_copy.settings(state).items():
            setattr(self, key, value)
        groups = optim_copy.param_groups(state)
        unfrozen = optim_copy.frozen_values(state)  # frozen as in the original while the copy is built
        self._build(groups, state["defaults"], module=state["module"], process_group=state["process_group"],
                    impl=state["impl"], restore=state["origin"])  # fmt: skip
        params = [p for g in groups for p in g["params"]]
        self._names.update({id(p): n for p, n in zip(params, state["names"]) if n is not None})
        optim_copy.load_shards(self, state)
        for p in unfrozen:
            p.requires_grad_(True)

    def __deepcopy__(self, memo: dict[int, Any]) -> "ShardedFusedAdam":
        self.wait_params()
        return optim_copy.deep_copy(self, memo)


def weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (bound) called through a weak reference to its object, so that what keeps it (the pipeline,
    ``opt.state``) keeps no reference back to the optimizer: without a reference cycle, ``del opt`` frees the
    optimizer and gives its parameters up at once, on every rank alike, not when each rank's collector runs."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        if bound is None:
            raise ReferenceError("the ShardedFusedAdam this belonged to was deleted")
        return bound(*args, **kwargs)

    return call


def _fp16_config(fp16: Any) -> Optional[FP16Config]:
    """``fp16=`` as an ``FP16Config`` (None: no loss scaling), or a ``TypeError`` naming it."""
    if isinstance(fp16, bool):
        return FP16Config(enabled=True) if fp16 else None
    if isinstance(fp16, Mapping):  # given as a keyword it reads as "on": DeepSpeed's block off only where it says so
        return FP16Config(**{"enabled": True, **fp16})
    if fp16 is None or isinstance(fp16, FP16Config):
        return fp16
    raise TypeError(
        f"fp16 must be an FP16Config, a dict of its fields (DeepSpeed's fp16 block), True, False or None; got "
        f"{type(fp16).__name__}"
    )


def _check_max_norm(max_norm: Any) -> None:
    if not max_norm >= 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be >= 0, got {max_norm!r}")


def _the_module(params_or_module: Any, module: Optional[nn.Module]) -> Optional[nn.Module]:
    """The model: ``params_or_module`` when it is one, else ``module`` (both given: they must agree)."""
    if module is not None and not isinstance(module, nn.Module):
        raise ValueError(f"module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(params_or_module, nn.Module):
        return module
    if module is not None and module is not params_or_module:
        raise ValueError("module= names another model than the one passed as params_or_module; pass one of them")
    return params_or_module
