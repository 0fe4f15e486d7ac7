"""Gradients that arrive where the step cannot take them as they are, on 2 gloo ranks, against ``torch.optim.AdamW``.

- A second gradient of a parameter in one backward pass (reentrant activation checkpointing) after
  its bucket was reduced (stages 0 and 2), found on one rank only because its data used the shared
  block more often: every rank raises the same ``RuntimeError`` at ``step()``, naming that rank and
  the parameter, before anything is updated; the ranks then train on in step (no collective left
  unpaired) and match AdamW. Stage 1 reduces at the step: the repeats add up, as in AdamW.
- A backward under ``no_sync()`` after the step's synchronised backward: its gradients count
  (reduced at the step), at every stage, as with DDP and DeepSpeed; a checkpoint saved then resumes
  owing that reduction.
- ``p.grad`` set by hand after the synchronised backward: stages 0-1 step with it as AdamW does;
  stages 2-3, which hold only a shard of the reduced gradients, refuse it on every rank at the step
  (set on one rank only, too), nothing updated.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zero_kernels as zk
from tests.helpers.dist import run_ranks_checked

WORLD, ROWS, LR = 2, 4, 1e-2
NARROW = 16  # elements per bucket: buckets are reduced while backward runs


class Shared(nn.Module):
    """``inp``, then one block run in ``segments`` reentrant checkpoint segments (chosen per call), then ``out``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, segments: int = 1) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for _ in range(segments):
            h = checkpoint(lambda t: torch.tanh(self.block(t)), h, use_reentrant=True)
        return self.out(h).square().mean()


def _batch(step: int) -> torch.Tensor:
    return torch.randn(ROWS * WORLD, 6, generator=torch.Generator().manual_seed(step))


def _rows(x: torch.Tensor, rank: int) -> torch.Tensor:
    return x[rank * ROWS : (rank + 1) * ROWS]


def _ref_backward(ref: Shared, x: torch.Tensor, segments: list[int]) -> None:
    """What every rank's backward together gives: the mean over ranks of their losses."""
    (sum(ref(_rows(x, r), s) for r, s in enumerate(segments)) / WORLD).backward()


def _differences(model: nn.Module, opt: zk.ShardedFusedAdam, ref: nn.Module, what: str) -> list[str]:
    found = []
    with opt.gathered_params():
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            if not torch.allclose(p, r, rtol=1e-5, atol=1e-6 * r.abs().max().item()):
                found.append(f"{what}: {name} differs from AdamW by {(p - r).abs().max().item():.3g}")
    return found


def _opt(model: nn.Module, stage: int) -> zk.ShardedFusedAdam:
    return zk.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=NARROW,
                               stage3_param_persistence_threshold=0)  # fmt: skip


def _second_gradient_on_one_rank(rank: int, world: int, stage: int) -> list[str]:
    """Rank 0 runs the shared block in 3 segments, rank 1 in one: only rank 0 gets repeated gradients."""
    what = f"stage {stage}"
    torch.manual_seed(0)
    model = Shared()
    ref = copy.deepcopy(model)
    opt, ropt = _opt(model, stage), torch.optim.AdamW(ref.parameters(), lr=LR)
    segments = [3, 1]
    x = _batch(0)
    model(_rows(x, rank), segments[rank]).backward()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
    except RuntimeError as exc:
        message = str(exc)
        if stage == 1:
            return [f"{what}: raised {message}"]
        expected = ("second gradient in one backward pass", "use_reentrant=False", "'block.", "found on rank 0 of 2")
        missing = [m for m in expected if m not in message]
        if missing:
            return [f"{what}: the error lacks {missing}: {message}"]
        if any(not torch.equal(a, b) for a, b in zip(before, model.parameters())):
            return [f"{what}: a parameter changed although the step raised"]
        opt.zero_grad()
    else:
        if stage != 1:
            return [f"{what}: rank {rank} stepped where every rank must raise"]
        _ref_backward(ref, x, segments)
        ropt.step()
        opt.zero_grad()
    ropt.zero_grad()
    x = _batch(1)  # the ranks go on in step: one segment each
    model(_rows(x, rank), 1).backward()
    opt.step()
    _ref_backward(ref, x, [1, 1])
    ropt.step()
    return _differences(model, opt, ref, f"{what}, the step after")


def _second_gradient_body(rank: int, world: int) -> list[str]:
    return [f for stage in (0, 1, 2) for f in _second_gradient_on_one_rank(rank, world, stage)]


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 7), nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).square().mean()


def _no_sync_after_sync(rank: int, world: int, stage: int) -> list[str]:
    """Per step: a synchronised backward, then one under ``no_sync()``, then the step (micro-batches 0 and 1)."""
    torch.manual_seed(0)
    model = Plain()
    ref = copy.deepcopy(model)
    opt, ropt = _opt(model, stage), torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(3):
        first, second = _batch(10 * step), _batch(10 * step + 1)
        model(_rows(first, rank)).backward()
        with opt.no_sync():
            model(_rows(second, rank)).backward()
        opt.step()
        opt.zero_grad()
        for x in (first, second):
            (sum(ref(_rows(x, r)) for r in range(WORLD)) / WORLD).backward()
        ropt.step()
        ropt.zero_grad()
    found = _differences(model, opt, ref, f"stage {stage}: no_sync after a synchronised backward")
    state = opt.full_state_dict()["state"]
    for i, p in enumerate(ref.parameters()):
        m = ropt.state[p]["exp_avg"]
        if not torch.allclose(state[i]["exp_avg"], m, rtol=1e-5, atol=1e-6 * m.abs().max().item()):
            found.append(f"stage {stage}: exp_avg of parameter {i} differs from AdamW")
    return found


def _hand_set_grad(rank: int, world: int, stage: int, ranks: tuple[int, ...]) -> list[str]:
    """After the synchronised backward, ``p.grad`` of ``b.weight`` replaced on ``ranks``, the same value there."""
    what = f"stage {stage}, p.grad set on ranks {ranks}"
    torch.manual_seed(0)
    model = Plain()
    ref = copy.deepcopy(model)
    opt, ropt = _opt(model, stage), torch.optim.AdamW(ref.parameters(), lr=LR)
    x = _batch(0)
    model(_rows(x, rank)).backward()
    given = torch.linspace(-1.0, 1.0, 21).reshape(3, 7)
    with opt.gathered_params():  # stage 3: a freed parameter takes no gradient of its full shape
        if rank in ranks:
            model.b.weight.grad = given.clone()
    try:
        opt.step()
    except RuntimeError as exc:
        message = str(exc)
        if stage < 2 or not re.search(r"'b\.weight'.*no reduction took", message) or "rank" not in message:
            return [f"{what}: {message}"]
        opt.zero_grad()
        with opt.gathered_params():
            if any(not torch.equal(p, r) for p, r in zip(model.parameters(), ref.parameters())):
                return [f"{what}: a parameter changed although the step raised"]
        return []
    if stage >= 2:
        return [f"{what}: rank {rank} stepped where every rank must raise"]
    (sum(ref(_rows(x, r)) for r in range(WORLD)) / WORLD).backward()
    ref.b.weight.grad = given.clone()
    ropt.step()
    return _differences(model, opt, ref, what)


def _late_gradients_body(rank: int, world: int) -> list[str]:
    found = [f for stage in (0, 1, 2, 3) for f in _no_sync_after_sync(rank, world, stage)]
    for stage in (0, 1, 2, 3):
        found += _hand_set_grad(rank, world, stage, (0, 1))
    for stage in (2, 3):
        found += _hand_set_grad(rank, world, stage, (1,))
    return found


def _gradient_after_clip(rank: int, world: int, stage: int) -> list[str]:
    """A backward after ``clip_grad_norm_`` of the step: AdamW would see the earlier gradients clipped and the
    later ones not; every rank raises at the step (the later backward on rank 1 only)."""
    torch.manual_seed(0)
    model = Plain()
    opt = _opt(model, stage)
    x = _batch(0)
    model(_rows(x, rank)).backward()
    if stage == 0:  # torch's clip works on p.grad itself there (the mean over ranks): later gradients add as in AdamW
        opt.clip_grad_norm_(1e-3)
    else:  # routed to opt.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with opt.no_sync():  # entered on every rank, as the collectives must be the same
        if rank == 1 or stage == 3:  # stage 3 gathers for a backward: every rank runs it
            model(_rows(x, rank)).backward()
    with opt.gathered_params():
        before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
    except RuntimeError as exc:
        first = 0 if stage == 3 else 1
        if "after clip_grad_norm_" not in str(exc) or f"found on rank {first} of 2" not in str(exc):
            return [f"stage {stage}: {exc}"]
        with opt.gathered_params():
            if any(not torch.equal(a, b) for a, b in zip(before, model.parameters())):
                return [f"stage {stage}: a parameter changed although the step raised"]
        return []
    return [f"stage {stage}: rank {rank} stepped with a gradient that came after the clip"]


def _after_clip_body(rank: int, world: int) -> list[str]:
    return [f for stage in (0, 1, 2, 3) for f in _gradient_after_clip(rank, world, stage)]


def _owed_window_resumed(rank: int, world: int, stage: int, directory: str) -> list[str]:
    """A checkpoint saved after a synchronised backward and one under ``no_sync()``, resumed: the step still
    reduces what the second left (the window carries that it is owed)."""
    torch.manual_seed(0)
    model = Plain()
    ref = copy.deepcopy(model)
    opt, ropt = _opt(model, stage), torch.optim.AdamW(ref.parameters(), lr=LR)
    first, second = _batch(0), _batch(1)
    model(_rows(first, rank)).backward()
    with opt.no_sync():
        model(_rows(second, rank)).backward()
    saved = f"{directory}/stage{stage}"
    zk.checkpoint.save(saved, model, opt)
    torch.manual_seed(1)
    resumed = Plain()
    opt2 = _opt(resumed, stage)
    zk.checkpoint.load(saved, resumed, opt2)
    opt2.step()
    for x in (first, second):
        (sum(ref(_rows(x, r)) for r in range(WORLD)) / WORLD).backward()
    ropt.step()
    return _differences(resumed, opt2, ref, f"stage {stage}: resumed window owing a reduction")


def _owed_window_body(rank: int, world: int, directory: str) -> list[str]:
    return [f for stage in (0, 2, 3) for f in _owed_window_resumed(rank, world, stage, directory)]


def _every_case(rank: int, world: int, directory: str) -> list[str]:
    """The four cases of the module docstring in turn on one pair of ranks, each finding named by its case."""
    cases = (
        ("a second gradient found on one rank", _second_gradient_body, ()),
        ("gradients after the synchronised backward", _late_gradients_body, ()),
        ("a gradient after the clip", _after_clip_body, ()),
        ("a window owing a reduction resumed", _owed_window_body, (directory,)),
    )
    return [f"{name}: {f}" for name, body, args in cases for f in body(rank, world, *args)]


@pytest.mark.distributed
def test_late_or_repeated_gradients_raise_or_count_on_every_rank_and_resume(tmp_path) -> None:
    run_ranks_checked(_every_case, WORLD, str(tmp_path), timeout_s=180)


def _step_inside_no_sync_body(rank: int, world: int) -> list[str]:
    """``opt.step()`` inside ``opt.no_sync()`` at every stage: refused on every rank before anything changes (it
    reduced the local gradients anyway, where DDP steps each rank on its own: 0.1 apart after 3 steps); the step
    after the block then trains as usual."""
    problems = []
    for stage in range(4):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
        opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=stage)
        x = torch.randn(3, 5, generator=torch.Generator().manual_seed(rank))
        with opt.no_sync():
            model(x).square().mean().backward()
            try:
                opt.step()
                problems.append(f"stage {stage}: a step inside no_sync() was taken")
            except RuntimeError as err:
                if "step() inside no_sync()" not in str(err):
                    problems.append(f"stage {stage}: unclear refusal: {err}")
        if opt.applied_steps or opt.micro_step:
            problems.append(f"stage {stage}: the refused step changed the optimizer")
        opt.step()
        if opt.applied_steps != 1:
            problems.append(f"stage {stage}: the step after the block did not update")
    return problems


@pytest.mark.distributed
def test_a_step_inside_no_sync_is_refused() -> None:
    run_ranks_checked(_step_inside_no_sync_body, 2)
