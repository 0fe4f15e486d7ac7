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
  over ranks, as DDP; stage 1: the local gradient; stage 2: ``None``, as DeepSpeed).
- A parameter with no gradient on any rank in a step (``p.grad is None`` everywhere) is left
  alone, as ``torch.optim.AdamW`` does: value, m, v and its step count do not change.
- Accumulation: ``with opt.no_sync(): loss.backward()`` for all micro-steps but the last (grads
  accumulate locally; divide the loss yourself, as with DDP), or ``gradient_accumulation_steps=k``:
  call ``backward``/``step``/``zero_grad`` every micro-step; only every k-th ``step`` updates,
  ``zero_grad`` between is ignored, communication happens on the k-th, and the gradients are
  averaged over the k micro-steps (DeepSpeed's rule).
- fp16: ``opt.backward(loss)`` scales the loss by ``opt.loss_scale``; ``step`` unscales inside
  the kernel, skips the update on inf/NaN (on any rank) and adjusts the scale (``precision``).
- Clipping: ``max_grad_norm`` clips the global norm (one all-reduce of a scalar, shared with the
  "has a gradient" flags), folded into the kernel's gradient multiplier.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Union

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from .comm import make_engine
from .config import FP16Config, ZeroConfig, ZeroOptions
from .config.hf import model_hidden_size
from .precision import LossScaler
from .stages import GroupHyper, Pipeline, StepResult, pipeline_class, requires_module, storage_bytes
from .stages import state as zstate

_ADAMW_GROUP_KEYS = dict(
    amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None
)
_FORMAT = "zero_kernels.sharded"


def check_hyper(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """``torch.optim.AdamW``'s argument checks, with its wording."""
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


class ShardedFusedAdam(torch.optim.Optimizer):
    """Adam/AdamW with ZeRO-sharded state and a fused update.

    Args:
        params_or_module: an ``nn.Module`` (its parameters form one group), or parameters / param-group
            dicts, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (same defaults and checks).
        stage: ZeRO stage 0-3.
        process_group: data-parallel group (None: the default group, or a single process).
        impl: kernel backend, ``auto | triton | cpu | torch`` (None: ``ZERO_KERNELS_IMPL``).
        adam_w_mode: decoupled weight decay (AdamW) if True; L2 added to the gradient (Adam) if False.
        max_grad_norm: clip the global gradient norm to this value (None or 0: no clipping).
        gradient_accumulation_steps: micro-steps per update (see the module docstring).
        fp16: an ``FP16Config`` (or its fields as a dict) enabling loss scaling.
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
        *,
        stage: int = 1,
        process_group: Any = None,
        impl: Optional[str] = None,
        adam_w_mode: bool = True,
        max_grad_norm: Optional[float] = None,
        gradient_accumulation_steps: int = 1,
        fp16: Union[FP16Config, Mapping[str, Any], None] = None,
        module: Optional[nn.Module] = None,
        **zero_options: Any,
    ):
        check_hyper(lr, betas, eps, weight_decay)
        self.options = ZeroOptions.from_dict({"stage": stage, **zero_options})
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(
                f"gradient_accumulation_steps must be an integer >= 1, got {gradient_accumulation_steps!r}"
            )
        if max_grad_norm is not None and not max_grad_norm >= 0:
            raise ValueError(f"max_grad_norm must be >= 0 or None, got {max_grad_norm!r}")
        module = _the_module(params_or_module, module)
        if module is None and requires_module(self.options.stage):
            raise ValueError(
                f"stage {self.options.stage} gathers parameters with module hooks: pass the model "
                "(ShardedFusedAdam(model, ...)), or the parameters or groups with module=model"
            )
        self.adam_w_mode = bool(adam_w_mode)
        self.max_grad_norm = max_grad_norm or None
        self.gradient_accumulation_steps = gradient_accumulation_steps
        if isinstance(fp16, Mapping):
            fp16 = FP16Config(**fp16)
        self.loss_scaler = LossScaler.from_fp16_config(fp16) if fp16 is not None and fp16.enabled else None
        self._names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
        self._micro_step = 0
        self._no_sync_depth = 0
        self.last_step: Optional[StepResult] = None
        self._engine = make_engine(process_group)
        self._pipeline = pipeline_class(self.options.stage)(self._engine, self.options, impl=impl, module=module)
        params = module.parameters() if params_or_module is module else params_or_module
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._update_sync()

    # ---------------------------------------------------------------- param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (checked like torch's); its parameters join the sharded buffers.

        Args:
            param_group: ``{"params": [...], **hyper-parameter overrides}``.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            first = sum(len(g["params"]) for g in self.param_groups[:-1])
            indices = list(range(first, first + len(group["params"])))
            self._check_replicated(group["params"], indices)
            self._pipeline.add_group(len(self.param_groups) - 1, group["params"], indices)
        except Exception:
            self.param_groups.pop()  # the pipeline checks before it changes anything
            raise

    def _param_name(self, index: int) -> str:
        i = index
        for g, group in enumerate(self.param_groups):
            if i < len(group["params"]):
                name = self._names.get(id(group["params"][i])) or (group.get("param_names") or [None] * (i + 1))[i]
                return f"parameter {index} ({name!r}, group {g})" if name else f"parameter {index} (group {g})"
            i -= len(group["params"])
        return f"parameter {index}"

    def _check_replicated(self, params: list[torch.Tensor], indices: list[int]) -> None:
        """Sizes and checksums of ``params`` must agree on every rank (two small all-reduces)."""
        if self._engine.world_size == 1:
            return
        device = params[0].device if params else torch.device("cpu")
        count = torch.tensor([len(params), -len(params)], dtype=torch.float64, device=device)
        self._engine.all_reduce(count, op="max", name="check.count").wait()
        if count[0] != -count[1]:
            raise ValueError(
                f"the ranks pass different numbers of parameters to the optimizer ({int(-count[1])} to {int(count[0])})"
            )
        stats = torch.zeros(2 * len(params), dtype=torch.float64, device=device)
        for i, p in enumerate(params):
            stats[2 * i] = p.numel()
            stats[2 * i + 1] = p.detach().double().sum()
        packed = torch.cat([stats, -stats])
        self._engine.all_reduce(packed, op="max", name="check.params").wait()
        differ = (packed[: stats.numel()] != -packed[stats.numel() :]).nonzero().flatten().tolist()
        if differ:
            what = "size" if differ[0] % 2 == 0 else "values"
            raise ValueError(
                f"{self._param_name(indices[differ[0] // 2])} has a different {what} on some rank: every rank "
                "must start from the same model (same seed, or broadcast rank 0's parameters first)"
            )

    # ---------------------------------------------------------------- training loop
    def _update_sync(self) -> None:
        last_micro = self._micro_step == self.gradient_accumulation_steps - 1
        self._pipeline.sync_enabled = last_micro and self._no_sync_depth == 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside communicates."""
        self._no_sync_depth += 1
        self._update_sync()
        try:
            yield
        finally:
            self._no_sync_depth -= 1
            self._update_sync()

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
        """``(loss * loss_scale).backward(**kwargs)``: the fp16 way to run backward.

        Args:
            loss: the scalar loss of this micro-step.
            **kwargs: passed to ``Tensor.backward``.
        """
        (loss * self.loss_scale).backward(**kwargs)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One optimizer step (or one accumulation micro-step, see the module docstring).

        Args:
            closure: re-evaluates the model and returns the loss (optional).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._micro_step += 1
        if self._micro_step < self.gradient_accumulation_steps:
            self._update_sync()
            return loss
        self._micro_step = 0
        hyper = [self._hyper(g) for g in self.param_groups]
        scale = 1.0 / (self.loss_scale * self.gradient_accumulation_steps)
        self.last_step = self._pipeline.step(
            hyper, grad_scale=scale, max_grad_norm=self.max_grad_norm, check_finite=self.loss_scaler is not None
        )
        if self.loss_scaler is not None:
            self.loss_scaler.update(self.last_step.skipped)
        self._update_sync()
        return loss

    def _hyper(self, g: Mapping[str, Any]) -> GroupHyper:
        b1, b2 = (float(b) for b in g["betas"])
        return GroupHyper(float(g["lr"]), b1, b2, float(g["eps"]), float(g["weight_decay"]), self.adam_w_mode)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; ignored between accumulation micro-steps.

        Args:
            set_to_none: drop the gradients (``p.grad = None``) instead of zeroing them.
        """
        if self._micro_step != 0:
            return
        self._pipeline.zero_grad(set_to_none)

    def gathered_params(self) -> contextlib.AbstractContextManager:
        """Full parameters inside the block (stage 3 gathers them; stages 0-2 always have them)."""
        return self._pipeline.gathered_params()

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds, measured from the storages: ``params``, ``grads`` and ``optimizer``
        state (the model states of DESIGN.md's formula), and ``buffers``, the idle gradient buckets
        kept for reuse by stages 2 and 3 (a few ``reduce_bucket_size`` buckets)."""
        held = self._pipeline.memory_tensors()
        params = [p for g in self.param_groups for p in g["params"]]
        return {
            "params": storage_bytes(held["params"] + params),
            "grads": storage_bytes(held["grads"] + [p.grad for p in params]),
            "optimizer": storage_bytes(held["optimizer"]),
            "buffers": storage_bytes(held["buffers"]),
        }

    # ---------------------------------------------------------------- state dicts
    def _groups_for_save(self, extra: Mapping[str, Any]) -> list[dict[str, Any]]:
        out, index = [], 0
        for g in self.param_groups:
            saved = {k: v for k, v in g.items() if k != "params"}
            saved.update({k: saved.get(k, v) for k, v in extra.items()})
            saved["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            out.append(saved)
        return out

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the state (reload with the same world size, stage and model)."""
        return {
            "state": dict(enumerate(zstate.shard_state(self._pipeline))),
            "param_groups": self._groups_for_save({}),
            _FORMAT: {
                "layout": zstate.layout_signature(self._pipeline),
                "steps": dict(self._pipeline.steps),
                "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
                "shapes": [tuple(self._pipeline.param_shape(p)) for g in self.param_groups for p in g["params"]],
            },
        }

    def full_state_dict(self) -> dict[str, Any]:
        """The whole state in ``torch.optim.AdamW``'s layout (a collective: call it on every rank)."""
        groups = self._groups_for_save({**_ADAMW_GROUP_KEYS, "decoupled_weight_decay": self.adam_w_mode})
        return {"state": zstate.gather_full_state(self._pipeline), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()`` (same world size and stage) or ``full_state_dict()``/AdamW's (any).

        Args:
            state_dict: a sharded or a full state; checked against this optimizer's parameters
                before anything changes (errors name the first mismatching parameter).
        """
        sharded = _FORMAT in state_dict
        self._check_groups(state_dict)
        if sharded:
            self._check_sharded(state_dict[_FORMAT])
        else:
            self._check_full(state_dict["state"])
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k in group and k != "params"})
        if sharded:
            meta = state_dict[_FORMAT]
            zstate.load_shard_state(self._pipeline, [state_dict["state"][i] for i in range(len(state_dict["state"]))])
            self._pipeline.steps.update({int(k): int(v) for k, v in meta["steps"].items()})
            if self.loss_scaler is not None and meta["loss_scaler"] is not None:
                self.loss_scaler.load_state_dict(meta["loss_scaler"])
        else:
            zstate.scatter_full_state(self._pipeline, {int(k): v for k, v in state_dict["state"].items()})

    def _check_groups(self, state_dict: Mapping[str, Any]) -> None:
        saved = state_dict.get("param_groups")
        if not isinstance(saved, list) or "state" not in state_dict:
            raise ValueError("load_state_dict: expected a dict with 'state' and 'param_groups'")
        if len(saved) != len(self.param_groups):
            raise ValueError(
                f"load_state_dict: the state has {len(saved)} param groups, this optimizer {len(self.param_groups)}"
            )
        for g, (mine, theirs) in enumerate(zip(self.param_groups, saved)):
            if len(mine["params"]) != len(theirs["params"]):
                raise ValueError(
                    f"load_state_dict: param group {g} has {len(theirs['params'])} parameters in the state "
                    f"but {len(mine['params'])} here"
                )

    def _check_shapes(self, shapes: Mapping[int, tuple]) -> None:
        here = [tuple(self._pipeline.param_shape(p)) for g in self.param_groups for p in g["params"]]
        for index in sorted(shapes):
            if not 0 <= index < len(here) or here[index] != tuple(shapes[index]):
                mine = here[index] if 0 <= index < len(here) else "no such parameter"
                raise ValueError(
                    f"load_state_dict: {self._param_name(index)} has shape {tuple(shapes[index])} in the state "
                    f"but {mine} here: the state comes from another model"
                )

    def _check_full(self, state: Mapping[Any, Any]) -> None:
        trainable = {i for g in self._pipeline.buffers for i in g.indices}
        shapes = {}
        for key, entry in state.items():
            missing = [k for k in ("step", "exp_avg", "exp_avg_sq") if k not in entry]
            if missing:
                raise ValueError(f"load_state_dict: state[{key!r}] lacks {', '.join(missing)} (AdamW layout expected)")
            shapes[int(key)] = tuple(entry["exp_avg"].shape)
        self._check_shapes(shapes)
        frozen = sorted(set(shapes) - trainable)
        if frozen:
            raise ValueError(f"load_state_dict: {self._param_name(frozen[0])} has state but is frozen here")

    def _check_sharded(self, meta: Mapping[str, Any]) -> None:
        self._check_shapes(dict(enumerate(meta["shapes"])))
        if len(meta["shapes"]) != sum(len(g["params"]) for g in self.param_groups):
            raise ValueError("load_state_dict: the state holds a different number of parameters")
        if meta["layout"] != zstate.layout_signature(self._pipeline):
            stage, world, _ = meta["layout"]
            raise ValueError(
                f"load_state_dict: this sharded state was saved by stage {stage} on {world} ranks with another "
                f"layout (here: stage {self._pipeline.stage}, {self._engine.world_size} ranks, "
                f"reduce_bucket_size {self.options.reduce_bucket_size}); use full_state_dict() to change them"
            )


def _the_module(params_or_module: Any, module: Optional[nn.Module]) -> Optional[nn.Module]:
    """The model: ``params_or_module`` when it is one, else ``module`` (both given: they must agree)."""
    if module is not None and not isinstance(module, nn.Module):
        raise ValueError(f"module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(params_or_module, nn.Module):
        return module
    if module is not None and module is not params_or_module:
        raise ValueError("module= names another model than the one passed as params_or_module; pass one of them")
    return params_or_module


def initialize(
    model: nn.Module,
    config: Union[str, Mapping[str, Any], ZeroConfig],
    *,
    process_group: Any = None,
    impl: Optional[str] = None,
    model_parameters: Optional[Iterable[Any]] = None,
    training_args: Any = None,
    **auto_values: Any,
) -> Union[tuple[nn.Module, ShardedFusedAdam], tuple[nn.Module, ShardedFusedAdam, LRScheduler]]:
    """Build the optimizer (and scheduler) a DeepSpeed config describes.

    Returns ``(model, optimizer)``, or ``(model, optimizer, lr_scheduler)`` when the config has a
    ``scheduler`` section: DeepSpeed's ``engine, optimizer, _, lr_scheduler = deepspeed.initialize(...)``
    becomes ``model, optimizer, lr_scheduler = zk.initialize(...)`` (a config with a scheduler
    unpacked into two names fails loudly instead of training at a constant lr). Call
    ``lr_scheduler.step()`` after each ``optimizer.step()``, as DeepSpeed's engine does.

    The model is cast to bf16/fp16 when the config enables it (as DeepSpeed does).

    Args:
        model: the model, replicated on every rank.
        config: path of a DeepSpeed JSON file, its content as a dict, or a ``ZeroConfig``.
        process_group: data-parallel group (None: the default group).
        impl: kernel backend (None: ``ZERO_KERNELS_IMPL``).
        model_parameters: parameters or param-group dicts of ``model`` (DeepSpeed's name; None: all
            of ``model``'s parameters in one group); the cast keeps the ``Parameter`` objects, so
            groups built before ``initialize`` stay valid.
        training_args: a Hugging Face ``TrainingArguments`` whose values fill ``"auto"`` entries as
            the Trainer does (transformers is not imported; any object with its attributes works).
        **auto_values: values for ``"auto"`` entries (see ``ZeroConfig.from_deepspeed``); the bucket
            sizes' ``hidden_size`` defaults to ``model.config.hidden_size`` when the model has one.
    """
    if not isinstance(config, ZeroConfig):
        world = torch.distributed.get_world_size(process_group) if torch.distributed.is_initialized() else 1
        if auto_values.get("hidden_size") is None:
            auto_values["hidden_size"] = model_hidden_size(model)
        config = ZeroConfig.from_deepspeed(config, world_size=world, training_args=training_args, **auto_values)
    elif training_args is not None or auto_values:
        raise ValueError("initialize: training_args and auto values apply to a DeepSpeed config, not to a ZeroConfig")
    if config.optimizer is None:
        raise ValueError('initialize: the config has no "optimizer" section; add {"type": "AdamW", "params": {...}}')
    if config.bf16:
        model = model.to(torch.bfloat16)
    elif config.fp16.enabled:
        model = model.half()
    opt = config.optimizer
    zero = {f.name: getattr(config.zero, f.name) for f in dataclasses.fields(config.zero) if f.name != "stage"}
    params = model if model_parameters is None else model_parameters
    optimizer = ShardedFusedAdam(
        params, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay,
        stage=config.stage, process_group=process_group, impl=impl, adam_w_mode=opt.adamw,
        max_grad_norm=config.gradient_clipping or None,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        fp16=config.fp16 if config.fp16.enabled else None, module=model, **zero,
    )  # fmt: skip
    if config.scheduler is None:
        return model, optimizer
    return model, optimizer, config.scheduler.build(optimizer)
