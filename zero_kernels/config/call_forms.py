"""``deepspeed.initialize``'s arguments as ``zk.initialize`` takes them, or refuses them saying what to do instead.

The config comes from ``config=``, ``config_params=`` (DeepSpeed's older name) or ``args.deepspeed_config``
(``args.deepscale_config``, older still), with DeepSpeed 0.19's precedence and conflicts: ``config`` before
``config_params``; a config both in ``args`` and in the call, or in both of ``args``' fields, is an error.
``dist_init_required``: ``initialize`` creates the process group from a launcher's environment, as DeepSpeed does,
and sets ``args.local_rank`` to the launcher's ``LOCAL_RANK``, as DeepSpeed sets it.
``optimizer=`` (a client Adam or AdamW) and ``lr_scheduler=`` are ``initialize``'s own (``client_optimizer``); the
arguments that hand ``initialize`` an object zero_kernels does not build with (a data set, a model-parallel unit)
are refused, naming the argument and what to do instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, Optional

import torch

log = logging.getLogger("zero_kernels")

_INSTEAD = {
    "training_data": (
        "initialize returns no data loader; build torch.utils.data.DataLoader(dataset, batch_size="
        "<train_micro_batch_size_per_gpu>, sampler=torch.utils.data.distributed.DistributedSampler(dataset), "
        "collate_fn=...) yourself (a config giving train_batch_size alone: zero_kernels.ZeroConfig.from_deepspeed("
        "config, world_size=torch.distributed.get_world_size()).train_micro_batch_size_per_gpu is DeepSpeed's, "
        "train_batch_size / (world size * gradient_accumulation_steps))"
    ),
    "mpu": (
        "model and pipeline parallelism are not supported: zero_kernels shards over one data-parallel group; "
        "pass that group as process_group="
    ),
    "mesh_param": "a device mesh is not supported: pass the data-parallel group as process_group=",
    "distributed_port": (
        "initialize makes the process group from the launcher's environment, MASTER_ADDR and MASTER_PORT as torchrun "
        "sets them: set MASTER_PORT, or call torch.distributed.init_process_group first"
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


LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets for init_process_group


def init_dist(required: Any) -> None:
    """``dist_init_required`` as ``deepspeed.initialize`` takes it: None (its default) and True create the default
    process group where none exists and a launcher (``torchrun``) set ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT``, as ``deepspeed.init_distributed`` does, with torch's default backends (gloo for CPU tensors, NCCL
    for CUDA ones where CUDA is there); False never creates it. True with neither a group nor that environment is an
    error (DeepSpeed would look for MPI's).

    Args:
        required: ``deepspeed.initialize``'s ``dist_init_required``.
    """
    if required is not None and required is not True and required is not False:
        raise ValueError(f"initialize: dist_init_required={required!r} is invalid: expected True, False or None")
    if required is False or not torch.distributed.is_available() or torch.distributed.is_initialized():
        return
    missing = [name for name in LAUNCHER_ENV if not os.environ.get(name)]
    if not missing:
        torch.distributed.init_process_group()
        log.info(
            "zero_kernels: initialize created the process group from the launcher's environment (rank %d of %d), as "
            "deepspeed.initialize does",
            torch.distributed.get_rank(),
            torch.distributed.get_world_size(),
        )
    elif required is True:
        raise ValueError(
            "initialize: dist_init_required=True, no process group and no launcher's environment "
            f"({', '.join(missing)} not set): start the script with torchrun, or call "
            "torch.distributed.init_process_group first"
        )


def align_local_rank(args: Any) -> None:
    """``args.local_rank`` set to the launcher's ``LOCAL_RANK`` where ``args`` has the attribute and the variable is
    set, as ``deepspeed.initialize`` sets it: scripts read it after initialize (``if args.local_rank == 0: save``),
    and torchrun passes no ``--local_rank``, so it stayed at the parser's -1 on every rank. A different value of
    0 or more given there is an error, as DeepSpeed asserts. A string (``--local_rank`` parsed without
    ``type=int``) is compared as its number and stays a string.

    Args:
        args: ``deepspeed.initialize``'s argparse namespace, or None.
    """
    local = os.environ.get("LOCAL_RANK")
    if args is None or not hasattr(args, "local_rank") or not local:
        return
    given = args.local_rank
    number = _integer(given)
    if number is not None and number >= 0 and number != int(local):
        raise ValueError(
            f"initialize: args.local_rank is {given!r} but the launcher's LOCAL_RANK is {local} (DeepSpeed refuses "
            "the mismatch too): pass the launcher's value, or leave --local_rank out under torchrun"
        )
    args.local_rank = local if isinstance(given, str) else int(local)


def _integer(value: Any) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


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
