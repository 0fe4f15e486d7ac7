"""The device a rank works on: its parameters', never merely the current CUDA device.

``torchrun`` starts one process per GPU and sets ``LOCAL_RANK``; every process starts with
``cuda:0`` current. A process that moved its model to ``cuda:LOCAL_RANK`` without
``torch.cuda.set_device(LOCAL_RANK)`` would still queue whatever follows the current device on
``cuda:0``: Triton launches, events, pinned copies, and NCCL communicators of tensors it makes
itself (every rank on GPU 0: "Duplicate GPU detected", or a context on GPU 0 per rank). So the
optimizer works on its parameters' device, names it in every exchange it makes, and refuses to be
built while another CUDA device is current, on every rank, with the fix.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch

from .agreement import ranks_text
from .objects import all_gather_objects

FIX = (
    "call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) first thing in the script (before building the "
    "model; and init_process_group(..., device_id=...) with that device), as examples/train.py does"
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


def check_current_device(engine: Any, device: Optional[torch.device], *, exchange: bool = True) -> None:
    """Raise ``ValueError`` (on every rank, when ``exchange``) unless each rank's current CUDA device is
    its parameters' device.

    Args:
        engine: the optimizer's comm engine.
        device: this rank's parameters' device.
        exchange: compare over the ranks (one small exchange on ``device``), so that every rank raises;
            False for a copy, which must not communicate: then only this rank's device is checked.
    """
    mine = current_device_problem(device)
    if not exchange or engine.world_size == 1:
        problems = [mine]
    else:
        problems = all_gather_objects(engine, mine, name="check.device", device=device)
    bad = [(rank, problem) for rank, problem in enumerate(problems) if problem is not None]
    if not bad:
        return
    where = "" if len(problems) == 1 else f"on {ranks_text([rank for rank, _ in bad])}: "
    raise ValueError(f"ShardedFusedAdam: {where}{bad[0][1]}; {FIX}")
