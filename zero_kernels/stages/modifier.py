"""``gathered_params(modifier_rank=k)``: one rank edits inside the block, every rank keeps its values.

DeepSpeed's ``GatheredParameters(params, modifier_rank=k)`` spelling (as Hugging Face code writes it at ZeRO-3:
``resize_token_embeddings``, ``_init_weights``): rank ``k`` alone edits the full parameters inside the block and
its values are broadcast at the block's end, before stage 3 takes its shards back. Each tensor goes as bytes
(``uint8``) through the engine's ``all_reduce``: rank ``k`` sends them, every other rank zeros first, so the sum is
rank ``k``'s bytes, bit for bit (signed zeros and NaN payloads too). Whatever follows sees the same values on
every rank, as if every rank had made the same edit: the copies, shards and masters then follow as they follow
such edits today (``stages.master``). The model's parameters the optimizer does not hold (frozen ones, whole on
every rank) are broadcast as well, when the optimizer was given the model.

Before anything is sent the ranks agree, in one small exchange of objects, on what they send (``check_sendable``):
a ``p.data = ...`` of another shape, dtype or device than the optimizer holds, on any rank, or a parameter outside
the optimizer's buffers whose shape or dtype differs from rank ``k``'s, would send mismatched collectives (a hang).
Then every rank raises ``ModifierMismatch`` naming the parameter, sends nothing and puts every replaced ``.data``
back (``adopt.put_back``, ``Others.put_back``): each parameter holds its values from before the replacement. Values
written in place inside the block are not undone (no copy of the model is kept), except in stage 3's units gathered
for the block, whose shards are then not written back; nor is anything else the block changed (the config that
``resize_token_embeddings`` sets), which the error says. A shape change names its cause and remedy
(``adopt.remedy``: resize before building the optimizer).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from ..comm.agreement import ranks_text
from ..comm.engine_base import EngineBase
from ..comm.objects import all_gather_objects
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


def loose(module: Optional[nn.Module], held: Iterable[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """``module``'s named parameters not in ``held`` (none without a module)."""
    if module is None:
        return []
    ids = {id(p) for p in held}
    return [(f"parameter {name!r}", p) for name, p in module.named_parameters() if id(p) not in ids]


class ModifierMismatch(ValueError):
    """The ranks would send different tensors at the end of ``gathered_params(modifier_rank=k)``."""


class Others:
    """The model's tensors a modifier block sends besides the optimizer's flat buffers (the model's parameters
    it does not hold, stage 3's frozen units), each with the ``.data`` it had when the block began."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._bound = [(name, p, p.data) for name, p in named]

    def tensors(self) -> list[torch.Tensor]:
        return [p.data for _, p, _ in self._bound]

    def described(self) -> list[tuple[str, tuple[int, ...], str]]:
        return [(name, tuple(p.shape), str(p.dtype)) for name, p, _ in self._bound]

    def put_back(self) -> None:
        for _, p, data in self._bound:
            p.data = data


def check_sendable(
    engine: EngineBase,
    modifier_rank: int,
    misfits: list[tuple[str, str, str, str]],
    others: Others,
    device: Optional[torch.device],
) -> None:
    """``ModifierMismatch`` on every rank unless no rank has a ``misfit`` (``adopt.misfits``: a replaced ``.data``
    the optimizer's buffers cannot take) and every rank's ``others`` have rank ``modifier_rank``'s shapes and
    dtypes. One exchange of objects (on ``device``, the parameters'), whose outcome every rank reads alike."""
    rows = all_gather_objects(engine, (misfits[:1], others.described()), name="modifier.check", device=device)
    where = f"gathered_params(modifier_rank={modifier_rank})"
    after = (
        "; nothing was sent and every replaced .data was put back. Change a parameter's shape or dtype before "
        "building the optimizer"
    )
    for rank, (found, _) in enumerate(rows):
        if found:
            name, now, holds, remedy = found[0]
            raise ModifierMismatch(
                f"{where}: {name} is {now} on rank {rank}, the optimizer holds {holds}: {remedy}. Nothing was sent "
                "and every replaced .data was put back: each parameter holds its values from before the block. "
                "Other changes made in the block stay (resize_token_embeddings' config.vocab_size: resize back to "
                "the size the optimizer holds, inside gathered_params())"
            )
    reference = rows[modifier_rank][1]
    for i, (name, _, _) in enumerate(reference):
        seen: dict[tuple, list[int]] = {}
        for rank, (_, described) in enumerate(rows):
            seen.setdefault(tuple(described[i][1:]) if i < len(described) else ("absent",), []).append(rank)
        if len(seen) > 1:
            shown = ", ".join(f"{' '.join(map(str, reversed(k)))} on {ranks_text(r)}" for k, r in seen.items())
            raise ModifierMismatch(f"{where}: {name} differs between the ranks ({shown}){after}")
