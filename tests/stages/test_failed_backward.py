"""A backward that raises (a simulated out-of-memory error in a custom autograd Function, after the upper layers'
buckets were reduced), caught, on one gloo rank and on two, at every stage, against ``torch.optim.AdamW``:

- ``zero_grad()`` and the next batch: the failed batch is lost and training goes on, bit for bit as the run that
  skipped the batch, and as AdamW on the batches that trained ("catch OOM, skip batch" loops).
- ``step()`` without ``zero_grad()``: the step uses what the failed backward delivered, as AdamW uses ``p.grad``.
- ``zero_grad()``, then a batch that uses only the last layer, with ``max_grad_norm``: the clipping norm counts no
  gradient of the failed batch (stage 2 had copied some into a bucket it had not reduced).
- The batch retried without ``zero_grad()``: torch adds the failed pass's gradients to the retry's; stage 1, which
  reduces at the step, does the same; stages 0, 2 and 3 reduced some of them already and raise an error that names
  ``zero_grad()``, after which ``zero_grad()`` and the next batch train as the run that skipped both.
- A backward interrupted at its very end (Ctrl-C: ``KeyboardInterrupt`` while the round resets its counts), caught,
  ``zero_grad()``: the next batches train as the run that skipped the batch (the round was marked closed with its
  counts half reset: stages 2 and 3 then reduced the next backward's buckets before their gradients arrived, 2.8e-2
  off AdamW with no error; stage 0 refused the next backward, naming the ``zero_grad()`` just called).
- A backward interrupted right after a collective was issued, its handle lost on the way back: ``zero_grad()``
  waits for every collective the engine issued, so none writes into the gradients it clears.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import pytest
import torch
from torch import nn

import zero_kernels as zk
from tests.helpers.dist import run_ranks_checked

ROWS, LR = 4, 1e-2
NARROW = 64  # elements per bucket: some are reduced before the failure, one holds 0.bias and part of 2.weight
STAGES = (0, 1, 2, 3)
AFTER = 10  # batch + AFTER: a second batch in one step
CLIP = 1e-6  # far below the gradients' norm: the clip acts


class FailOnce(torch.autograd.Function):
    """Identity whose backward raises while ``armed``: the layers after it have their gradients by then."""

    armed = False

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        if FailOnce.armed:
            raise RuntimeError("CUDA out of memory (simulated)")
        return grad


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _loss(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    h = FailOnce.apply(model[1](model[0](x)))
    return model[4](model[3](model[2](h))).square().mean()


def _head_loss(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The last layer's loss alone, its gradients small beside the others' (the clip's norm shows a stray one)."""
    return model[4](x).square().mean() * 1e-3


def _rows(step: int, world: int, rank: int, width: int = 8) -> torch.Tensor:
    x = torch.randn(ROWS * world, width, generator=torch.Generator().manual_seed(step))
    return x[rank * ROWS : (rank + 1) * ROWS]


def _opt(model: nn.Module, stage: int, clip: Optional[float] = None) -> zk.ShardedFusedAdam:
    return zk.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=NARROW, max_grad_norm=clip,
                               stage3_param_persistence_threshold=0)  # fmt: skip


def _failed_backward(loss: torch.Tensor) -> Optional[str]:
    """Run a backward that raises; what went wrong instead, if anything."""
    FailOnce.armed = True
    try:
        loss.backward()
    except RuntimeError as exc:
        return None if "simulated" in str(exc) else f"backward raised {exc}"
    finally:
        FailOnce.armed = False
    return "the backward did not raise"


def _fails(stage: int, loss: torch.Tensor) -> list[str]:
    """``_failed_backward`` of a stage's loss: what went wrong, as a list of problems."""
    problem = _failed_backward(loss)
    return [] if problem is None else [f"stage {stage}: {problem}"]


def _params(model: nn.Module, opt: zk.ShardedFusedAdam) -> list[torch.Tensor]:
    with opt.gathered_params():
        return [p.detach().clone() for p in model.parameters()]


def _adamw(world: int, plan: list[tuple[int, str]]) -> list[torch.Tensor]:
    """AdamW on the mean of the ranks' losses; ``plan``: (batch, what), what one of "train", "fail" (a backward that
    raises, then zero_grad), "fail-step" (one that raises, then the step), "good-fail-step" (a backward of the batch,
    one of batch + AFTER that raises, then the step), "fail-retry" (one that raises, the batch again, the step)."""
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)

    def full(batch: int) -> None:
        (sum(_loss(ref, _rows(batch, world, r)) for r in range(world)) / world).backward()

    for step, what in plan:
        if what in ("train", "good-fail-step"):
            full(step)
        if what != "train":
            failing = step + AFTER if what == "good-fail-step" else step
            for rank in range(world):  # each rank's backward raises at the same point
                _failed_backward(_loss(ref, _rows(failing, world, rank)) / world)
        if what == "fail-retry":
            full(step)
        if what != "fail":
            opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ref.parameters()]


def _clean(stage: int, rank: int, world: int, steps: list[int]) -> list[torch.Tensor]:
    model = _model()
    opt = _opt(model, stage)
    for step in steps:
        _loss(model, _rows(step, world, rank)).backward()
        opt.step()
        opt.zero_grad()
    return _params(model, opt)


def _compare(
    what: str, got: list[torch.Tensor], clean: Optional[list[torch.Tensor]], ref: list[torch.Tensor]
) -> list[str]:
    found = []
    for i, (g, r) in enumerate(zip(got, ref)):
        if clean is not None and not torch.equal(g, clean[i]):
            found.append(f"{what}: parameter {i} differs from the run that skipped the batch")
        if not torch.allclose(g, r, rtol=1e-5, atol=1e-6 * r.abs().max().item()):
            found.append(f"{what}: parameter {i} differs from AdamW by {(g - r).abs().max().item():.3g}")
    return found


def _run(stage: int, rank: int, world: int, plan: list[tuple[int, str]]) -> tuple[list[torch.Tensor], list[str]]:
    """This rank's side of ``_adamw``'s ``plan`` (its batch rows only): the weights after it, and what went wrong."""
    model = _model()
    opt = _opt(model, stage)
    found = []
    for step, what in plan:
        if what in ("train", "good-fail-step"):
            _loss(model, _rows(step, world, rank)).backward()
        if what != "train":
            failing = step + AFTER if what == "good-fail-step" else step
            found += _fails(stage, _loss(model, _rows(failing, world, rank)))
        if what != "fail":
            opt.step()
        opt.zero_grad()
    return _params(model, opt), found


def _skip_batch(stage: int, rank: int, world: int) -> list[str]:
    """Batch 1's backward raises; zero_grad(); batches 2 and 3 train."""
    plan = [(0, "train"), (1, "fail"), (2, "train"), (3, "train")]
    got, found = _run(stage, rank, world, plan)
    clean = _clean(stage, rank, world, [0, 2, 3])
    return found + _compare(f"stage {stage}, batch skipped", got, clean, _adamw(world, plan))


def _step_on_failed(stage: int, rank: int, world: int) -> list[str]:
    """Batch 1's backward raises, step() on what it delivered; batch 2 trains, and a backward of batch 2 + AFTER raises
    after it, step() on both; batch 3 trains."""
    plan = [(0, "train"), (1, "fail-step"), (2, "good-fail-step"), (3, "train")]
    got, found = _run(stage, rank, world, plan)
    return found + _compare(f"stage {stage}, step after the failed backward", got, None, _adamw(world, plan))


def _head_after_failure(stage: int, rank: int, world: int) -> list[str]:
    """Batch 0 trains; batch 1's backward raises; zero_grad(); batch 2 reaches only the last layer; the norm is clipped
    to CLIP (after a first step, so that the clip changes Adam's update)."""
    model = _model()
    opt = _opt(model, stage, clip=CLIP)
    _loss(model, _rows(0, world, rank)).backward()
    opt.step()
    opt.zero_grad()
    found = _fails(stage, _loss(model, _rows(1, world, rank)))
    opt.zero_grad()
    _head_loss(model, _rows(2, world, rank, width=16)).backward()
    opt.step()
    ref = _model()
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for step, loss, width in ((0, _loss, 8), (2, _head_loss, 16)):
        (sum(loss(ref, _rows(step, world, r, width)) for r in range(world)) / world).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ropt.step()
        ropt.zero_grad()
    ref_params = [p.detach().clone() for p in ref.parameters()]
    return found + _compare(f"stage {stage}, head only after the failure", _params(model, opt), None, ref_params)


def _retry(stage: int, rank: int, world: int) -> list[str]:
    """Batch 1's backward raises and is run again without zero_grad(); then batch 2."""
    model = _model()
    opt = _opt(model, stage)
    found, refused = [], ""
    for step in range(3):
        loss = _loss(model, _rows(step, world, rank))
        if step == 1:
            found += _fails(stage, loss)
            loss = _loss(model, _rows(step, world, rank))
        try:
            loss.backward()
            opt.step()
        except RuntimeError as exc:
            refused = str(exc)
        opt.zero_grad()
    if stage == 1:
        ref = _adamw(world, [(0, "train"), (1, "fail-retry"), (2, "train")])
        return (
            found
            + [f"stage 1, retry: raised {refused}"] * bool(refused)
            + _compare("stage 1, retry", _params(model, opt), None, ref)
        )
    if "second gradient" not in refused or "opt.zero_grad()" not in refused:
        found.append(f"stage {stage}, retry: expected an error naming opt.zero_grad(), got {refused!r}")
    ref = _adamw(world, [(0, "train"), (1, "fail"), (2, "train")])
    return found + _compare(
        f"stage {stage}, after the refused retry", _params(model, opt), _clean(stage, rank, world, [0, 2]), ref
    )


def _accumulated(stage: int, rank: int, world: int, steps: list[int], fail: Optional[int] = None) -> list[torch.Tensor]:
    """gradient_accumulation_steps=2 over ``steps``; batch ``fail``: its backward raises, then zero_grad()."""
    model = _model()
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=NARROW, gradient_accumulation_steps=2)
    for step in steps:
        loss = _loss(model, _rows(step, world, rank))
        if step == fail:
            assert _failed_backward(loss) is None, f"stage {stage}: the backward of batch {fail} did not raise"
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
    return _params(model, opt)


def _window_dropped(rank: int, world: int) -> list[str]:
    """The second micro-batch's backward raises (batch 3, after batch 2's micro-step), zero_grad(): the window of
    batches 2 and 3 is dropped, one warning says so, and training goes on as the run that never saw them."""
    found = []
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("zero_kernels").addHandler(handler)
    try:
        for stage in STAGES:
            records.clear()
            got = _accumulated(stage, rank, world, [0, 1, 2, 3, 4, 5], fail=3)
            dropped = [r for r in records if "window's gradients are dropped" in r.getMessage()]
            if len(dropped) != 1 or dropped[0].levelno != logging.WARNING:
                found.append(f"stage {stage}: expected one warning that the window is dropped, got {len(dropped)}")
            clean = _accumulated(stage, rank, world, [0, 1, 4, 5])
            found += [
                f"stage {stage}: parameter {i} differs from the run without batches 2 and 3"
                for i, (g, c) in enumerate(zip(got, clean))
                if not torch.equal(g, c)
            ]
    finally:
        logging.getLogger("zero_kernels").removeHandler(handler)
    return found


def _interrupting(reset: Callable[..., None]) -> Callable[..., None]:
    """``reset`` (the pipeline's ``_reset_pending``) that raises ``KeyboardInterrupt`` instead, once: Ctrl-C landing in
    the end-of-backward callback, while the round resets its counts."""
    fired = []

    def interrupted(*args: object) -> None:
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt("Ctrl-C (simulated)")
        reset(*args)

    return interrupted


def _interrupted_run(rank: int, world: int, attr: str, wrap: Callable, what: str) -> list[str]:
    """Batch 1's backward is interrupted where the pipeline's ``attr``, wrapped by ``wrap``, raises; the loop catches
    it, zero_grad(), batches 2 and 3 train: as the run that skipped batch 1, and AdamW on batches 0, 2, 3."""
    found = []
    plan = [(0, "train"), (1, "fail"), (2, "train"), (3, "train")]
    ref = _adamw(world, plan)
    for stage in STAGES:
        model = _model()
        opt = _opt(model, stage)
        pipeline = opt._pipeline
        for step in range(4):
            loss = _loss(model, _rows(step, world, rank))
            if step == 1:
                setattr(pipeline, attr, wrap(getattr(pipeline, attr)))
            try:
                loss.backward()
                opt.step()
            except KeyboardInterrupt:
                if step != 1:
                    found.append(f"stage {stage}: batch {step} interrupted")
            except RuntimeError as exc:
                found.append(f"stage {stage}: batch {step} raised {exc}")
            finally:
                pipeline.__dict__.pop(attr, None)
            opt.zero_grad()
        clean = _clean(stage, rank, world, [0, 2, 3])
        found += _compare(f"stage {stage}, {what}", _params(model, opt), clean, ref)
    return found


def _interrupted_round_end(rank: int, world: int) -> list[str]:
    """Batch 1's backward is interrupted at its very end, while the round resets its counts."""
    return _interrupted_run(rank, world, "_reset_pending", _interrupting, "interrupted at the round's end")


def _losing_handle(track: Callable[..., object]) -> Callable[..., object]:
    """``track`` (the pipeline's ``_track``) that raises ``KeyboardInterrupt`` instead, once, given a collective's
    handle: Ctrl-C landing after the collective was issued, before its handle was recorded."""
    fired = []

    def interrupted(handle: object, *args: object, **kwargs: object) -> object:
        if handle is not None and not fired:
            fired.append(True)
            raise KeyboardInterrupt("Ctrl-C (simulated)")
        return track(handle, *args, **kwargs)

    return interrupted


def _interrupted_after_issue(rank: int, world: int) -> list[str]:
    """Batch 1's backward is interrupted right after its first collective was issued, its handle lost (stage 0's
    all-reduce, never waited for, wrote batch 1's gradients into the buffer zero_grad() had cleared: 2.3e-2 off
    AdamW, no error)."""
    return _interrupted_run(rank, world, "_track", _losing_handle, "a handle lost")


def _every_case(rank: int, world: int) -> list[str]:
    return [
        f
        for stage in STAGES
        for case in (_skip_batch, _step_on_failed, _head_after_failure, _retry)
        for f in case(stage, rank, world)
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
def test_a_backward_that_raises_loses_its_batch_and_training_goes_on(world: int) -> None:
    run_ranks_checked(_every_case, world, timeout_s=180)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
def test_zero_grad_after_a_failed_backward_mid_window_drops_the_window(world: int) -> None:
    run_ranks_checked(_window_dropped, world, timeout_s=180)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
def test_a_backward_interrupted_at_its_end_loses_its_batch_and_training_goes_on(world: int) -> None:
    run_ranks_checked(_interrupted_round_end, world, timeout_s=180)


@pytest.mark.distributed
def test_a_collective_whose_handle_an_interrupt_lost_is_waited_for_by_zero_grad() -> None:
    run_ranks_checked(_interrupted_after_issue, 2, timeout_s=180)
