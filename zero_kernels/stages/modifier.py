"""``gathered_params(modifier_rank=k)``: one rank edits inside the block, every rank keeps its values.

DeepSpeed's ``GatheredParameters(params, modifier_rank=k)`` spelling (as Hugging Face code writes it at ZeRO-3:
``resize_token_embeddings``, ``_init_weights``): rank ``k`` alone edits the full parameters inside the block and
its values are broadcast at the block's end, before stage 3 takes its shards back. Each tensor goes as bytes
(``uint8``) through the engine's ``all_reduce``: rank ``k`` sends them, every other rank zeros first, so the sum is
rank ``k``'s bytes, bit for bit (signed zeros and NaN payloads too). Whatever follows sees the same values on
every rank, as if every rank had made the same edit: the copies, shards and masters then follow as they follow
such edits today (``stages.master``). The model's parameters the optimizer does not hold (frozen ones, whole on
every rank) are broadcast as well, when the optimizer was given the model.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from ..comm.engine_base import EngineBase
from ..wording import plural


def check_modifier_rank(modifier_rank: Optional[int], world_size: int) -> None:
    """A ``ValueError`` (``TypeError`` for a non-int) naming ``modifier_rank`` unless it is None or in [0, world)."""
    if modifier_rank is None:
        return
    if isinstance(modifier_rank, bool) or not isinstance(modifier_rank, int):
        raise TypeError(
            f"gathered_params: modifier_rank must be None or an int in [0, {world_size}) (a rank of the "
            f"optimizer's process group), got {modifier_rank!r}"
        )
    if not 0 <= modifier_rank < world_size:
        raise ValueError(
            f"gathered_params: modifier_rank={modifier_rank} is not a rank of the optimizer's process group "
            f"of {plural(world_size, 'rank')}; allowed: None or 0..{world_size - 1}"
        )


def broadcast(engine: EngineBase, tensors: Iterable[Optional[torch.Tensor]], modifier_rank: int) -> None:
    """Every rank's ``tensors`` (in place) take rank ``modifier_rank``'s values, bit for bit."""
    if engine.world_size == 1:
        return
    for i, tensor in enumerate(t for t in tensors if t is not None and t.numel() != 0):
        flat = tensor if tensor.is_contiguous() else tensor.contiguous()
        data = flat.view(-1).view(torch.uint8)
        if engine.rank != modifier_rank:
            data.zero_()
        engine.all_reduce(data, op="sum", name=f"modifier.{i}").wait()
        if flat is not tensor:
            tensor.copy_(flat)


def loose(module: Optional[nn.Module], held: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The ``.data`` of ``module``'s parameters not in ``held`` (none without a module)."""
    if module is None:
        return []
    ids = {id(p) for p in held}
    return [p.data for p in module.parameters() if id(p) not in ids]
