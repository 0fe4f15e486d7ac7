"""``deepspeed.initialize``'s arguments as ``zk.initialize`` takes them, or refuses them saying what to do instead.

The config comes from ``config=``, ``config_params=`` (DeepSpeed's older name) or ``args.deepspeed_config``
(``args.deepscale_config``, older still), with DeepSpeed 0.19's precedence and conflicts: ``config`` before
``config_params``; a config both in ``args`` and in the call, or in both of ``args``' fields, is an error.
``dist_init_required`` is checked only: ``initialize`` never creates the process group.
``optimizer=`` (a client Adam or AdamW) and ``lr_scheduler=`` are ``initialize``'s own (``client_optimizer``); the
arguments that hand ``initialize`` an object zero_kernels does not build with (a data set, a model-parallel unit)
are refused, naming the argument and what to do instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

_INSTEAD = {
    "training_data": (
        "initialize returns no data loader; build torch.utils.data.DataLoader(dataset, batch_size="
        "<train_micro_batch_size_per_gpu>, sampler=torch.utils.data.distributed.DistributedSampler(dataset), "
        "collate_fn=...) yourself"
    ),
    "mpu": (
        "model and pipeline parallelism are not supported: zero_kernels shards over one data-parallel group; "
        "pass that group as process_group="
    ),
    "mesh_param": "a device mesh is not supported: pass the data-parallel group as process_group=",
    "distributed_port": (
        "initialize does not create the process group: call torch.distributed.init_process_group first "
        "(torchrun sets its address and port)"
    ),
}
_INSTEAD["collate_fn"] = _INSTEAD["training_data"]
DEEPSPEED_ONLY = frozenset(_INSTEAD)


def refuse_deepspeed_only(keywords: Mapping[str, Any]) -> dict[str, Any]:
    """Raise ``ValueError`` for the first of ``keywords`` that is a ``deepspeed.initialize`` argument not taken and
    given a value; None, its default there, is taken (scripts pass it explicitly: ``mpu=mpu if ... else None``).

    Args:
        keywords: the keyword arguments ``initialize`` did not name.

    Returns:
        The other keywords (those arguments given as None left out).
    """
    for name, value in keywords.items():
        if name in DEEPSPEED_ONLY and value is not None:
            raise ValueError(f"initialize: {name}= (deepspeed.initialize's) is not taken: {_INSTEAD[name]}")
    return {name: value for name, value in keywords.items() if name not in DEEPSPEED_ONLY}


def check_dist_init(required: Any) -> None:
    """``dist_init_required``: None and False ask nothing here (the process group is never created by
    ``initialize``); True is an error unless the group exists, as DeepSpeed would create it.

    Args:
        required: ``deepspeed.initialize``'s ``dist_init_required``.
    """
    if required is None or required is False or (required is True and torch.distributed.is_initialized()):
        return
    if required is True:
        raise ValueError(
            "initialize: dist_init_required=True: initialize does not create the process group (deepspeed.initialize "
            "does): call torch.distributed.init_process_group first (torchrun sets its environment)"
        )
    raise ValueError(f"initialize: dist_init_required={required!r} is invalid: expected True, False or None")


def config_source(config: Any, config_params: Any, args: Any) -> Any:
    """The config given by ``config``, ``config_params`` or ``args.deepspeed_config``, as DeepSpeed picks it.

    Args:
        config: ``initialize``'s ``config``.
        config_params: DeepSpeed's older name for it.
        args: an argparse namespace with ``deepspeed_config`` (or ``deepscale_config``), or None.
    """
    if config is not None and config_params is not None:
        raise ValueError(
            "initialize: both config= and config_params= were given (DeepSpeed would use config and ignore "
            "config_params): give one"
        )
    config = config if config is not None else config_params
    from_args = _from_args(args)
    if from_args is not None and config is not None:
        raise ValueError(
            "initialize: a config was given both in args.deepspeed_config and in the call (config= or "
            "config_params=), as DeepSpeed refuses: give one"
        )
    config = config if config is not None else from_args
    if config is None:
        raise ValueError(
            "initialize: no config: pass config= (a JSON file's path, a dict or a ZeroConfig), config_params=, "
            "or args= with a deepspeed_config attribute"
        )
    return config


def _from_args(args: Any) -> Optional[Any]:
    """``args.deepspeed_config``, or the older ``args.deepscale_config`` (both set: an error, as in DeepSpeed)."""
    if args is None:
        return None
    new, old = getattr(args, "deepspeed_config", None), getattr(args, "deepscale_config", None)
    if new is not None and old is not None:
        raise ValueError("initialize: args has both deepscale_config and deepspeed_config: give deepspeed_config only")
    return new if new is not None else old
