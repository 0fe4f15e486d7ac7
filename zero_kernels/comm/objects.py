"""Exchanges of host data between ranks through a comm engine: Python objects.

``all_gather_objects`` is what ``dist.all_gather_object`` does, through an engine (so a process
may exit right after it returns); ``collective_device`` says where such an exchange runs when the
caller names no device. The engine on which host-side checks run without waiting for a GPU's
queued work is the control group's (``control``).
"""

from __future__ import annotations

import pickle
import struct
from typing import Any, Optional

import torch

from .engines import CommEngine


def collective_device(engine: CommEngine) -> torch.device:
    """Where small exchanges of ``engine`` run when the caller names no device: the CPU, or on NCCL the
    device its process group is bound to (``init_process_group(device_id=...)``). Never merely the
    current CUDA device: on a rank that did not call ``torch.cuda.set_device`` that is GPU 0 on every rank.

    Raises ``ValueError`` on NCCL without a bound device: the caller must name its tensors' device.
    """
    if engine.backend != "nccl":
        return torch.device("cpu")
    bound = getattr(engine.group, "bound_device_id", None)
    if bound is None:
        raise ValueError(
            "an exchange over NCCL needs a device: pass the device of the tensors it is about (each rank its own "
            "GPU), or bind the process group to one (init_process_group(..., device_id=...))"
        )
    return bound


def all_gather_objects(
    engine: CommEngine, obj: Any, name: str = "objects", device: Optional[torch.device] = None
) -> list:
    """Every rank's picklable ``obj``, in rank order (what ``dist.all_gather_object`` does, through ``engine``).

    The C++ engine releases its buffers only once gloo's worker has let go of them, so, unlike
    torch's version, a process may exit right after this returns.

    Args:
        engine: the communication engine of the ranks that exchange.
        obj: this rank's object.
        name: names the operation in errors.
        device: where the bytes travel: the device of the caller's tensors (on NCCL each rank's
            own GPU); None: ``collective_device(engine)`` (the CPU, or NCCL's bound device).
    """
    if engine.world_size == 1:
        return [obj]
    device = collective_device(engine) if device is None else torch.device(device)
    payload = pickle.dumps(obj)
    data = struct.pack("<q", len(payload)) + payload
    longest = torch.tensor([float(len(data))], dtype=torch.float64, device=device)
    engine.all_reduce(longest, op="max", name=f"{name}.size").wait()
    width = int(longest.item())
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = torch.empty(width * engine.world_size, dtype=torch.uint8, device=device)
    engine.all_gather(everyone, mine.to(device), name=name).wait()
    raw = bytearray(everyone.numel())  # read back without numpy, which the CPU torch wheel does not bring
    torch.frombuffer(raw, dtype=torch.uint8).copy_(everyone)
    out = []
    for rank in range(engine.world_size):
        row = raw[rank * width : (rank + 1) * width]
        (size,) = struct.unpack("<q", row[:8])
        out.append(pickle.loads(row[8 : 8 + size]))
    return out
