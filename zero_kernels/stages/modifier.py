"""``gathered_params(modifier_rank=k)``: one rank edits inside the block, every rank keeps its values.

DeepSpeed's ``GatheredParameters(params, modifier_rank=k)`` spelling (as Hugging Face code writes it at ZeRO-3:
``resize_token_embeddings``, ``_init_weights``): rank ``k`` alone edits the full parameters inside the block and
its values are broadcast at the block's end, before stage 3 takes its shards back. Each tensor goes as bytes
(``uint8``) through the engine's ``all_reduce``: rank ``k`` sends them, every other rank zeros first, so the sum is
rank ``k``'s bytes, bit for bit (signed zeros and NaN payloads too). Whatever follows sees the same values on
every rank, as if every rank had made the same edit: the copies, shards and masters then follow as they follow
such edits today (``stages.master``). The model's parameters the optimizer does not hold (frozen ones: whole on
every rank at stages 0-2, gathered by the block at stage 3) are broadcast as well, when the optimizer was given
the model.

Before anything is sent the ranks agree, in one small exchange of objects, on what they send (``check_sendable``):
a ``p.data = ...`` of another shape, dtype or device than the optimizer holds, on any rank, or a parameter outside
the optimizer's buffers whose shape or dtype differs from rank ``k``'s, would send mismatched collectives (a hang).
Then every rank puts every replaced ``.data`` back (``adopt.put_back``, ``Others.put_back``): each parameter holds
its values from before the replacement. What still fits is sent (``send_what_fits``): the optimizer's buffers, whose
shapes never change, and the others when their shapes agree again, so that rank ``k``'s in-place edits reach every
rank (stage 3 writes them back at the outermost block's end, as an accepted block's), and the ranks never keep
different weights; then every rank raises ``ModifierMismatch`` naming the parameter. Nothing else the block changed
is undone (the config that ``resize_token_embeddings`` sets), which the error says. A shape change names its cause
and remedy (``adopt.remedy``: resize before building the optimizer). When the block raised its own error, that
error propagates and the mismatch is logged at ERROR (``ending``): ``except`` around the block catches it as usual.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from ..comm.agreement import ranks_text
from ..comm.engine_base import EngineBase
from ..comm.objects import all_gather_objects
from ..wording import plural

log = logging.getLogger("zero_kernels")


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


@contextlib.contextmanager
def ending(end: Callable[[], None]) -> Iterator[None]:
    """Run ``end`` (the block's exchange) after the block, also when the block raised; then the block's own error
    propagates, as ``except`` around the block expects, and a ``ModifierMismatch`` of ``end`` is logged at ERROR."""
    try:
        yield
    except BaseException:
        try:
            end()
        except ModifierMismatch as mismatch:
            log.error("%s (while the block's own error propagated, which is raised)", mismatch)
        raise
    end()


def send_what_fits(
    engine: EngineBase,
    modifier_rank: int,
    flats: Iterable[Optional[torch.Tensor]],
    others: Others,
    device: Optional[torch.device],
) -> None:
    """After a ``ModifierMismatch``, every replaced ``.data`` put back: rank ``modifier_rank``'s values of the
    optimizer's ``flats`` (whose shapes never change) and, when every rank's now have its shapes and dtypes, of the
    ``others``, to every rank: its in-place edits reach every rank, as an accepted block's would."""
    rows = all_gather_objects(engine, others.described(), name="modifier.refit", device=device)
    fits = all(row == rows[modifier_rank] for row in rows)
    broadcast(engine, list(flats) + (others.tensors() if fits else []), modifier_rank)


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
    sent = (
        f"every replaced .data was put back, then rank {modifier_rank}'s values of what fits (its in-place edits "
        "included) went to every rank"
    )
    after = f"; {sent}. Change a parameter's shape or dtype before building the optimizer"
    for rank, (found, _) in enumerate(rows):
        if found:
            name, now, holds, remedy = found[0]
            raise ModifierMismatch(
                f"{where}: {name} is {now} on {ranks_text([rank], engine.global_ranks)}, the optimizer holds {holds}: "
                f"{remedy}. The replaced "
                f"values were not sent: {sent}. Other changes made in the block stay (resize_token_embeddings' "
                "config.vocab_size: resize back to the size the optimizer holds, inside gathered_params())"
            )
    reference = rows[modifier_rank][1]
    for i, (name, _, _) in enumerate(reference):
        seen: dict[tuple, list[int]] = {}
        for rank, (_, described) in enumerate(rows):
            seen.setdefault(tuple(described[i][1:]) if i < len(described) else ("absent",), []).append(rank)
        if len(seen) > 1:
            shown = ", ".join(
                f"{' '.join(map(str, reversed(k)))} on {ranks_text(r, engine.global_ranks)}" for k, r in seen.items()
            )
            raise ModifierMismatch(f"{where}: {name} differs between the ranks ({shown}){after}")
