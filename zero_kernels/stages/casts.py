"""Stage 3: the dtypes a freed parameter was cast through.

A freed parameter holds an empty tensor, so ``model.half()`` casts nothing but that tensor, and ``model.float()``
after it gives back the dtype the optimizer holds: no cast would be seen, and the shard would keep values that
fp16 cannot hold, where torch rounds every tensor it holds (as stages 0-2 and stage 3's gathered parameters do,
``adopt``). ``stage3.guard`` notes each such cast (``note_cast``) on the parameter itself; the adoption before the
unit's next gather or state read takes them (``take_casts``) and rounds this rank's parts of the shard through them
(``cast_through``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn


def note_cast(param: nn.Parameter, value: Any) -> None:
    """``param.data = value``, ``value`` empty and of another dtype (``model.half()`` on a freed parameter): the dtype
    is remembered, so that a cast back (``model.float()``) rounds the shard as the casts round a held tensor."""
    with torch._C.DisableTorchFunctionSubclass():
        if isinstance(value, torch.Tensor) and value.numel() == 0 and value.dtype != param.dtype:
            param.__dict__.setdefault("_zk_casts", []).append(value.dtype)


def take_casts(param: nn.Parameter) -> list[torch.dtype]:
    """The dtypes a freed ``param`` was cast to (in order) since this was last asked, the last its dtype now."""
    return param.__dict__.pop("_zk_casts", [])


def was_cast(param: nn.Parameter) -> bool:
    """Whether ``param`` was cast to another dtype while freed (``take_casts`` has not taken it yet)."""
    return "_zk_casts" in param.__dict__


def cast_through(values: torch.Tensor, dtypes: Sequence[torch.dtype]) -> torch.Tensor:
    """``values`` cast to each of ``dtypes`` in turn (the last is their own dtype): the rounding the same casts give a
    parameter that holds its values (``model.half(); model.float()`` keeps fp16's precision)."""
    for dtype in dtypes:
        values = values.to(dtype)
    return values
