"""The step's decision on the gradients' device: the same training whether it is read at once or later.

On a GPU the step keeps the global norm, the clip coefficient and the skip flag on the device and
reads them only when they are needed (``stages.outcome``); host data goes over a gloo control group.
CPU tensors are read at once, so three runs on 2 gloo ranks cover the device path here:

- ``eager``: the CPU default (the outcome is settled at the end of each step);
- ``deferred``: ``StepResult.ready`` says no, as a GPU's queued copy would: step counts, skipped
  steps and the loss scale are settled when next read;
- ``control``: deferred, and the host data over another gloo group (what an NCCL engine gets), so
  the gradient column is all-reduced by the gradients' engine and never folded into the host vector.

All three train bit for bit the same, with clipping, ``clip_grad_norm_``, a skipped step and fp16
loss scaling. In ``control`` mode with the Triton kernels, the only tensor the package reads on the
host during a step or ``clip_grad_norm_`` is the gathered host vector (``stats.py``).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import zero_kernels as zk
from tests.helpers.dist import run_ranks_checked
from zero_kernels import control
from zero_kernels.stages import outcome

STEPS, BAD_STEP, CLIP_STEP = 5, 2, 3
HOST_BACKENDS = control.HOST_BACKENDS
PACKAGE = str(Path(zk.__file__).resolve().parent)
READS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def _batch(step: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 8, generator=g).to(dtype)


class _HostReads:
    """Records, while active, the package files that read a tensor's value on the host."""

    def __init__(self) -> None:
        self.where: set[str] = set()
        self._saved: dict[str, Callable] = {}

    def __enter__(self) -> "_HostReads":
        for name in READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def wrapper(t: torch.Tensor, *args: Any, _original: Callable = original, **kwargs: Any) -> Any:
                caller = sys._getframe(1).f_code.co_filename
                if caller.startswith(PACKAGE):
                    self.where.add(os.path.relpath(caller, PACKAGE))
                return _original(t, *args, **kwargs)

            setattr(torch.Tensor, name, wrapper)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)


def _train(rank: int, stage: int, mode: str, dtype: torch.dtype, impl: str) -> dict[str, Any]:
    model = _model(dtype)
    fp16 = (
        dict(enabled=True, loss_scale=0, initial_scale_power=6, loss_scale_window=2) if dtype == torch.float16 else None
    )
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=stage, reduce_bucket_size=64, max_grad_norm=0.05, fp16=fp16,
                              impl=impl)  # fmt: skip
    results, clipped, reads = [], [], set()
    for step in range(STEPS):
        hook = None
        if step == BAD_STEP and rank == 1:
            bad = math.nan if dtype == torch.float32 else math.inf
            hook = model[2].bias.register_hook(lambda g: g + torch.tensor([bad], dtype=g.dtype))
        loss = model(_batch(step, rank, dtype)).float().square().mean()
        if fp16 is None:
            loss.backward()  # not opt.backward: reading the loss scale would settle the last step here
        else:
            opt.backward(loss)
        if hook is not None:
            hook.remove()
        if impl == "triton":  # the audit is of this step: the last one's outcome is read first, by design
            opt.pipeline.settle()
        with _HostReads() as audit:
            if step == CLIP_STEP:
                clipped.append(opt.clip_grad_norm_(0.02))
            opt.step()
        reads |= audit.where
        if mode != "eager":
            assert opt.pipeline.step_counts.unsettled is not None, f"{mode}: the step's outcome was read at once"
        results.append(opt.last_step)
        opt.zero_grad()
    with opt.gathered_params():
        params = [p.detach().clone() for p in model.parameters()]
    return {
        "params": params,
        "state": [t.clone() for buf in opt.pipeline.buffers for t in (buf.exp_avg, buf.exp_avg_sq)],
        "steps": dict(opt.pipeline.steps),
        "skipped": opt.skipped_steps,
        "loss_scale": opt.loss_scale,
        "norms": [repr(r.grad_norm) for r in results],  # nan on the skipped fp32 step
        "skips": [r.skipped for r in results],
        "clipped": [float(c) for c in clipped],
        "reads": reads,
    }


def _compare(rank: int, want: dict[str, Any], got: dict[str, Any], what: str) -> None:
    for key in ("steps", "skipped", "loss_scale", "norms", "skips", "clipped"):
        assert got[key] == want[key], f"{what}: {key} {got[key]} != {want[key]}"
    for key in ("params", "state"):
        for a, b in zip(got[key], want[key]):
            assert torch.equal(a, b), f"{what}: {key} differ by {(a.float() - b.float()).abs().max().item()}"


def _body(rank: int, world: int) -> list[str]:
    failures = []
    for stage in (0, 1, 2, 3):
        for dtype in (torch.float32, torch.float16):
            what = f"stage {stage} {str(dtype)[6:]}"
            try:
                want = _train(rank, stage, "eager", dtype, "auto")
                assert want["skips"][BAD_STEP] and want["skipped"] == 1, f"{what}: the bad step was not skipped"
                assert want["steps"] and set(want["steps"].values()) == {STEPS - 1}, f"{what}: steps {want['steps']}"
                ready = outcome.StepResult.ready
                outcome.StepResult.ready = lambda self: False
                try:
                    _compare(rank, want, _train(rank, stage, "deferred", dtype, "auto"), f"{what} deferred")
                    control.HOST_BACKENDS = frozenset()  # gloo gets a control group, as NCCL does
                    try:
                        _compare(rank, want, _train(rank, stage, "control", dtype, "auto"), f"{what} control")
                        if dtype == torch.float32 and stage in (0, 2):
                            audited = _train(rank, stage, "control", dtype, "triton")
                            assert audited["reads"] == {"stages/stats.py"}, f"{what}: host reads in {audited['reads']}"
                    finally:
                        control.HOST_BACKENDS = HOST_BACKENDS
                finally:
                    outcome.StepResult.ready = ready
            except AssertionError as exc:
                failures.append(str(exc))
    return failures


@pytest.mark.distributed
def test_device_decisions_train_the_same_read_now_or_later() -> None:
    run_ranks_checked(_body, 2, timeout_s=600)
