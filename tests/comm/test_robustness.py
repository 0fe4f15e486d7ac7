"""No silent loss, no crash on bad input: what a new user runs into, tried on 2 gloo ranks.

- The package runs without numpy (the CPU torch wheel does not bring it): save, load, gather.
- Ranks that disagree on options or hyper-parameters (a clip_grad_norm_'s max_norm too) raise on every rank,
  naming the key, the values and the ranks, before any mismatched collective (construction) or update (step).
- Non-finite gradients in fp32/bf16 skip the step on every rank, counted; as if it never happened.
- A peer dying during backward gives the survivor a ``CommError`` naming the operation.

(The just-in-time build's announcements and lock: ``tests/extension/test_build_lock.py``.)
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_kernels.optim as zo
from tests.helpers.dist import run_ranks
from tests.helpers.paths import pythonpath
from zero_kernels import _ext, comm, comm_objects
from zero_kernels.agreement import RanksDisagree

BUCKET = 7  # elements: parameters straddle buckets and shards


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 5)
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(x))).square().mean()


def make_net(dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(0)
    return Net().to(dtype)


def batch(step: int, rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank)).to(dtype)


def _raises_everywhere(make: Callable[[], Any], *patterns: str) -> None:
    """``make()`` raises ``RanksDisagree`` on this rank with a message matching every pattern."""
    with pytest.raises(RanksDisagree) as info:
        make()
    for pattern in patterns:
        assert pattern in str(info.value), f"{pattern!r} not in: {info.value}"


# ---------------------------------------------------------------- numpy
class _TwoRankLoopback:
    """An engine of 2 ranks where the other rank sends what this one sends (exercises the byte paths)."""

    world_size, rank, backend = 2, 0, "gloo"

    def all_reduce(self, tensor: torch.Tensor, *, op: str, name: str) -> comm.Handle:
        return comm.Handle(None, ())

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, name: str) -> comm.Handle:
        output.copy_(torch.cat([input, input]))
        return comm.Handle(None, ())


def numpy_free_body(root: str) -> None:
    """Train, save, load and gather objects in a process where ``import numpy`` fails."""
    with pytest.raises(ModuleNotFoundError):
        import numpy  # noqa: F401
    import zero_kernels as zk

    model = make_net(torch.bfloat16)
    opt = zo.ShardedFusedAdam(model, lr=1e-2, stage=1, reduce_bucket_size=BUCKET)
    model(batch(0, 0, torch.bfloat16)).backward()
    opt.step()
    zk.checkpoint.save(root, model, opt, extra={"epoch": 3})
    again = make_net(torch.bfloat16)
    opt_again = zo.ShardedFusedAdam(again, lr=1e-2, stage=2, reduce_bucket_size=BUCKET)
    assert zk.checkpoint.load(root, again, opt_again) == {"epoch": 3}
    for p, q in zip(model.parameters(), again.parameters()):
        assert torch.equal(p, q)
    assert comm_objects.all_gather_objects(_TwoRankLoopback(), {"a": [1, 2]}) == [{"a": [1, 2]}] * 2


@pytest.mark.slow  # a fresh interpreter that saves, loads and gathers
def test_package_needs_no_numpy(tmp_path: Path) -> None:
    blocker = tmp_path / "blocked" / "numpy"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ModuleNotFoundError("numpy is blocked here", name="numpy")\n')
    path = pythonpath(blocker.parent)
    code = f"import tests.comm.test_robustness as t; t.numpy_free_body({str(tmp_path / 'ckpt')!r})"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


# ---------------------------------------------------------------- ranks that disagree
def _construction_cases(rank: int) -> None:
    one = rank == 1
    _raises_everywhere(
        lambda: zo.ShardedFusedAdam(make_net(), stage=3 if one else 2),
        "the ranks disagree on stage: 2 on rank 0, 3 on rank 1",
    )
    _raises_everywhere(
        lambda: zo.ShardedFusedAdam(make_net(), stage=2, reduce_bucket_size=17 if one else 13),
        "zero_optimization.reduce_bucket_size: 13 on rank 0, 17 on rank 1",
    )
    _raises_everywhere(
        lambda: zo.ShardedFusedAdam(make_net(), lr=2e-3 if one else 1e-3, stage=1),
        "param_groups[0]['lr']: 0.001 on rank 0, 0.002 on rank 1",
    )
    _raises_everywhere(
        lambda: zo.ShardedFusedAdam(make_net(), stage=1, gradient_accumulation_steps=2 if one else 1),
        "gradient_accumulation_steps: 1 on rank 0, 2 on rank 1",
    )
    _raises_everywhere(
        lambda: zo.ShardedFusedAdam(make_net(torch.bfloat16 if one else torch.float32), stage=1),
        "param_groups[0]['params'][0] ('emb.weight'): 'float32 (5, 4) trainable on cpu' on rank 0, "
        "'bfloat16 (5, 4) trainable on cpu' on rank 1",
    )
    model = make_net()
    groups = [{"params": [model.emb.weight]}, {"params": [model.emb.bias]}]
    _raises_everywhere(
        lambda: zo.ShardedFusedAdam(groups[: 2 if one else 1], stage=2, module=model),
        "the construction step: 'constructed with 1 param groups' on rank 0, 'adding param group 1' on rank 1",
    )


def _step_cases(rank: int) -> None:
    for stage in (0, 1, 3):
        model = make_net()
        opt = zo.ShardedFusedAdam(model, lr=1e-3, stage=stage, reduce_bucket_size=BUCKET)
        with opt.gathered_params():
            before = [p.detach().clone() for p in model.parameters()]
        cases = [
            (lambda: opt.param_groups[0].update(lr=5e-3), "param_groups[0]['lr']: 0.001 on rank 0, 0.005 on rank 1"),
            (lambda: opt.param_groups[0].update(betas=(0.8, 0.999)), "param_groups[0]['betas'][0]: 0.9 on rank 0"),
            (lambda: setattr(opt, "max_grad_norm", 1.0), "max_grad_norm (gradient_clipping): None on rank 0, 1.0"),
        ]
        for change, pattern in cases:
            saved = (dict(opt.param_groups[0]), opt.max_grad_norm)
            if rank == 1:
                change()
            model(batch(0, rank)).backward()
            _raises_everywhere(
                opt.step, f"ShardedFusedAdam.step: the ranks disagree on {pattern}", "nothing was updated"
            )
            opt.param_groups[0].update(saved[0])
            opt.max_grad_norm = saved[1]
            opt.zero_grad()
        model(batch(0, rank)).backward()
        opt.clip_grad_norm_(0.05 if rank == 1 else 0.5)  # a collective: both ranks call it, with other norms
        _raises_everywhere(
            opt.step, "the ranks disagree on clip_grad_norm_'s max_norm: 0.5 on rank 0, 0.05 on rank 1", "nothing was"
        )
        opt.zero_grad()
        with opt.gathered_params():
            for p, b in zip(model.parameters(), before):
                assert torch.equal(p, b), f"stage {stage}: a refused step changed a parameter"
        model(batch(1, rank)).backward()
        opt.step()  # the ranks are still in step with each other
        assert opt.pipeline.steps[0] == 1


def disagree_part(rank: int) -> None:
    _construction_cases(rank)
    _step_cases(rank)


# ---------------------------------------------------------------- non-finite gradients
NAN_STEP, STEPS = 2, 4


def _state(opt: zo.ShardedFusedAdam) -> list[Optional[torch.Tensor]]:
    return [t for buf in opt.pipeline.buffers for t in (buf.master, buf.exp_avg, buf.exp_avg_sq)]


def _train(stage: int, dtype: torch.dtype, rank: int, bad: Optional[float], **options: Any) -> tuple:
    """``STEPS`` steps; at ``NAN_STEP`` rank 1 gets a ``bad`` gradient in one element (None: that step is left out)."""
    model = make_net(dtype)
    opt = zo.ShardedFusedAdam(model, lr=1e-2, stage=stage, reduce_bucket_size=BUCKET, max_grad_norm=None, **options)
    for step in range(STEPS):
        if step == NAN_STEP and bad is None:
            continue
        hook = None
        if step == NAN_STEP and rank == 1:
            hook = model.head.bias.register_hook(lambda g: g + torch.tensor([bad], dtype=g.dtype))
        opt.backward(model(batch(step, rank, dtype)))  # fp16 loss scaling refuses a plain backward
        if hook is not None:
            hook.remove()
        if step == NAN_STEP:
            state = [None if t is None else t.clone() for t in _state(opt)]
            counts = dict(opt.pipeline.steps)
        opt.step()
        opt.zero_grad()
        if step == NAN_STEP and opt.skip_nonfinite_steps:
            after = _state(opt)
            assert opt.last_step.skipped and opt.skipped_steps == 1, f"stage {stage} {dtype}: step not skipped"
            assert all(a is None or torch.equal(a, b) for a, b in zip(after, state)), "a skipped step changed state"
            assert opt.pipeline.steps == counts, "a skipped step counted"
    with opt.gathered_params():
        params = [p.detach().clone() for p in model.parameters()]
    return params, [t.clone() for t in _state(opt) if t is not None], opt


def nonfinite_part(rank: int) -> None:
    for stage in (0, 1, 2, 3):
        for dtype, bad in ((torch.float32, math.nan), (torch.bfloat16, math.inf)):
            params, shards, _ = _train(stage, dtype, rank, bad)
            want_params, want_shards, _ = _train(stage, dtype, rank, None)
            for got, want in zip(params + shards, want_params + want_shards):
                assert torch.equal(got, want), f"stage {stage} {dtype}: a skipped step is not as if it never happened"
    params, _, opt = _train(2, torch.float32, rank, math.nan, skip_nonfinite_steps=False)
    assert opt.skipped_steps == 0 and params[-1].isnan().all(), "skip_nonfinite_steps=False must apply the NaN"
    fp16 = dict(enabled=True, loss_scale=0, initial_scale_power=4)
    _, _, opt = _train(1, torch.float16, rank, math.inf, skip_nonfinite_steps=False, fp16=fp16)
    assert opt.skipped_steps == 1, "fp16 loss scaling must skip an overflow whatever skip_nonfinite_steps says"


def unscaled_backward_part(rank: int) -> None:
    """fp16 loss scaling, rank 1 alone calls loss.backward() in place of opt.backward(loss): every rank raises at the
    step, naming rank 1 and a parameter, and nothing is updated (a rank raising alone would leave the other waiting)."""
    for stage in (0, 1, 2, 3):
        model = make_net(torch.float16)
        opt = zo.ShardedFusedAdam(model, stage=stage, reduce_bucket_size=BUCKET, fp16={"enabled": True})
        state = [None if t is None else t.clone() for t in _state(opt)]
        loss = model(batch(0, rank, torch.float16))
        loss.backward() if rank == 1 else opt.backward(loss)
        with pytest.raises(RuntimeError, match=r"loss scaling is required .*found on rank 1 of 2; every rank raises"):
            opt.step()
        assert all(a is None or torch.equal(a, b) for a, b in zip(_state(opt), state)), f"stage {stage}: updated"


# ---------------------------------------------------------------- both in one spawn (it costs seconds)
PARTS = {"disagree": disagree_part, "nonfinite": nonfinite_part, "unscaled": unscaled_backward_part}


def parts_body(rank: int, world: int, out: str) -> None:
    """Run every part on this rank; write ``ok`` or the failure to ``out/PART.RANK``."""
    for name, part in PARTS.items():
        try:
            part(rank)
            outcome = "ok"
        except Exception:
            outcome = traceback.format_exc()
        Path(out, f"{name}.{rank}").write_text(outcome)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("outcomes")
    run_ranks(parts_body, 2, str(out))
    return out


def _check_part(out: Path, name: str) -> None:
    for rank in range(2):
        path = out / f"{name}.{rank}"
        outcome = path.read_text() if path.exists() else "no outcome (the rank died)"
        assert outcome == "ok", f"rank {rank}:\n{outcome}"


@pytest.mark.distributed
def test_ranks_that_disagree_are_named_on_every_rank(outcomes: Path) -> None:
    _check_part(outcomes, "disagree")


@pytest.mark.distributed
def test_nonfinite_gradients_skip_the_step_on_every_rank(outcomes: Path) -> None:
    _check_part(outcomes, "nonfinite")


@pytest.mark.distributed
def test_an_unscaled_fp16_backward_on_one_rank_raises_on_every_rank(outcomes: Path) -> None:
    _check_part(outcomes, "unscaled")


def test_skip_nonfinite_steps_is_a_config_key() -> None:
    import zero_kernels as zk

    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "skip_nonfinite_steps": False}
    _, opt = zk.initialize(make_net(), config)
    assert opt.skip_nonfinite_steps is False
    _, opt = zk.initialize(make_net(), {**config, "skip_nonfinite_steps": True})
    assert opt.skip_nonfinite_steps is True
    with pytest.raises(ValueError, match="skip_nonfinite_steps='sometimes' is invalid: expected true or false"):
        zk.ZeroConfig.from_deepspeed({**config, "skip_nonfinite_steps": "sometimes"})


# ---------------------------------------------------------------- a peer dying during backward
def peer_death_body(rank: int, world: int, engines: list[str]) -> None:
    built = []
    for kind in engines:
        os.environ["ZERO_KERNELS_COMM"] = kind
        group = dist.new_group(backend="gloo")
        model = make_net()
        opt = zo.ShardedFusedAdam(model, stage=2, reduce_bucket_size=BUCKET, process_group=group)
        assert opt.pipeline.engine.kind == kind
        built.append((kind, model, opt, group))
    dist.barrier()
    if rank == 1:
        os._exit(0)  # dies with every collective of rank 0 still ahead
    time.sleep(1.0)
    for kind, model, _, _ in built:
        with pytest.raises(comm.CommError, match=r"reduce_scatter of bucket 'grads\.\d+' on rank 0 of 2 \(gloo\)"):
            model(batch(0, rank)).backward()
    os._exit(0)  # the peer is gone: skip the process group's teardown


@pytest.mark.distributed
def test_a_peer_dying_in_backward_is_a_comm_error(spawn) -> None:
    engines = ["torch"] + (["cpp"] if _ext.available("comm") else [])
    spawn(peer_death_body, 2, engines, timeout_s=30.0)
