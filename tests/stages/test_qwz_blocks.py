"""ZeRO++'s quantized weights (qwZ) at stages 1-2: a ``gathered_params()`` block leaves the run as it was.

Inside the block every rank holds every rank's exact parameters (gathered again unquantized, e.g. to save them);
between steps the other ranks' parts are the dequantized values the step's quantized all-gather sent. The block's
end sends them quantized again, so a run with an empty block, or a ``zk.save_pretrained`` (which uses one), equals
bit for bit the run without it (the exact values used to stay: 3.0e-4 apart in fp32 after 3 more steps), and an
edit made in the block on every rank reaches the other ranks' parts as the step would send it. Before the first
step the whole copies are exact, and a block there leaves them so, at stage 3 too (its persistent parameters).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import zero_kernels as zk
from tests.helpers.lockstep import BUCKET, LR, ROWS, batch, make_models

STEPS = 6
MICRO = 3


def _run(rank: int, stage: int, dtype: torch.dtype, block: str, out: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dtype)
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=stage, zero_quantized_weights=True, reduce_bucket_size=64)
    for step in range(STEPS):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank)).to(dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 2 and block == "empty":
            with opt.gathered_params():
                pass
        elif step == 2 and block == "save_pretrained":
            zk.save_pretrained(model, opt, out)
    return [p.detach().clone() for p in model.parameters()]


def _stepped(rank: int, stage: int, **extra: int) -> tuple[nn.Module, zk.ShardedFusedAdam]:
    """A small model and its qwZ optimizer after one step: the other ranks' parts are the dequantized values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=stage, zero_quantized_weights=True, reduce_bucket_size=64, **extra)
    model(torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
    opt.step()
    return model, opt


def _edit(rank: int, stage: int) -> None:
    """Halving every parameter in a block (a power of two: the int8 blocks scale exactly) halves what the forward
    sees after it, the other ranks' dequantized parts included."""
    model, opt = _stepped(rank, stage)
    before = [p.detach().clone() for p in model.parameters()]
    with opt.gathered_params(), torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), 0.5 * b), f"stage {stage}: the edit did not reach the other ranks' parts"


def _case(rank: int, world: int, out: str) -> None:
    for stage in (1, 2):
        for dtype in (torch.float32, torch.bfloat16):
            plain = _run(rank, stage, dtype, "", out)
            for block in ("empty", "save_pretrained"):
                got = _run(rank, stage, dtype, block, str(Path(out) / f"{stage}-{block}"))
                for i, (g, w) in enumerate(zip(got, plain)):
                    assert torch.equal(g, w), f"stage {stage} {dtype} {block}: param {i} {(g - w).abs().max():.3g}"
        _edit(rank, stage)


@pytest.mark.distributed
def test_a_block_leaves_the_run_unchanged(spawn, tmp_path: Path) -> None:
    spawn(_case, 2, str(tmp_path))


def _window_run(rank: int, world: int, stage: int, threshold: int, block: str, out: str) -> dict[str, torch.Tensor]:
    """Three windows of ``MICRO`` micro-steps; ``block`` (an empty block, or a ``zk.save_pretrained``: stage 3's
    gathers one unit at a time) runs before the first backward, after the first micro-step and inside the second
    window: the first two before any step."""
    model, _ = make_models(torch.float32)
    persistence = {"stage3_param_persistence_threshold": threshold} if stage == 3 else {}
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=stage, zero_quantized_weights=True, reduce_bucket_size=BUCKET,
                              gradient_accumulation_steps=MICRO, **persistence)  # fmt: skip
    for step in range(3):
        for m in range(MICRO):
            if block and (step, m) in ((0, 0), (0, 1), (1, 2)):
                if block == "empty":
                    with opt.gathered_params():
                        pass
                else:
                    zk.save_pretrained(model, opt, out)
            model(batch(10 * step + m, world * ROWS)[rank * ROWS : (rank + 1) * ROWS]).backward()
            opt.step()
            opt.zero_grad()
    with opt.gathered_params():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _before_the_first_step(rank: int, world: int, out: str) -> None:
    for stage, threshold in ((1, 0), (2, 0), (3, 1000), (3, 2)):
        plain = _window_run(rank, world, stage, threshold, "", out)
        for block in ("empty", "save_pretrained"):
            got = _window_run(rank, world, stage, threshold, block, str(Path(out) / f"{stage}-{threshold}-{block}"))
            for k, w in plain.items():
                what = f"stage {stage} (persistence threshold {threshold}) {block}: {k}"
                assert torch.equal(got[k], w), f"{what} {(got[k] - w).abs().max():.3g} off"


@pytest.mark.distributed
def test_a_block_before_the_first_step_leaves_the_run_unchanged(spawn, tmp_path: Path) -> None:
    """The block's end used to send the exact copies quantized before any step had (4.9e-4 off after 3 steps)."""
    spawn(_before_the_first_step, 2, str(tmp_path))


def _nested(rank: int, world: int) -> None:
    """A block inside a block (``zk.save_pretrained`` inside the user's): the parameters stay exact until the outer
    block ends, so what the outer block reads or saves after the inner one (DCP's ``get_state_dict``, which is taken
    inside a block) is exact, and the outer block's end leaves the run as it was."""
    for stage in (1, 2):
        model, opt = _stepped(rank, stage)
        outside = [p.detach().clone() for p in model.parameters()]
        with opt.gathered_params():
            exact = [p.detach().clone() for p in model.parameters()]
            with opt.gathered_params():
                pass
            for i, (p, e) in enumerate(zip(model.parameters(), exact)):
                assert torch.equal(p.detach(), e), f"stage {stage}: param {i} {(p - e).abs().max():.3g} off inside"
        for i, (p, o) in enumerate(zip(model.parameters(), outside)):
            assert torch.equal(p.detach(), o), f"stage {stage}: param {i} {(p - o).abs().max():.3g} off after the block"


@pytest.mark.distributed
def test_a_block_inside_a_block_keeps_the_parameters_exact(spawn) -> None:
    spawn(_nested, 2)


def _deleted(rank: int, world: int) -> None:
    """A deleted optimizer leaves the other ranks' parts dequantized: the model differs by rank, a new optimizer on
    it is refused naming that cause and what to do, and the weights taken inside its block build one again."""
    for stage in (1, 2):
        model, opt = _stepped(rank, stage)
        with opt.gathered_params():
            exact = {k: v.detach().clone() for k, v in model.state_dict().items()}
        del opt
        off = max((p.detach() - exact[k]).abs().max().item() for k, p in model.named_parameters())
        assert off > 0, f"stage {stage}: the model left by the deleted optimizer holds the exact weights"
        with pytest.raises(ValueError, match="different values.*zero_quantized_weights.*gathered_params"):
            zk.ShardedFusedAdam(model, lr=1e-2, stage=stage)
        model.load_state_dict(exact)
        zk.ShardedFusedAdam(model, lr=1e-2, stage=stage, zero_quantized_weights=True)


@pytest.mark.distributed
def test_a_deleted_optimizer_leaves_dequantized_parts_and_says_so(spawn) -> None:
    spawn(_deleted, 2)


def _copied(rank: int, world: int) -> None:
    """A copy of the model and its optimizer (``copy.deepcopy``) taken after a step holds the other ranks' parts as
    the step sent them, so a block on it ends as on the original (the copy's left them exact: 2.2e-3 apart after 3
    more steps, stages 1-3) and both runs go on equal."""
    for stage in (1, 2, 3):
        runs = []
        model, opt = _stepped(rank, stage, **({"stage3_param_persistence_threshold": 10**6} if stage == 3 else {}))
        opt.zero_grad()
        for model, opt in (model, opt), copy.deepcopy((model, opt)):
            for step in range(3):
                with opt.gathered_params():
                    pass
                x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            runs.append([p.detach().clone() for p in model.parameters()])
        for i, (g, w) in enumerate(zip(*runs)):
            assert torch.equal(g, w), f"stage {stage}: param {i} of the copy {(g - w).abs().max():.3g} off"


@pytest.mark.distributed
def test_a_copy_ends_a_block_as_the_original(spawn) -> None:
    spawn(_copied, 2)
