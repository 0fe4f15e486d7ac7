"""Stage 3: before parameters are all-gathered, every rank checks that every rank gathers the same units.

An all-gather pairs whatever the ranks issue at the same point: if rank 0 gathers module ``left``
while rank 1 gathers ``right`` (data-dependent control flow, a mixture of experts), the same-sized
case silently mixes their parameters and the different-sized one kills a rank inside the backend.
So before issuing a batch of gathers (the units one module needs and those prefetched with them),
each rank all-reduces a fixed-size signature of the batch (count, first unit and its size, total
size and a hash of every (unit, size) in order) as [s, -s] with ``max``: equal maxima and minima
mean every rank issues the same batch, so the data gathers are issued only then. Otherwise every
rank exchanges what it was about to gather and raises ``CommError`` naming the modules and ranks.

Cost: one small all-reduce per batch, waited on before the batch's gathers are issued. The check
runs on the host: on a backend other than gloo (NCCL) it goes over a gloo group of the same ranks
(``control``), so that waiting for it never waits for the GPU's queued work. A
61-bit hash of the batch is compared, with the first unit and the count exactly, so a batch
differing beyond its first unit escapes only on a hash collision (probability 2^-61).

Deferred checks. That all-reduce holds every host to the slowest once per batch (hundreds per
iteration for a large model), so it is paid only where a difference between ranks is likely: the
first pass of each kind (forward, backward) after the plan was read, a pass that leaves the order of
the previous pass of its kind, and gathers outside a pass. A batch of a pass that repeats the
previous one (checked) is folded into a running digest instead (``DeferredChecks``), compared in the
step's existing exchange (``stats``): ranks whose gathers differed raise ``CommError`` there, naming
the first batch that differs, before anything is updated. A difference that shows only on some
ranks (one rank leaves the previous order, another does not) makes the leaving rank check at once
while the others gather: that ends in the backend's timeout, or in the C++ engine's "the ranks issued different
operations", rather than in this module's message; ``explain_failed_gather`` adds the likely cause and the fix to
those errors.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

import torch

from ...comm.agreement import ranks_text
from ...comm.engine_base import EngineBase
from ...comm.objects import all_gather_objects
from ...comm.primitives import CommError

_HASH_MOD = (1 << 61) - 1


class Named(Protocol):
    uid: int  # the same number on every rank for the same unit
    numel: int  # elements one gather brings in (padding included)
    param_numel: int  # elements of its parameters, for messages
    name: str  # qualified name of the module that holds the unit ('' for the root)
    kind: str  # that module's class name


MAX_LOGGED = 4096  # deferred batches remembered between two steps, to name the first that differs


def signature(units: Sequence[Named]) -> list[int]:
    """Integers equal on two ranks when they gather the same units in the same order."""
    digest = 0
    for u in units:
        digest = (digest * 1_000_003 + u.uid * 4_294_967_311 + u.numel) % _HASH_MOD
    return [len(units), units[0].uid, units[0].numel, sum(u.numel for u in units), digest]


# What a gather or check that timed out or paired with another operation most likely means at stage 3.
_DIVERGED = (
    ". At ZeRO stage 3 this is what happens when some ranks run other modules than the others in a pass that so far "
    "followed the previous one (the data choosing the modules: a mixture of experts routing tokens, a branch taken "
    "on some ranks only), so the ranks gather different parameters at the same point: every rank must run the same "
    "modules in the same order. Mark the module that makes the choice as a leaf module, gathered whole on every "
    "rank: zero_kernels.set_leaf_modules(model, [ThatModuleClass]). Or a frozen module (no trainable parameter) "
    "whose input needs a gradient on some ranks only (computed from trainable parameters there, not on the others): "
    "its backward, which gathers its parameters, runs on those ranks only; give that input a gradient on every "
    "rank (`x.requires_grad_()` where it has none)"
)


def explain_failed_gather(exc: CommError) -> CommError:
    """``exc`` from a stage-3 gather or its check, with the likely cause added where the ranks' collectives did not
    pair up (a timeout, or operations that differ): ranks that ran different modules after a pass that was checked
    (see the module docstring); other failures (a rank that exited) as they are."""
    text = str(exc)
    if "different operations" not in text and "timed out" not in text.lower():
        return exc
    return CommError(text + _DIVERGED)


def check_same_units(
    engine: EngineBase, units: Sequence[Named], phase: str, suggest: Callable[[list[str]], str]
) -> None:
    """Raise ``CommError`` on every rank unless every rank is about to gather ``units`` too.

    Args:
        engine: the comm engine for host-side checks (``control``); a collective: every rank
            must call this at the same point.
        units: the units this rank is about to gather, in issue order (not empty).
        phase: where the gathers happen, for the message ("forward", "backward", ...).
        suggest: the fix to suggest, given the names of the modules the ranks disagree on.
    """
    if engine.world_size == 1:
        return
    mine = signature(units)
    packed = torch.tensor(mine + [-v for v in mine], dtype=torch.int64)  # host data: on the CPU, as gloo takes it
    engine.all_reduce(packed, op="max", name="stage3.check").wait()
    values = packed.tolist()
    n = len(mine)
    if values[:n] == [-v for v in values[n:]]:
        return
    everyone = all_gather_objects(engine, [(u.name, u.kind, u.param_numel) for u in units], name="stage3.check.units")
    raise CommError(describe_mismatch(everyone, phase, suggest, engine.global_ranks))


def describe_mismatch(
    everyone: list[list[tuple[str, str, int]]],
    phase: str,
    suggest: Callable,
    global_ranks: Optional[Sequence[int]] = None,
) -> str:
    """The message for ranks that gather different units: what each rank gathers where they first differ (with
    its global rank: ``agreement.ranks_text``)."""
    return f"ZeRO stage 3: the ranks gather different parameters at the same point of the {phase}: " + _difference(
        everyone, suggest, global_ranks
    )


def _difference(
    everyone: list[list[tuple[str, str, int]]], suggest: Callable, global_ranks: Optional[Sequence[int]]
) -> str:
    """What each rank gathers where the batches ``everyone`` first differ, and the fix."""
    at = 0
    while all(at < len(batch) for batch in everyone) and len({batch[at] for batch in everyone}) == 1:
        at += 1
    names = [batch[at][0] for batch in everyone if at < len(batch)]

    def what(batch: list[tuple[str, str, int]]) -> str:
        if at >= len(batch):
            return "nothing more"
        name, kind, numel = batch[at]
        return f"'{name or '<root>'}' ({kind}, {numel} elements)"

    ranks = "; ".join(
        f"{ranks_text([r], global_ranks)} gathers the parameters of {what(batch)}" for r, batch in enumerate(everyone)
    )
    return (
        f"{ranks}. Every rank must run the same modules in the same order (the gathers pair up in order). "
        f"{suggest(names)}"
    )


class DeferredChecks:
    """The batches gathered without a check since the last step: a running digest, and the first
    ``MAX_LOGGED`` of them (phase, unit uids) to say which differ."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.digest = 0
        self.count = 0
        self.log: list[tuple[str, tuple[int, ...]]] = []

    def add(self, units: Sequence[Named], phase: str) -> None:
        """Fold the batch ``units`` (gathered in ``phase``) into the digest."""
        for value in signature(units):
            self.digest = (self.digest * 1_000_003 + value) % _HASH_MOD
        self.count += 1
        if len(self.log) < MAX_LOGGED:
            self.log.append((phase, tuple(u.uid for u in units)))

    def columns(self) -> list[float]:
        """The values compared in the step's exchange (exact in float64)."""
        return [float(self.count), float(self.digest >> 31), float(self.digest & ((1 << 31) - 1))]

    def verify(
        self, engine: EngineBase, rows: Sequence[Sequence[float]], units: Sequence[Named], suggest: Callable
    ) -> None:
        """Raise ``CommError`` on every rank unless every rank's ``columns()`` (``rows``, in rank order) are
        equal; forget the batches either way.

        Args:
            engine: the comm engine for host-side checks (a collective when the rows differ).
            rows: every rank's columns, as the step's exchange gathered them.
            units: the units by uid, to name them.
            suggest: the fix to suggest, given the names of the modules the ranks disagree on.
        """
        log = self.log
        self.clear()
        if all(list(row) == list(rows[0]) for row in rows):
            return
        everyone = all_gather_objects(engine, log, name="stage3.check.deferred")
        at = 0
        while all(at < len(batches) for batches in everyone) and len({batches[at] for batches in everyone}) == 1:
            at += 1
        if all(at >= len(batches) for batches in everyone):
            detail = f"They differ beyond the first {MAX_LOGGED} batches of gathers since the last step."
        else:
            phase = next(batches[at][0] for batches in everyone if at < len(batches))
            described = [
                [(units[i].name, units[i].kind, units[i].param_numel) for i in batches[at][1]]
                if at < len(batches)
                else []
                for batches in everyone
            ]
            detail = f"First difference, in the {phase}: {_difference(described, suggest, engine.global_ranks)}"
        raise CommError(
            "ZeRO stage 3: the ranks gathered different parameters since the last step, found in the step's exchange: "
            f"the step is refused (nothing was updated; its parameters and gradients may be mixed up). {detail}"
        )
