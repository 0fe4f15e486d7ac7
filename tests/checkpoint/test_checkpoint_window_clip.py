"""torch's ``clip_grad_norm_`` after resuming a checkpoint saved inside a window whose backward reduced (stage 0, 2
ranks): ``p.grad`` holds the mean over ranks, as with DDP, so torch's own clip runs on it and clips it in place;
``p.grad``, the norm and the step equal DDP + ``torch.optim.AdamW`` element by element."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import zero_kernels.checkpoint as ck
import zero_kernels.optim as zo
from tests.helpers.lockstep import LR, ROWS, batch, make_models

MAX_NORM = 0.05


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * scale, msg=lambda m: f"{what}: {m}")


def _case(rank: int, world: int, root: str) -> None:
    model, ref = make_models(torch.float32)
    fresh = copy.deepcopy(model)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=0)
    ddp = DDP(ref, find_unused_parameters=True)  # `extra` is not called
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    x = batch(0, world * ROWS)[rank * ROWS : (rank + 1) * ROWS]
    model(x).backward()
    ddp(x).backward()
    ck.save(root, model, opt)  # inside the window: its backward reduced
    model, opt = fresh, zo.ShardedFusedAdam(fresh, lr=LR, stage=0)
    ck.load(root, model, opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    _close(norm, ref_norm, "norm")
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        if r.grad is not None:
            _close(p.grad, r.grad, f"{name}.grad after the clip")
    opt.step()
    ropt.step()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        _close(p.detach(), r.detach(), f"{name} after the step")


@pytest.mark.distributed
def test_torch_clip_after_resuming_a_reduced_window_clips_p_grad_as_ddp(spawn, tmp_path) -> None:
    spawn(_case, 2, str(tmp_path))
