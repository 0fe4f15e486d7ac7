"""Activation checkpointing (``torch.utils.checkpoint``) at every stage, against ``torch.optim.AdamW``.

Reentrant checkpointing runs each segment's backward as a backward of its own, so a parameter used
in several segments gets its gradient several times in one backward pass. Before its gradients
are reduced the repeats add up; after (its bucket reduced at stages 0 and 2, its unit at stage 3)
they cannot, and the step would silently miss them: that raises instead, saying what to use.
"""

from __future__ import annotations

import copy
import functools
from typing import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zero_kernels as zk
from tests.helpers.dist import run_ranks_checked

ROWS, STEPS = 4, 3
WIDE = 1 << 30  # one bucket: nothing is reduced before the end of backward
NARROW = 16  # a bucket per few parameters: reduced while backward runs


class Net(nn.Module):
    """Three checkpointed blocks (``shared``: one block used in all three segments), then ``out``,
    checkpointed too (``last``: the first gradients then come from a segment's backward)."""

    def __init__(self, shared: bool, reentrant: bool, last: bool):
        super().__init__()
        self.reentrant, self.last = reentrant, last
        self.inp, self.out = nn.Linear(6, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(1 if shared else 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for i in range(3):
            block = self.blocks[i % len(self.blocks)]
            h = checkpoint(lambda t, b=block: torch.tanh(b(t)), h, use_reentrant=self.reentrant)
        return checkpoint(self.out, h, use_reentrant=self.reentrant) if self.last else self.out(h)


def _train(rank: int, world: int, stage: int, net: tuple[bool, bool, bool], bucket: int) -> float:
    """Largest difference from AdamW after ``STEPS`` steps."""
    torch.manual_seed(0)
    return _against_adamw(rank, world, Net(*net), stage=stage, reduce_bucket_size=bucket, max_grad_norm=None,
                          stage3_param_persistence_threshold=0)  # fmt: skip


def _against_adamw(rank: int, world: int, model: nn.Module, **options) -> float:
    """Largest difference from AdamW after ``STEPS`` steps of ``model`` under ``ShardedFusedAdam(**options)``."""
    ref = copy.deepcopy(model)
    opt = zk.ShardedFusedAdam(model, lr=1e-2, **options)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        x = torch.randn(ROWS * world, 6, generator=torch.Generator().manual_seed(step))
        model(x[rank * ROWS : (rank + 1) * ROWS]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        ropt.step()
        ropt.zero_grad()
    with opt.gathered_params():
        return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


STAGES, BUCKETS, BOTH = (0, 1, 2, 3), (WIDE, NARROW), (True, False)
CASES = [  # (stage, (shared, reentrant, last), bucket, raises)
    *[(s, (False, r, last), b, False) for s in STAGES for r in BOTH for last in BOTH for b in BUCKETS],
    *[(s, (True, False, last), b, False) for s in STAGES for last in BOTH for b in BUCKETS],
    # each segment's backward ends a round of its own: the repeats are reduced one round after another
    *[(s, (True, True, True), b, False) for s in STAGES for b in BUCKETS],
    # one round: repeats add up until the parameter's gradients are reduced, then raise
    *[(s, (True, True, False), WIDE, False) for s in (0, 1, 2)],
    (1, (True, True, False), NARROW, False),
    *[(s, (True, True, False), NARROW, True) for s in (0, 2)],
    # stage 3: the shared block's input is its segment's input (a leaf), so the end of its backward is not
    # seen: its unit is reduced at the end of backward, after every segment's repeat has added up
    *[(3, (True, True, False), b, False) for b in BUCKETS],
]


def _body(rank: int, world: int) -> list[str]:
    failures = []
    for stage, net, bucket, raises in CASES:
        what = f"stage {stage} (shared, reentrant, last checkpointed)={net} bucket={bucket}"
        try:
            err = _train(rank, world, stage, net, bucket)
            if raises:
                failures.append(f"{what}: trained (error {err:.1e}) where it must raise")
            elif err > 1e-5:
                failures.append(f"{what}: differs from AdamW by {err:.2e}")
        except RuntimeError as exc:
            if (
                not raises
                or "second gradient in one backward pass" not in str(exc)
                or "use_reentrant=False" not in str(exc)
            ):
                failures.append(f"{what}: {exc}")
    return failures


@pytest.mark.distributed
def test_activation_checkpointing_matches_adamw_or_raises() -> None:
    run_ranks_checked(_body, 2, timeout_s=600)


class Blocks(nn.Module):
    """Checkpointed blocks with a norm each, and a norm and a head outside them, as a transformer has: at stage 3
    the norms (under ``stage3_param_persistence_threshold``) share one unit across every segment and the rest."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(6, 8, bias=False)  # no kept-whole parameter where the end of backward is not seen
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Tanh()) for _ in range(3)])
        self.norm, self.out = nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=self.reentrant)
        return self.out(self.norm(h))


def _train_blocks(rank: int, world: int, reentrant: bool, bucket: int) -> float:
    torch.manual_seed(0)
    model = Blocks(reentrant)
    return _against_adamw(rank, world, model, stage=3, reduce_bucket_size=bucket, stage3_param_persistence_threshold=20)


def _close_to_adamw(name: str, train: Callable[[], float], failures: list[str]) -> None:
    """Run ``train`` (it returns the largest difference from AdamW); note in ``failures`` what went wrong."""
    try:
        err = train()
        if err > 1e-5:
            failures.append(f"{name}: differs from AdamW by {err:.2e}")
    except RuntimeError as exc:
        failures.append(f"{name}: {exc}")


def _two_losses(rank: int, world: int) -> float:
    """Two losses of one forward, backpropagated one after the other (``retain_graph=True``) through non-reentrant
    segments: the second backward recomputes the segments without a forward before it."""
    torch.manual_seed(0)
    model = Net(shared=False, reentrant=False, last=True)
    ref = copy.deepcopy(model)
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=3, reduce_bucket_size=NARROW)  # one unit kept whole: all
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        x = torch.randn(ROWS * world, 6, generator=torch.Generator().manual_seed(step))
        for m, o, rows in ((model, opt, x[rank * ROWS : (rank + 1) * ROWS]), (ref, ropt, x)):
            out = m(rows)
            out.sum().mul(1.0 / len(rows)).backward(retain_graph=True)
            out.square().mean().backward()
            o.step()
            o.zero_grad()
    with opt.gathered_params():
        return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


def _blocks_body(rank: int, world: int) -> list[str]:
    failures: list[str] = []
    for reentrant in BOTH:
        for bucket in BUCKETS:
            train = functools.partial(_train_blocks, rank, world, reentrant, bucket)
            _close_to_adamw(f"reentrant={reentrant} bucket={bucket}", train, failures)
    _close_to_adamw("two losses, retain_graph", functools.partial(_two_losses, rank, world), failures)
    return failures


@pytest.mark.distributed
def test_stage3_norms_kept_whole_inside_and_outside_checkpointed_segments() -> None:
    """The unit of the kept-whole norms is used by every segment and by the final norm: it is reduced after the
    last segment's recomputed backward, not when the final norm's backward ends."""
    run_ranks_checked(_blocks_body, 2, timeout_s=600)


class Embedded(nn.Module):
    """An embedding (its input needs no gradient: reduced at the end of backward), a checkpointed block, a head; at
    stage 3 with ``stage3_param_persistence_threshold`` 250 the block's weights are units of their own and the
    embedding, the biases and the head one kept-whole unit (``head``: ``"tied"`` to the embedding, or read by the
    parent as ``F.linear(h, embed.weight)``)."""

    def __init__(self, reentrant: bool, head: str):
        super().__init__()
        self.reentrant, self.how = reentrant, head
        self.embed = nn.Embedding(13, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 13, bias=False)
        if head == "tied":
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed((x.abs() * 4).long().clamp(max=12))
        h = torch.tanh(checkpoint(self.block, h, use_reentrant=self.reentrant))
        return nn.functional.linear(h, self.embed.weight) if self.how == "functional" else self.head(h)


class Inside(nn.Module):
    """Every module inside two checkpointed segments: the first module a backward reaches is a recomputed one."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.first = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.LayerNorm(16))
        self.second = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.first, x.clone().requires_grad_(), use_reentrant=self.reentrant)
        return checkpoint(self.second, h, use_reentrant=self.reentrant)


def _mixed_units_body(rank: int, world: int) -> list[str]:
    failures: list[str] = []
    models = [(f"embedded head={head}", lambda r, h=head: Embedded(r, h)) for head in ("module", "tied", "functional")]
    for (what, make), reentrant, threshold in [
        (m, r, t) for m in [*models, ("inside", Inside)] for r in BOTH for t in (0, 250)
    ]:
        torch.manual_seed(0)
        model = make(reentrant)
        train = functools.partial(
            _against_adamw, rank, world, model, stage=3, stage3_param_persistence_threshold=threshold
        )
        _close_to_adamw(f"{what} reentrant={reentrant} threshold={threshold}", train, failures)
    return failures


@pytest.mark.distributed
@pytest.mark.parametrize("world", (1, 2))
def test_stage3_reentrant_segments_between_kept_whole_and_sharded_units(world: int) -> None:
    """A reentrant segment's inner backward ends before the outer one: the gradients the units hand on from the
    reductions it runs, and those of the kept-whole unit the outer backward reduces at its end, all reach the step
    (they were taken at the inner end, uncounted, so that the step updated none of them)."""
    run_ranks_checked(_mixed_units_body, world, timeout_s=600)


class MixedKinds(nn.Module):
    """One block in segments of both kinds in one forward, in the order ``kinds`` gives (``True``: reentrant)."""

    def __init__(self, kinds: tuple[bool, ...]):
        super().__init__()
        self.kinds = kinds
        self.inp, self.block, self.out = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for reentrant in self.kinds:
            h = h + checkpoint(self.block, h, use_reentrant=reentrant)
        return self.out(h)


def _mixed_kinds_body(rank: int, world: int) -> list[str]:
    failures: list[str] = []
    for kinds in ((True, False), (False, True), (True, False, True)):
        for threshold in (0, 100):
            torch.manual_seed(0)
            train = functools.partial(
                _against_adamw, rank, world, MixedKinds(kinds), stage=3, stage3_param_persistence_threshold=threshold
            )
            _close_to_adamw(f"reentrant per segment={kinds} threshold={threshold}", train, failures)
    return failures


@pytest.mark.distributed
@pytest.mark.parametrize("world", (1, 2))
def test_stage3_block_in_reentrant_and_non_reentrant_segments(world: int) -> None:
    """A block used in a reentrant segment and later in a non-reentrant one: the non-reentrant recomputation's call
    ends in the backward that recomputed it and no longer counts as the reentrant segment's, so the unit waits for
    the reentrant segment's backward (it was reduced before it, and that gradient raised 'second gradient')."""
    run_ranks_checked(_mixed_kinds_body, world, timeout_s=600)
