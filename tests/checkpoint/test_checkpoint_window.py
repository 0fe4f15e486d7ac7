"""A checkpoint saved inside a gradient accumulation window resumes the window exactly, at every stage on
1-3 gloo ranks: ``gradient_accumulation_steps=3``, ``no_sync`` micro-steps, and plain repeated
backward passes, saved after the first or the second of three micro-batches. The resumed run is
compared with the uninterrupted one element by element (parameters and Adam state, bit for bit).
Loaded at another stage, such a checkpoint raises on every rank, saying to save at a window
boundary; one saved at a boundary loads with an empty window, as after ``zero_grad()``. With ZeRO++'s quantized
weights (stages 1-3, 2 ranks) the resumed run is bit for bit the uninterrupted one too, inside a window and at its end,
before the first step as after it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

import zero_kernels.checkpoint as ck
import zero_kernels.optim as zo
from tests.helpers.dist import run_ranks_checked
from tests.helpers.lockstep import BUCKET, LR, ROWS, STAGES, WORLD_SIZES, batch, make_models

MICRO = 3
MODES = ("accumulation_steps", "no_sync", "backward")


def _opt(model: torch.nn.Module, stage: int, mode: str, **extra: bool) -> zo.ShardedFusedAdam:
    kwargs = {"gradient_accumulation_steps": MICRO} if mode == "accumulation_steps" else {}
    return zo.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=BUCKET,
                               stage3_param_persistence_threshold=2, **kwargs, **extra)  # fmt: skip


def _micro(model: torch.nn.Module, opt: zo.ShardedFusedAdam, rank: int, world: int, step: int, m: int, mode: str):
    """Micro-batch ``m`` of ``step`` on this rank (the step on the last one)."""
    x = batch(10 * step + m, world * ROWS)[rank * ROWS : (rank + 1) * ROWS]
    quiet = mode == "no_sync" and m < MICRO - 1
    with opt.no_sync() if quiet else contextlib.nullcontext():
        (model(x) / (1 if mode == "accumulation_steps" else MICRO)).backward()
    if mode == "accumulation_steps":
        opt.step()
        opt.zero_grad()  # ignored between micro-steps
    elif m == MICRO - 1:
        opt.step()
        opt.zero_grad()


def _state(model: torch.nn.Module, opt: zo.ShardedFusedAdam) -> dict[str, torch.Tensor]:
    out = {f"state {i} {k}": v for i, entry in opt.full_state_dict()["state"].items() for k, v in entry.items()}
    with opt.gathered_params():
        out.update({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _case(rank: int, world: int, stage: int, mode: str, save_after: int, root: str) -> None:
    """Two steps; the resumed run saves after micro-batch ``save_after`` of the second and loads at once."""
    model, _ = make_models(torch.float32)
    opt = _opt(model, stage, mode)
    for step in range(3):
        for m in range(MICRO):
            _micro(model, opt, rank, world, step, m, mode)
    expected = _state(model, opt)

    model, _ = make_models(torch.float32)
    opt = _opt(model, stage, mode)
    for step in range(3):
        for m in range(MICRO):
            _micro(model, opt, rank, world, step, m, mode)
            if step == 1 and m == save_after:
                ck.save(root, model, opt)
                model, _ = make_models(torch.float32)
                opt = _opt(model, stage, mode)
                ck.load(root, model, opt)
    got = _state(model, opt)
    what = f"stage {stage} {mode} saved after micro-batch {save_after}"
    assert got.keys() == expected.keys(), f"{what}: {sorted(got)}"
    for key, value in expected.items():
        assert torch.equal(got[key], value), f"{what}: {key} differs by {(got[key] - value).abs().max():.3g}"
    other = (stage + 1) % 4
    model, _ = make_models(torch.float32)
    ranks = "1 rank" if world == 1 else f"{world} ranks"
    refused = rf"inside a gradient accumulation window.*stage {stage} on {ranks};.*\(here: stage {other} on {ranks},"
    with pytest.raises(ck.CheckpointError, match=refused):
        ck.load(root, model, _opt(model, other, mode))


def _quantized_case(rank: int, world: int, stage: int, save_step: int, save_after: int, root: str) -> None:
    """qwZ: every rank's whole copy of the other ranks' parts (stages 1-2, stage 3's persistent parameters) is the
    dequantized int8 all-gather's once a step ran; a load writes exact values there, so it sends them again as the
    step does, and the resumed run (saved inside the window or at its end) goes on bit for bit. Saved before the
    first step, the copies stay exact, as the uninterrupted run's are (the load sent them quantized: the Adam state
    1.1e-4 off two steps later, stages 1-2)."""
    runs = []
    for saving in (False, True):
        model, _ = make_models(torch.float32)
        opt = _opt(model, stage, "no_sync", zero_quantized_weights=True)
        for step in range(3):
            for m in range(MICRO):
                _micro(model, opt, rank, world, step, m, "no_sync")
                if saving and step == save_step and m == save_after:
                    ck.save(root, model, opt)
                    model, _ = make_models(torch.float32)
                    opt = _opt(model, stage, "no_sync", zero_quantized_weights=True)
                    ck.load(root, model, opt)
        runs.append(_state(model, opt))
    expected, got = runs
    for key, value in expected.items():
        what = f"qwZ stage {stage} saved after micro-batch {save_after} of step {save_step}: {key}"
        assert torch.equal(got[key], value), f"{what} differs by {(got[key] - value).abs().max():.3g}"


def _gradless_case(rank: int, world: int, stage: int, root: str) -> None:
    """qwZ: a step before any backward (no gradient anywhere, every step count stays 0) sends the shards quantized all
    the same; a checkpoint saved after it keeps that, and the resumed run goes on bit for bit."""
    runs = []
    for saving in (False, True):
        model, _ = make_models(torch.float32)
        opt = _opt(model, stage, "no_sync", zero_quantized_weights=True)
        opt.step()
        if saving:
            ck.save(root, model, opt)
            model, _ = make_models(torch.float32)
            opt = _opt(model, stage, "no_sync", zero_quantized_weights=True)
            ck.load(root, model, opt)
        for m in range(MICRO):
            _micro(model, opt, rank, world, 0, m, "no_sync")
        runs.append(_state(model, opt))
    expected, got = runs
    for key, value in expected.items():
        what = f"qwZ stage {stage} saved after a step without gradients: {key}"
        assert torch.equal(got[key], value), f"{what} differs by {(got[key] - value).abs().max():.3g}"


def _quantized_body(rank: int, world: int, tmp: str) -> list[str]:
    problems = []
    for stage in (1, 2, 3):
        try:
            _gradless_case(rank, world, stage, f"{tmp}/gradless{stage}")
        except Exception as err:
            problems.append(f"{type(err).__name__}: {err}")
        for save_step, save_after in ((0, 0), (1, 0), (1, MICRO - 1)):
            try:
                _quantized_case(rank, world, stage, save_step, save_after, f"{tmp}/q{stage}-{save_step}-{save_after}")
            except Exception as err:  # every case runs; each rank reports what it found wrong
                problems.append(f"{type(err).__name__}: {err}")
    return problems


@pytest.mark.distributed
def test_a_quantized_weights_run_resumes_bit_for_bit(tmp_path: Path) -> None:
    run_ranks_checked(_quantized_body, 2, str(tmp_path), timeout_s=300)


def _boundary_case(rank: int, world: int, root: str) -> None:
    """Saved between steps, loaded at another stage: no gradient is left over from before the load."""
    model, _ = make_models(torch.float32)
    opt = _opt(model, 2, "no_sync")
    _micro(model, opt, rank, world, 0, MICRO - 1, "no_sync")
    ck.save(root, model, opt)
    model, _ = make_models(torch.float32)
    opt = _opt(model, 1, "no_sync")
    _micro(model, opt, rank, world, 0, 0, "no_sync")  # a gradient the load must drop
    ck.load(root, model, opt)
    assert all(p.grad is None for p in model.parameters()), "a gradient from before the load"


def _body(rank: int, world: int, tmp: str) -> list[str]:
    problems = []
    for stage in STAGES:
        for mode in MODES:
            for save_after in (0, 1):
                try:
                    _case(rank, world, stage, mode, save_after, f"{tmp}/{stage}-{mode}-{save_after}")
                except Exception as err:  # every case runs; each rank reports what it found wrong
                    problems.append(f"stage {stage} {mode} {save_after}: {type(err).__name__}: {err}")
    try:
        _boundary_case(rank, world, f"{tmp}/boundary")
    except Exception as err:
        problems.append(f"boundary: {type(err).__name__}: {err}")
    return problems


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"world{w}")
def test_checkpoint_inside_an_accumulation_window_resumes_it(world: int, tmp_path: Path) -> None:
    run_ranks_checked(_body, world, str(tmp_path), timeout_s=300)


def _gan_iteration(G: torch.nn.Module, D: torch.nn.Module, o_g, o_d, step: int) -> None:
    """torch's DCGAN loop: the generator's loss backpropagates through the discriminator, leaving gradients in the
    discriminator's optimizer after its step, which its next iteration clears."""
    g = torch.Generator().manual_seed(step)
    real, z = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    o_d.zero_grad()
    fake = G(z)
    (D(real).square().mean() + D(fake.detach()).mean()).backward()
    o_d.step()
    o_g.zero_grad()
    D(fake).mean().backward()
    o_g.step()


def test_a_gan_checkpoint_says_at_its_save_why_it_resumes_at_its_layout_only(tmp_path: Path, caplog) -> None:
    torch.manual_seed(0)
    G, D = torch.nn.Linear(3, 6), torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    o_g, o_d = zo.ShardedFusedAdam(G, lr=LR, stage=2), zo.ShardedFusedAdam(D, lr=LR, stage=2)
    _gan_iteration(G, D, o_g, o_d, 0)
    with caplog.at_level("WARNING", logger="zero_kernels"):
        ck.save(tmp_path / "D", D, o_d)
    assert "saved inside a gradient accumulation window" in caplog.text and "opt.zero_grad()" in caplog.text
    with pytest.raises(ck.CheckpointError, match=r"after opt.zero_grad\(\) where no step uses the gradients held \(a"):
        ck.load(tmp_path / "D", D, zo.ShardedFusedAdam(D, lr=LR, stage=1))
    o_d = zo.ShardedFusedAdam(D, lr=LR, stage=2)
    ck.load(tmp_path / "D", D, o_d)
    o_d.zero_grad()
    caplog.clear()
    with caplog.at_level("WARNING", logger="zero_kernels"):
        ck.save(tmp_path / "D", D, o_d)
    assert "accumulation window" not in caplog.text
    ck.load(tmp_path / "D", D, zo.ShardedFusedAdam(D, lr=LR, stage=1))


def _added_group(rank: int, world: int, stage: int, root: str) -> None:
    """qwZ: a param group added after a step holds exact whole copies until its own first step; a checkpoint saved
    then keeps which groups a step had sent quantized, and the resumed run goes on bit for bit (one record for all
    groups sent the new one quantized at the load: 2.2e-3 apart after 3 steps, stage 2)."""

    def build() -> tuple[torch.nn.Module, zo.ShardedFusedAdam]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        opt = zo.ShardedFusedAdam(model[0].parameters(), lr=1e-2, stage=stage, zero_quantized_weights=True)
        return model, opt

    def train(model: torch.nn.Module, opt: zo.ShardedFusedAdam, step: int) -> None:
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().mean().backward()
        opt.step()
        model.zero_grad()

    runs = []
    for saving in (False, True):
        model, opt = build()
        train(model, opt, 0)
        opt.add_param_group({"params": list(model[2].parameters())})
        if saving:
            ck.save(root, model, opt)
            model, opt = build()
            opt.add_param_group({"params": list(model[2].parameters())})
            ck.load(root, model, opt)
        for step in (1, 2, 3):
            train(model, opt, step)
        runs.append([p.detach().clone() for p in model.parameters()])
    for i, (got, want) in enumerate(zip(*runs)):
        assert torch.equal(got, want), f"stage {stage}: param {i} differs by {(got - want).abs().max():.3g}"


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 2])
def test_qwz_a_group_added_before_the_save_resumes_bit_for_bit(spawn, tmp_path: Path, stage: int) -> None:
    spawn(_added_group, 2, stage, str(tmp_path))


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_grad_keeping_zeros_after_a_resumed_window_keeps_the_last_steps_parameters(
    tmp_path: Path, stage: int
) -> None:
    """A window resumed from a checkpoint, then dropped by ``opt.zero_grad(set_to_none=False)`` (a spiking batch
    skipped): the parameters of the last step keep a zero gradient, as ``p.grad`` zeroed in ``torch.optim.AdamW``,
    so the next step moves ``extra`` (used in the step before the window, not since) by its momentum, bit for bit as
    the uninterrupted run does (stages 2-3 keep no ``p.grad``: the window carries which parameters the last step
    had)."""
    runs = []
    for saving in (False, True):
        model, _ = make_models(torch.float32)
        opt = _opt(model, stage, "backward")
        model(batch(0, ROWS), extra=(0, ROWS)).backward()
        opt.step()
        model(batch(1, ROWS)).backward()
        if saving:
            ck.save(str(tmp_path), model, opt)
            model, _ = make_models(torch.float32)
            opt = _opt(model, stage, "backward")
            ck.load(str(tmp_path), model, opt)
        opt.zero_grad(set_to_none=False)
        model(batch(2, ROWS)).backward()
        opt.step()
        runs.append(_state(model, opt))
    expected, got = runs
    assert got.keys() == expected.keys(), sorted(got)
    for key, value in expected.items():
        assert torch.equal(got[key], value), f"stage {stage}: {key} differs by {(got[key] - value).abs().max():.3g}"
