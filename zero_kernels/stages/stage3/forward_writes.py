"""Stage 3: a parameter written in place between its gather and its free is refused at the step.

``nn.Embedding(max_norm=...)`` renormalises the rows it looks up in its weight, in place, during the
forward; other code may write a parameter in place there too. At stage 3 that write goes into the
gathered buffer, which the free gives back: the rank's shard never sees it, so it is lost without a
word. No value could be kept instead: each rank writes the rows its own data chose.

Found by the parameter's version counter: torch bumps it at every in-place operation on the parameter
(under ``no_grad`` too), ``p.data = ...`` keeps it (the gather's own assignment is not a write), and
writes into the gathered buffer bump only the buffer's. A unit records its parameters' versions when
gathered and compares them when freed: one int compare per parameter. A write through ``p.data``
(``p.data.mul_(...)``) is not seen: ``.data`` is a tensor with a counter of its own. Writes inside
``gathered_params()`` are meant, and go back to the shards: its units record their versions again
before the block frees them.

A parameter under ``stage3_param_persistence_threshold`` is never freed: it stays whole on every rank, and the step
takes each rank's part of an edit from that rank's copy. A write in place during a forward is found by the same
counters, around each module's forward and around the whole forward (the root's: a write by a module that does
not use the parameter, by the root's own code, by a pre-hook), and kept where every rank made the same (a ``clamp_``
of the weight, the same rows renormalised): the step's exchange says whether some rank found one, and the ranks
then compare an exact sum of the bits of every persistent parameter (``held_edits``, one small all-reduce); where
one that some rank found written differs between them every rank raises (``describe_persistent``). With qwZ the
ranks hold each other's parts dequantized (different bits by design): only a write found on some ranks and not on
others is refused there.

Whether a write happens may depend on a rank's data, and a free is no point where every rank can
stop together, so the rank records the first parameter found (``record``) and the step's exchange
carries it (``columns``): every rank raises the same ``RuntimeError`` there, naming the parameter and
the rank that found it, before anything is updated (``verify``), as ``stages.refusals`` does. Kept
until a step raises it (``zero_grad()`` does not clear it: the write is lost whatever the gradients).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..refusals import found_on

NONE = -1


def describe_persistent(name: str) -> str:
    """The error for persistent parameter ``name`` written in place during a forward, differently by rank."""
    return (
        f"ZeRO stage 3: {name}, kept whole on every rank (under stage3_param_persistence_threshold), was written in "
        "place during a forward, and the ranks now hold different values of it, as nn.Embedding(max_norm=...) "
        "renormalises the rows each rank's data looks up: each rank's step takes only its own part of it, so the "
        "model would hold none of the ranks' values. Make the change out of place (for max_norm: look the rows up "
        "without it and scale them, e = F.embedding(x, w); e = e * (max_norm / e.norm(dim=-1, keepdim=True))"
        ".clamp(max=1)), the same on every rank, or inside `with optimizer.gathered_params():` between steps; "
        "nothing was updated"
    )


def describe(name: str) -> str:
    """The error for parameter ``name`` written in place during a forward."""
    return (
        f"ZeRO stage 3: {name} was written in place while its module had it gathered, as nn.Embedding(max_norm=...) "
        "renormalises the rows it looks up in its weight during the forward: stage 3 frees gathered parameters "
        "after use and keeps only each rank's shard, which the write never reaches (and each rank's data writes "
        "other rows), so the write would be lost. Make the change out of place (for max_norm: look the rows up "
        "without it and scale them, e = F.embedding(x, w); e = e * (max_norm / e.norm(dim=-1, keepdim=True))"
        ".clamp(max=1)), or write parameters inside `with optimizer.gathered_params():` between steps, the same "
        "way on every rank; nothing was updated"
    )


class ForwardWrites:
    """The parameters this rank found written in place between a gather and a free (or during a forward)."""

    def __init__(self) -> None:
        self.index = NONE  # the first
        self.found: set[int] = set()  # every one

    def record(self, index: int) -> None:
        """Remember parameter ``index`` (optimizer numbering)."""
        if self.index == NONE:
            self.index = index
        self.found.add(index)

    def columns(self) -> list[float]:
        """This rank's column of the step's exchange."""
        return [float(self.index)]

    def verify(
        self, rows: Sequence[Sequence[float]], name: Callable[[int], str], global_ranks: Optional[Sequence[int]] = None
    ) -> None:
        """Raise on every rank when some rank's ``columns()`` (``rows``, in rank order) name a parameter; the
        record is cleared either way.

        Args:
            rows: every rank's column, as the step's exchange gathered them.
            name: names a parameter by its optimizer index.
            global_ranks: the exchange's engine's (``ranks_text``), for the message.
        """
        for rank, index in enumerate(self.take(rows)):
            if index != NONE:
                where = found_on(rank, len(rows), global_ranks)
                raise RuntimeError(describe(name(index)) + where)

    def take(self, rows: Sequence[Sequence[float]]) -> list[int]:
        """Every rank's parameter (``NONE``: none) from its ``columns()`` (``rows``, in rank order); this rank's record
        is cleared."""
        self.index = NONE
        self.found = set()
        return [int(index) for (index,) in rows]
