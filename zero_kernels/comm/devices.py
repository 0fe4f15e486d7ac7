"""The device a rank works on: its parameters', never merely the current CUDA device.

``torchrun`` starts one process per GPU and sets ``LOCAL_RANK``; every process starts with
``cuda:0`` current. A process that moved its model to ``cuda:LOCAL_RANK`` without
``torch.cuda.set_device(LOCAL_RANK)`` would still queue whatever follows the current device on
``cuda:0``: Triton launches, events, pinned copies, and NCCL communicators of tensors it makes
itself (every rank on GPU 0: "Duplicate GPU detected", or a context on GPU 0 per rank). So the
optimizer works on its parameters' device, names it in every exchange it makes, and refuses to be
built while another CUDA device is current, on every rank, with the fix.

Parameters on a device the process group carries no tensors of are refused the same way: a model left on the CPU
(``deepspeed.initialize`` moves the model to its GPU, ``zk.initialize`` does not) under
``init_process_group("nccl")``, whose group carries CUDA tensors only ("cuda:nccl"), failed at the optimizer's first
internal exchange with c10d's "No backend type associated with device type cpu", naming neither the model nor the
fix. The check's own exchange then runs, on such a rank, on a device the group carries (its current GPU).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch
import torch.distributed as dist

from .agreement import ranks_text
from .objects import all_gather_objects

FIX = (
    "call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) first thing in the script (before building the "
    "model; and init_process_group(..., device_id=...) with that device), as examples/train.py does"
)
UNSERVED = "tensors only (backend"  # what an ``unserved_problem`` says, and a ``current_device_problem`` not
UNSERVED_FIX = (
    "move the model to this rank's GPU before building the optimizer (torch.cuda.set_device(int(os.environ"
    "['LOCAL_RANK'])), then model.to(torch.cuda.current_device()); zk.initialize does not move the model, "
    "deepspeed.initialize does), as examples/train.py does"
)


def parameters_device(groups: Iterable[Mapping[str, Any]]) -> Optional[torch.device]:
    """The device of the first parameter of ``groups`` (checked param-group dicts: all on one device), or None.

    A group's ``params`` are tensors or ``(name, tensor)`` pairs, or one tensor, as ``torch.optim`` takes them.
    """
    for group in groups:
        params = group["params"]
        for p in [params] if isinstance(params, torch.Tensor) else params:
            tensor = p[1] if isinstance(p, tuple) else p
            if isinstance(tensor, torch.Tensor):
                return tensor.device
    return None


def current_device_problem(device: Optional[torch.device]) -> Optional[str]:
    """Why this rank's current CUDA device cannot serve parameters on ``device``, or None when it can."""
    if device is None or device.type != "cuda":
        return None
    current = torch.cuda.current_device()
    if device.index is None or device.index == current:
        return None
    return f"the parameters are on {device} but cuda:{current} is the current device"


def group_device_types(group: Any) -> Optional[frozenset[str]]:
    """The device types whose tensors process group ``group`` carries ("cuda:nccl": cuda; None: the default
    group), or None where that is not known."""
    try:
        config = str(dist.get_backend_config(group))
    except (AttributeError, RuntimeError, ValueError):
        return None
    types = frozenset(part.split(":", 1)[0] for part in config.split(",") if ":" in part)
    return types or None


def served_device_types(engine: Any) -> Optional[frozenset[str]]:
    """The device types whose tensors ``engine``'s process group carries, or None where that is not known or not
    needed (one rank: nothing is exchanged)."""
    if engine.world_size == 1:
        return None
    try:
        group = engine.group
    except AttributeError:  # an engine that does not say its group: not known
        return None
    return group_device_types(group)


def unserved_problem(engine: Any, device: Optional[torch.device]) -> Optional[str]:
    """Why ``engine``'s process group cannot carry this rank's parameters on ``device``, or None when it can."""
    served = served_device_types(engine)
    if device is None or served is None or device.type in served:
        return None
    kinds = " and ".join(sorted(served))
    return f"the parameters are on {device} but the process group carries {kinds} {UNSERVED} {engine.backend})"


def _exchange_device(device: Optional[torch.device], unserved: bool, served: Optional[frozenset[str]]) -> Any:
    """Where this rank's part of the check's exchange runs: the parameters' device, else one the group carries
    (None: none here; the rank then raises alone)."""
    if not unserved:
        return device
    if served is not None and "cuda" in served and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if served is not None and "cpu" in served:
        return torch.device("cpu")
    return None


def check_current_device(engine: Any, device: Optional[torch.device], *, exchange: bool = True) -> None:
    """Raise ``ValueError`` (on every rank, when ``exchange``) unless each rank's current CUDA device is
    its parameters' device.

    Args:
        engine: the optimizer's comm engine.
        device: this rank's parameters' device.
        exchange: compare over the ranks (one small exchange on ``device``), so that every rank raises;
            False for a copy, which must not communicate: then only this rank's device is checked.
    """
    unserved = unserved_problem(engine, device)
    mine = unserved or current_device_problem(device)
    on = _exchange_device(device, unserved is not None, served_device_types(engine))
    if not exchange or engine.world_size == 1 or (unserved is not None and on is None):
        problems = [mine]
    else:
        problems = all_gather_objects(engine, mine, name="check.device", device=on)
    bad = [(rank, problem) for rank, problem in enumerate(problems) if problem is not None]
    if not bad:
        return
    where = "" if len(problems) == 1 else f"on {ranks_text([rank for rank, _ in bad], engine.global_ranks)}: "
    fix = UNSERVED_FIX if UNSERVED in bad[0][1] else FIX
    raise ValueError(f"ShardedFusedAdam: {where}{bad[0][1]}; {fix}")
