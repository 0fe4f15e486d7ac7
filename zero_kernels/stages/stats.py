"""The step's one exchange between ranks: gradient flags, squared norm and the values ranks must agree on.

Each rank packs one float64 vector of host data::

    [ MARK | has_grad[i] for every parameter index i (sorted) | step count of i (-1: state held elsewhere) |
      gradient column | checks | extra ]

and one all-gather over the control engine gives every rank every rank's vector (``world x
length``, a few kilobytes). Every rank then combines the rows itself, in rank order, so all get
the same result:

- a parameter has a gradient this step when some rank says so (OR of the flags);
- the gradient column sums the ranks' parts: the squared norm of their gradient pieces when it is
  needed (clipping), else only whether they are finite (0 or NaN, from a plain sum: several times
  cheaper than a norm on CPUs); it is not finite when some gradient is inf/NaN on some rank;
- ``checks`` (``lr``, betas, eps, weight decay per group, clipping, gradient scale) must be equal
  on every rank: a difference raises ``agreement.RanksDisagree`` naming the value, every rank's
  value and the ranks, on every rank, before anything is updated;
- a parameter's Adam step count is what the ranks holding its state say (``opt.state[p]["step"]``
  set there reaches every rank); ranks holding it that disagree (its state reset or set on some of
  them only) raise ``RanksDisagree`` naming the parameter, on every rank, before anything is updated.
- a row that does not start with ``MARK`` came from a rank in another collective (a rank that ran another number
  of passes: stage 3's parameter all-gathers pair with this one); a ``CommError`` says so, where the values read
  from it would have raised a disagreement on ``lr``;
- ``extra`` columns are a pipeline's own (stage 3: the digest of the gathers it did not check at
  once), returned per rank for the pipeline to compare.

An all-gather rather than an all-reduce: it carries the flags' OR, the norm's sum and the
agreement check in one collective, and each rank sees who holds which value. This is the only place
where the packed vector is built and read.

Where the gradients live. On the CPU (gloo) the gradient column is host memory and rides in the
packed vector. On a GPU the host must not read it (that would wait for the device): the packed
vector, host data only, goes over the control engine (a gloo group of the same ranks, see
``control``), and the gradient column is all-reduced on the device by the
gradients' engine and stays there (``outcome.decide`` turns it into the step's decision).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from ..comm.agreement import RanksDisagree, disagreement, ranks_text
from ..comm.primitives import CommError

MARK = 5_784_113.0  # the first value of every rank's row in the exchange: a row without it came from another collective


@dataclass(frozen=True)
class StepStats:
    with_grad: set[int]  # parameter indices with a gradient on some rank
    grad_sq: Optional[torch.Tensor]  # float64 0-d on the gradients' device, summed over ranks (None: not computed)
    extra: list[list[float]]  # every rank's ``extra`` columns, in rank order
    counts: dict[int, int] = field(default_factory=dict)  # parameter index -> step count of the ranks holding it


def step_checks(
    hyper: Sequence[Any], grad_scale: float, max_grad_norm: Optional[float], clip_max_norm: Optional[float] = None
) -> list[tuple[str, float]]:
    """(name, value) of every value of this step that must be the same on every rank (None becomes NaN).

    Args:
        hyper: per param group ``GroupHyper``.
        grad_scale: the gradient multiplier (1 / loss scale with fp16 loss scaling, else 1 / accumulation steps,
            times the factors ``scale_grads_`` was given).
        max_grad_norm: the clipping norm (None: off).
        clip_max_norm: the smallest ``max_norm`` given to ``clip_grad_norm_`` since the last step (None: none).
    """
    checks = []
    for g, h in enumerate(hyper):
        group = f"param_groups[{g}]"
        checks += [
            (f"{group}['lr']", h.lr),
            (f"{group}['betas'][0]", h.beta1),
            (f"{group}['betas'][1]", h.beta2),
            (f"{group}['eps']", h.eps),
            (f"{group}['weight_decay']", h.weight_decay),
            (f"{group}['amsgrad']", float(h.amsgrad)),
            (f"{group}['maximize']", float(h.maximize)),
        ]
    checks.append(("the gradient scale 1 / (loss scale or gradient_accumulation_steps) x scale_grads_", grad_scale))
    checks.append(("max_grad_norm (gradient_clipping)", math.nan if max_grad_norm is None else max_grad_norm))
    checks.append(("clip_grad_norm_'s max_norm", math.nan if clip_max_norm is None else clip_max_norm))
    return [(name, float(value)) for name, value in checks]


def check_step_hyper(hyper: Sequence[Any]) -> None:
    """Refuse a step whose hyper-parameters are not all finite (a scheduler or the user set ``lr`` to NaN or
    inf, ``weight_decay`` to inf, ...) or whose betas left [0, 1) (``torch.optim.AdamW`` checks that at
    construction only; a beta2 of 1 zeroes the bias correction the update divides by): ``ValueError`` naming
    the group, the key and the value, raised on every rank after the ranks compared them (``exchange``) and
    before anything is updated.

    Args:
        hyper: per param group ``GroupHyper``.
    """
    for g, h in enumerate(hyper):
        values = (("['lr']", h.lr), ("['betas'][0]", h.beta1), ("['betas'][1]", h.beta2), ("['eps']", h.eps),
                  ("['weight_decay']", h.weight_decay))  # fmt: skip
        for key, value in values:
            if not math.isfinite(value):
                raise ValueError(
                    f"ShardedFusedAdam.step: param_groups[{g}]{key} is {value}: lr, betas, eps and weight_decay "
                    "must be finite at a step. Nothing was updated; set a finite value and call step() again"
                )
        for i, beta in enumerate((h.beta1, h.beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(
                    f"ShardedFusedAdam.step: param_groups[{g}]['betas'][{i}] is {beta}: betas must be in [0, 1). "
                    "Nothing was updated; set a beta in range and call step() again"
                )


def grad_column(views: Iterable[torch.Tensor], device: torch.device, *, norm: bool) -> torch.Tensor:
    """This rank's part of the gradient column, a float64 0-d tensor on ``device`` (never read here).

    Args:
        views: this rank's gradient pieces.
        device: the gradients' device.
        norm: the sum of their squared norms; else a sum that is 0 when every element is finite, NaN
            otherwise (several times cheaper than a norm on CPUs).
    """
    return combine((partial(v, norm=norm) for v in views), device)


def partial(v: torch.Tensor, *, norm: bool) -> torch.Tensor:
    """One gradient piece's term of the column (``grad_column``), a float64 0-d tensor on its device: its squared
    norm (``norm``), else 0 when it is finite, NaN otherwise."""
    if norm:
        return torch.linalg.vector_norm(v, dtype=torch.float32).double().square()
    return v.sum(dtype=torch.float32 if v.dtype == torch.float16 else None).double() * 0.0  # fp16: no overflow


def combine(partials: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The column from the pieces' terms (``partial``), summed in their order from a float64 zero on ``device``:
    terms computed when each piece was final give the column of ``grad_column`` bit for bit."""
    column = torch.zeros((), dtype=torch.float64, device=device)
    for term in partials:
        column += term
    return column


def exchange(
    engine: Any,
    control: Any,
    has_grad: Mapping[int, bool],
    column: Optional[torch.Tensor],
    checks: Sequence[tuple[str, float]],
    *,
    counts: Mapping[int, int],
    held: set[int],
    name: Callable[[int], str],
    extra: Sequence[float] = (),
) -> StepStats:
    """Combine this step's statistics over ranks; raise if the ``checks`` or the step counts differ.

    Args:
        engine: the communication engine of the gradients.
        control: the engine for host data (``control``): ``engine`` itself on gloo.
        has_grad: parameter index -> got a gradient on this rank.
        column: this rank's part of the gradient column (``grad_column``, or its terms ``combine``d), on the
            gradients' device: summed over ranks it gives the squared global norm, or whether every gradient is
            finite (None: neither is needed). Summed in place where it is not folded into the all-gather.
        checks: (name, value) pairs every rank must agree on (``step_checks``).
        counts: parameter index -> this rank's Adam step count.
        held: the parameter indices whose state this rank holds (all of it or a piece).
        name: how the error names a parameter index.
        extra: values returned per rank (``StepStats.extra``), not compared here.
    """
    order = sorted(has_grad)
    n = len(order)
    flags = [1.0 if has_grad[i] else 0.0 for i in order]
    steps = [float(counts[i]) if i in held else -1.0 for i in order]
    values = [MARK, *flags, *steps, 0.0, *(v for _, v in checks), *(float(v) for v in extra)]
    packed = torch.tensor(values, dtype=torch.float64)
    n2 = 2 * n  # where the gradient column sits (after the mark)
    fold = column is not None and control is engine and column.device.type == "cpu"
    if fold:  # host memory already: the gradient column rides the same all-gather
        packed[1 + n2] = column
    if control.world_size > 1:
        gathered = torch.empty(control.world_size * packed.numel(), dtype=torch.float64)
        try:
            control.all_gather(gathered, packed, name="step.stats").wait()
        except CommError as exc:
            if not _parted(exc):
                raise
            raise CommError(f"{exc}. At the step's exchange this is what happens when {_PARTED}") from exc
        table = _marked(gathered.view(control.world_size, -1), control.global_ranks)
    else:
        table = packed.view(1, -1)[:, 1:]
    rows = table.tolist()
    for column_index, (check, _) in enumerate(checks):
        message = disagreement(check, [_shown(row[n2 + 1 + column_index]) for row in rows], control.global_ranks)
        if message is not None:
            raise RanksDisagree(
                f"ShardedFusedAdam.step: {message}. Every rank must use the same hyper-parameters (set them the "
                "same way on every rank, e.g. with the same scheduler); nothing was updated, and this step's gradients "
                "are spent: zero_grad() and run backward again"
            )
    agreed = _agreed_counts(order, table[:, n:n2], name, control.global_ranks)
    with_grad = {i for k, i in enumerate(order) if any(row[k] > 0 for row in rows)}
    extras = [row[len(row) - len(extra) :] for row in rows]
    if column is None:
        return StepStats(with_grad, None, extras, agreed)
    if fold:
        return StepStats(with_grad, torch.tensor(sum(row[n2] for row in rows), dtype=torch.float64), extras, agreed)
    if engine.world_size > 1:  # on the device, in the engine's order: the host never reads it here
        engine.all_reduce(column, op="sum", name="step.grad_sq").wait()
    return StepStats(with_grad, column, extras, agreed)


# What an exchange that met another collective most likely means (``_marked``, ``_parted``).
_PARTED = (
    "the ranks no longer issue the same collectives in the same order (a rank ran another number of forwards, "
    "backwards or micro-steps than the others, or called step() alone). Every rank must run the same passes between "
    "steps (under no_sync() too); the process group cannot be used further, nothing was updated"
)


def _marked(table: torch.Tensor, global_ranks: Optional[Sequence[int]]) -> torch.Tensor:
    """``table`` without its column of ``MARK``s; ``CommError`` where a rank's row does not start with one (that rank
    was in another collective; ``global_ranks``: the control engine's, for the message)."""
    strangers = [rank for rank, mark in enumerate(table[:, 0].tolist()) if mark != MARK]
    if strangers:
        raise CommError(
            f"ShardedFusedAdam.step: the exchange of the step's statistics (step.stats) met another collective on "
            f"{ranks_text(strangers, global_ranks)}: {_PARTED}"
        )
    return table[:, 1:]


def _parted(exc: CommError) -> bool:
    """Whether the exchange failed as where the ranks parted ways (``_PARTED``): it timed out, or met another
    operation (a peer still in a backward's reduction, one backward ahead); not a rank that exited."""
    text = str(exc)
    return "different operations" in text or "timed out" in text.lower()


def _agreed_counts(
    order: list[int], steps: torch.Tensor, name: Callable[[int], str], global_ranks: Optional[Sequence[int]]
) -> dict[int, int]:
    """Each parameter's step count as the ranks holding its state have it (``steps``: world x parameters,
    -1 where a rank holds none of it); raise where those ranks differ."""
    held = steps >= 0
    highest = steps.amax(0)
    lowest = torch.where(held, steps, math.inf).amin(0)
    conflicts = (held.any(0) & (highest != lowest)).nonzero().flatten().tolist()
    if conflicts:
        k = conflicts[0]
        values = [int(v) if v >= 0 else None for v in steps[:, k].tolist()]
        message = disagreement(f"the Adam step count of {name(order[k])}", values, global_ranks)
        raise RanksDisagree(
            f"ShardedFusedAdam.step: {message} (None: a rank that holds none of its state). Its state was reset "
            "(opt.state[p] = {}, del opt.state[p], opt.state.clear()), set, or loaded (load_state_dict) on some "
            "ranks only (also where the load raised on the other ranks and the caller went on: a shard loaded on "
            "another rank than its own is refused): run those statements on every rank, each loading its own "
            "state_dict() or a consolidated one. Nothing was updated"
        )
    return {i: int(c) for i, c, h in zip(order, highest.tolist(), held.any(0).tolist()) if h}


def _shown(value: float) -> Optional[float]:
    """A check's value as the user set it (NaN stands for None)."""
    return None if math.isnan(value) else value
