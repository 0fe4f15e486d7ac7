"""``initialize``: a DeepSpeed JSON config -> the model, ``ShardedFusedAdam`` and its scheduler.

The one entry point for users coming from ``deepspeed.initialize``: the config is parsed by
``config.ZeroConfig`` (``"auto"`` values resolved as the Hugging Face Trainer does), the model cast
to the config's precision, and the optimizer built from the ``optimizer`` and
``zero_optimization`` sections.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from .comm import agreement, devices
from .config import ZeroConfig, client_optimizer
from .config.at_updates import gate
from .config.call_forms import align_local_rank, config_source, init_dist, refuse_deepspeed_only
from .config.files import load
from .config.hf import model_hidden_size
from .log import LOGGER_NAME
from .optim.args import check_process_group
from .optim.optimizer import ShardedFusedAdam
from .stages.ownership import others_held, refuse_held

__all__ = ["initialize"]

logger = logging.getLogger(LOGGER_NAME)
IGNORED_SECTION = (
    'initialize: optimizer= %s is used and the config\'s "optimizer" section is not (as in DeepSpeed, which '
    "uses the client optimizer)"
)


def initialize(
    model: nn.Module,
    config: Union[str, Mapping[str, Any], ZeroConfig, None] = None,
    *,
    process_group: Any = None,
    impl: Optional[str] = None,
    model_parameters: Optional[Iterable[Any]] = None,
    training_args: Any = None,
    optimizer: Any = None,
    lr_scheduler: Union[Callable[[ShardedFusedAdam], LRScheduler], LRScheduler, None] = None,
    args: Any = None,
    config_params: Union[str, Mapping[str, Any], None] = None,
    dist_init_required: Optional[bool] = None,
    **auto_values: Any,
) -> Union[tuple[nn.Module, ShardedFusedAdam], tuple[nn.Module, ShardedFusedAdam, LRScheduler]]:
    """Build the optimizer (and scheduler) a DeepSpeed config describes.

    Returns ``(model, optimizer)``, or ``(model, optimizer, lr_scheduler)`` when the config has a
    ``scheduler`` section: DeepSpeed's ``engine, optimizer, _, lr_scheduler = deepspeed.initialize(...)``
    becomes ``model, optimizer, lr_scheduler = zk.initialize(...)`` (a config with a scheduler
    unpacked into two names fails loudly instead of training at a constant lr). Call
    ``lr_scheduler.step()`` after each ``optimizer.step()``, micro-steps included: it advances only after
    an applied update (an accumulation boundary, not a skipped step), as DeepSpeed's engine steps it.

    The model is cast to bf16/fp16 when the config enables it (as DeepSpeed does). An initialize that raises
    once the optimizer exists (the scheduler's constructor) takes the optimizer off the model again (no hook of
    it stays; stage 3 gives every parameter its full value back), and an initialize that raises after the cast
    casts the model back to its dtypes and a client optimizer's param groups back as they were (empty ones
    included), so a corrected call can be made on the same model and client.

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
        optimizer: DeepSpeed's client optimizer: a ``torch.optim.AdamW`` or ``torch.optim.Adam`` over the model's
            parameters, or a callable building one from ``model_parameters``; the ``ShardedFusedAdam`` returned
            takes its param groups, hyper-parameters, weight-decay mode and state, and the config's ``optimizer``
            section is not used, as in DeepSpeed (``config.client_optimizer``).
        lr_scheduler: a callable that builds the scheduler on the optimizer (``lambda opt: StepLR(opt, 2)``), as
            DeepSpeed takes it, or a scheduler object built on ``optimizer``; it steps at applied updates as the
            config's does. Not with a ``scheduler`` section.
        args: DeepSpeed's argparse namespace: its ``deepspeed_config`` (or ``deepscale_config``) is the config; its
            ``local_rank``, where it has one, is set to the launcher's ``LOCAL_RANK``, as DeepSpeed sets it.
        config_params: DeepSpeed's older name for ``config``.
        dist_init_required: as DeepSpeed's: None (default) and True create the default process group from a
            launcher's environment (``torchrun``) where none exists; False never does. True with neither is an error.
        **auto_values: values for ``"auto"`` entries (see ``ZeroConfig.from_deepspeed``); the bucket
            sizes' ``hidden_size`` defaults to ``model.config.hidden_size`` when the model has one.
    """
    auto_values = refuse_deepspeed_only(auto_values)
    if "world_size" in auto_values:
        raise ValueError(
            "initialize: world_size= is not taken: the data-parallel size is process_group's (None: the default "
            "group's; 1 without torch.distributed). To check a config for another size without training, call "
            "zero_kernels.ZeroConfig.from_deepspeed(config, world_size=N)"
        )
    client = None if optimizer is None else client_optimizer.resolve(optimizer, model, model_parameters)
    _check_scheduler(lr_scheduler, client)
    config = config_source(config, config_params, args)
    check_process_group(process_group)
    init_dist(dist_init_required)
    align_local_rank(args)
    world = torch.distributed.get_world_size(process_group) if torch.distributed.is_initialized() else 1
    if client is not None:
        config = _without_optimizer_section(config, client)
    if not isinstance(config, ZeroConfig):
        if auto_values.get("hidden_size") is None:
            auto_values["hidden_size"] = model_hidden_size(model)
        config = ZeroConfig.from_deepspeed(config, world_size=world, training_args=training_args, **auto_values)
    elif training_args is not None or auto_values:
        raise ValueError("initialize: training_args and auto values apply to a DeepSpeed config, not to a ZeroConfig")
    else:
        _check_config_world(config, world)
    if config.optimizer is None and client is None:
        raise ValueError(
            'initialize: the config has no "optimizer" section; add {"type": "AdamW", "params": {...}}, or pass '
            "optimizer=torch.optim.AdamW(model.parameters(), ...)"
        )
    if lr_scheduler is not None and config.scheduler is not None:
        raise ValueError(
            'initialize: lr_scheduler= was given and the config has a "scheduler" section (DeepSpeed would use '
            "lr_scheduler= and ignore the section): give one"
        )
    model_parameters = _listed(model_parameters)
    taken = _taken(model, model_parameters, client)
    names = {id(p): name for name, p in model.named_parameters()}
    refuse_held(taken, lambda p: f"parameter {names.get(id(p), '?')!r}")
    if config.bf16 or config.fp16.enabled:  # the cast changes every parameter of the model, another optimizer's too
        refuse_held(model.parameters(), lambda p: _CAST_HELD.format(names[id(p)]))
    restore_dtypes = _cast(model, config)
    restore_client = (lambda: None) if client is None else client_optimizer.keep(client)
    built = None
    try:
        _broadcast_model(model, process_group, others_held(model.parameters(), taken))
        built = _build_optimizer(model, model_parameters, config, process_group, impl, client)
        if client is not None:
            client_optimizer.adopt_state(client, built)
        scheduler = _scheduler(config, lr_scheduler, built, client)
    except BaseException:
        if built is not None:  # its hooks come off (stage 3's gather every parameter back first)
            built._detach()
        restore_dtypes()
        restore_client()
        raise
    if client is not None:
        client_optimizer.retire(client, built)
    return (model, built) if scheduler is None else (model, built, scheduler)


def _check_config_world(config: ZeroConfig, world: int) -> None:
    """A ``ZeroConfig`` whose batch sizes (or hpZ size) were checked against another world size than the group's
    (``world``): one built before the process group existed (``initialize`` may create it) was derived for world
    size 1, and its ``gradient_accumulation_steps`` would then be the wrong one, silently."""
    if config.world_size == world or (config.train_batch_size is None and config.zero.hpz_partition_size <= 1):
        return
    raise ValueError(
        f"initialize: this ZeroConfig was built for world_size={config.world_size} (its batch sizes: "
        f"train_batch_size={config.train_batch_size}, gradient_accumulation_steps="
        f"{config.gradient_accumulation_steps}), but the process group has {world} ranks (a ZeroConfig built before "
        "the process group existed is checked for 1): pass the DeepSpeed config itself to initialize, or build the "
        f"ZeroConfig after init_process_group (ZeroConfig.from_deepspeed(config, world_size={world}))"
    )


def _without_optimizer_section(config: Any, client: torch.optim.Optimizer) -> Any:
    """The config without its ``optimizer`` section, which a client optimizer replaces (as in DeepSpeed, which does
    not read it then): neither checked nor read, also not for a scheduler's ``"auto"`` lr, which is then the
    client's (one WARNING when there was a section). A ``ZeroConfig`` is taken as built."""
    data = None if isinstance(config, ZeroConfig) else load(config)
    if (config.optimizer if data is None else data.get("optimizer")) is None:
        return config
    logger.warning(IGNORED_SECTION, type(client).__name__)
    return config if data is None else {key: value for key, value in data.items() if key != "optimizer"}


def _check_scheduler(lr_scheduler: Any, client: Optional[torch.optim.Optimizer]) -> None:
    if lr_scheduler is None or callable(lr_scheduler) or client_optimizer.built_on(lr_scheduler, client):
        return
    raise ValueError(
        f"initialize: lr_scheduler= a scheduler object ({type(lr_scheduler).__name__}) is not taken: it steps "
        "an optimizer other than the one initialize builds. Pass a callable that builds it on that optimizer "
        "(lr_scheduler=lambda optimizer: StepLR(optimizer, ...)), build it on the optimizer returned, or pass the "
        "optimizer it was built on as optimizer="
    )


def _scheduler(
    config: ZeroConfig, make: Any, optimizer: ShardedFusedAdam, client: Optional[torch.optim.Optimizer]
) -> Optional[LRScheduler]:
    """The config's scheduler, the one ``make(optimizer)`` builds, or ``make`` moved from the client onto
    ``optimizer`` (both stepping at applied updates), or None."""
    if make is None:
        return None if config.scheduler is None else config.scheduler.build(optimizer)
    if client_optimizer.built_on(make, client):
        return gate(client_optimizer.move_scheduler(make, optimizer))
    scheduler = make(optimizer)
    if not isinstance(scheduler, LRScheduler) or scheduler.optimizer is not optimizer:
        raise ValueError(
            f"initialize: lr_scheduler(optimizer) returned {type(scheduler).__name__}: expected a "
            "torch.optim.lr_scheduler.LRScheduler built on the optimizer it was given"
        )
    return gate(scheduler)


_CAST_HELD = (
    "parameter {!r}, which the config's cast of the whole model would change (initialize each part as a module of "
    "its own: zk.initialize(model.generator, config)),"
)


def _listed(model_parameters: Optional[Iterable[Any]]) -> Optional[Any]:
    """``model_parameters`` as a list, its groups' ``params`` too (``model.G.parameters()`` is an iterator, read
    once here to know what the optimizer takes, and again when it is built)."""
    if model_parameters is None or isinstance(model_parameters, torch.Tensor):
        return model_parameters  # a lone tensor: ShardedFusedAdam refuses it as torch does
    listed = []
    for entry in model_parameters:
        if isinstance(entry, Mapping) and "params" in entry and not isinstance(entry["params"], torch.Tensor):
            entry = {**entry, "params": list(entry["params"])}
        listed.append(entry)
    return listed


def _taken(model: nn.Module, model_parameters: Optional[Any], client: Optional[torch.optim.Optimizer]) -> list[Any]:
    """The parameters the optimizer being built takes: the client's, those of ``model_parameters``, or the model's."""
    if client is not None:
        return [p for g in client.param_groups for p in g["params"]]
    if model_parameters is None or isinstance(model_parameters, torch.Tensor):
        return list(model.parameters())
    taken = []
    for entry in model_parameters:
        params = entry["params"] if isinstance(entry, Mapping) and "params" in entry else [entry]
        taken += [params] if isinstance(params, torch.Tensor) else list(params)
    return taken


def _broadcast_model(model: nn.Module, process_group: Any, skip: set[int]) -> None:
    """Rank 0's parameter values on every rank where the ranks' values differ (after the cast, as
    ``deepspeed.initialize`` broadcasts them), said once at WARNING; ``ShardedFusedAdam`` itself refuses them.
    Nothing is compared on a device the group carries no tensors of (a model left on the CPU under
    ``init_process_group("nccl")``): ``ShardedFusedAdam`` refuses that, naming the fix. Parameters in ``skip``
    (``id``) are another optimizer's (a GAN's generator under one wrapper with the discriminator, each part
    initialized with its own ``model_parameters``): that optimizer's initialize broadcast them, and at stage 3 they
    are empty between uses."""
    named = [(name, p) for name, p in model.named_parameters() if id(p) not in skip]
    served = devices.group_device_types(process_group)
    if named and served is not None and named[0][1].device.type not in served:
        return
    moved = agreement.broadcast_differing([p for _, p in named], process_group)
    if moved:
        first = ", ".join(repr(named[i][0]) for i in moved[:3]) + (
            f" and {len(moved) - 3} more" if len(moved) > 3 else ""
        )
        logger.warning(
            "initialize: the ranks were given different values of %s; every rank now starts from %s values "
            "of the parameters, as deepspeed.initialize broadcasts them (buffers are left as they are)",
            first,
            _source_rank(process_group),
        )


def _source_rank(process_group: Any) -> str:
    """Whose values ``_broadcast_model`` sends, for its message: rank 0, named by its global rank where that differs
    (a ``process_group`` of ranks 1 and 2 takes global rank 1's values)."""
    source = 0 if process_group is None else torch.distributed.get_global_rank(process_group, 0)
    return "rank 0's" if source == 0 else f"process_group's rank 0's (global rank {source})"


def _cast(model: nn.Module, config: ZeroConfig) -> Callable[[], None]:
    """Cast ``model`` to the config's precision; returns what casts it back to the dtypes it had (an initialize
    that fails leaves the model as it found it, up to the rounding of the values)."""
    dtype = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16.enabled else None
    if dtype is None:
        return lambda: None
    params = {name: p.dtype for name, p in model.named_parameters()}
    buffers = {name: b.dtype for name, b in model.named_buffers()}
    model.to(dtype)

    def restore() -> None:
        for name, p in model.named_parameters():
            p.data = p.data.to(params[name])
        for name, b in model.named_buffers():
            owner, _, key = name.rpartition(".")
            setattr(model.get_submodule(owner), key, b.to(buffers[name]))

    return restore


def _build_optimizer(
    model: nn.Module,
    model_parameters: Optional[Iterable[Any]],
    config: ZeroConfig,
    process_group: Any,
    impl: Any,
    client: Optional[torch.optim.Optimizer],
) -> ShardedFusedAdam:
    """The ``ShardedFusedAdam`` of the config's ``optimizer`` section (or of the client optimizer's groups) and
    ``zero_optimization`` section."""
    if client is not None:
        params: Any = client_optimizer.groups(client)  # shared with the client
        algorithm = client_optimizer.hyper(client)
    else:
        params = model if model_parameters is None else model_parameters
        opt = config.optimizer
        algorithm = dict(lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay,
                         amsgrad=opt.amsgrad, maximize=opt.maximize, adam_w_mode=opt.adamw)  # fmt: skip
    return ShardedFusedAdam(
        params, **algorithm,
        process_group=process_group, impl=impl,
        max_grad_norm=config.gradient_clipping or None,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        fp16=config.fp16 if config.fp16.enabled else None,
        module=model, **config.sharded_options(),
    )  # fmt: skip
