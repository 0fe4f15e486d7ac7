"""No silent loss, no crash on bad input: what a new user runs into, tried on 2 gloo ranks.

- The package runs without numpy (the CPU torch wheel does not bring it): save, load, gather.
- Ranks that disagree on options or hyper-parameters raise on every rank, naming the key, the
  values and the ranks, before any mismatched collective (construction) or update (step).
- Non-finite gradients in fp32/bf16 skip the step on every rank, counted; as if it never happened.
- A peer dying during backward gives the survivor a ``CommError`` naming the operation.
- The just-in-time build says at WARNING that it runs and for how long, who it waits for, and
  removes a lock left by a killed build instead of waiting on it.
"""

from __future__ import annotations

import logging
import math
import os
import re
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
from zero_kernels import _build_lock, _ext, comm, comm_objects
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
    for stage in (1, 3):
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
        model(batch(step, rank, dtype)).backward()
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


# ---------------------------------------------------------------- both in one spawn (it costs seconds)
PARTS = {"disagree": disagree_part, "nonfinite": nonfinite_part}


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


# ---------------------------------------------------------------- first use of the C++ build
@pytest.fixture
def fake_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """``_ext.load`` with torch's build replaced by one that refuses to start while torch's lock exists."""
    from torch.utils import cpp_extension

    seen: dict[str, Any] = {"dir": tmp_path / "build", "loads": 0}
    monkeypatch.setattr(_ext, "_RESULTS", {})
    monkeypatch.setattr(_ext, "_prebuilt", lambda name: None)
    monkeypatch.setattr(_ext, "_missing_toolchain", lambda with_cuda: None)
    monkeypatch.setattr(_build_lock, "WAIT_LOG_S", 0.5)
    monkeypatch.setattr(_build_lock, "FIRST_WAIT_LOG_S", 0.5, raising=False)
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(seen["dir"]))

    def load(name: str, **kwargs: Any) -> str:
        assert not (seen["dir"] / "lock").exists(), "torch would wait forever on this lock"
        seen["loads"] += 1
        (seen["dir"] / f"{name}.so").write_bytes(b"")
        return name

    monkeypatch.setattr(cpp_extension, "load", load)
    return seen


def hold_lock(directory: str, torch_lock: bool, seconds: float) -> None:
    """Hold the build lock for ``seconds`` (with torch's, as a build does, if ``torch_lock``), saying when."""
    with _build_lock.hold(directory, "a test build"):
        if torch_lock:
            Path(directory, "lock").touch()
        print("held", flush=True)
        time.sleep(seconds)
        Path(directory, "lock").unlink(missing_ok=True)


def _holder(directory: Path, torch_lock: bool, seconds: float) -> subprocess.Popen:
    code = f"import tests.comm.test_robustness as t; t.hold_lock({str(directory)!r}, {torch_lock}, {seconds})"
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def load_slowly(directory: str, seconds: float) -> None:
    """In another process: load the (up-to-date) build of 'ops' in ``directory``, the load taking ``seconds``."""
    from torch.utils import cpp_extension

    _ext._prebuilt = lambda name: None
    _ext._missing_toolchain = lambda with_cuda: None
    cpp_extension._get_build_directory = lambda name, verbose: directory

    def load(name: str, **kwargs: Any) -> str:
        print("held", flush=True)
        time.sleep(seconds)
        return name

    cpp_extension.load = load
    _ext.load("ops")


def _loader(directory: Path, seconds: float) -> subprocess.Popen:
    code = f"import tests.comm.test_robustness as t; t.load_slowly({str(directory)!r}, {seconds})"
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_first_build_is_announced_and_a_cached_one_is_not(fake_build: dict, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        assert _ext.load("ops") == "zero_kernels_ops"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("building the C++ extension 'ops'" in m and "usually takes 1-6 minutes" in m for m in warnings), warnings
    assert any("extension 'ops' ready in" in m for m in warnings), warnings
    caplog.clear()
    _ext._RESULTS.clear()
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        _ext.load("ops")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "an up-to-date build is quiet"


def test_waiting_for_another_build_names_it(fake_build: dict, caplog) -> None:
    holder = _holder(fake_build["dir"], torch_lock=True, seconds=2.0)
    try:
        with caplog.at_level(logging.WARNING, logger="zero_kernels"):
            _ext.load("ops")  # waits until the holder finishes, then builds
    finally:
        holder.wait(timeout=60)
    assert fake_build["loads"] == 1
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert f"waiting for process {holder.pid} to finish building the C++ extension 'ops'" in messages, messages


def test_loading_a_cached_build_waits_for_no_one(fake_build: dict, caplog) -> None:
    """Every rank of a launch loads the cached build: none waits for another, none warns."""
    _ext.load("ops")  # the first build; cached from now on
    _ext._RESULTS.clear()
    caplog.clear()
    loader = _loader(fake_build["dir"], seconds=4.0)  # another process, in the middle of loading it
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="zero_kernels"):
            _ext.load("ops")
        took = time.monotonic() - start
    finally:
        loader.wait(timeout=60)
    assert took < 2.0, f"waited {took:.1f} s for another process that was only loading the cached build"
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_a_real_wait_says_how_long(monkeypatch: pytest.MonkeyPatch, fake_build: dict, caplog) -> None:
    """A process that waits for a build says so only once the wait is real, with real durations."""
    monkeypatch.setattr(_build_lock, "FIRST_WAIT_LOG_S", 1.2, raising=False)
    holder = _holder(fake_build["dir"], torch_lock=False, seconds=3.0)
    try:
        with caplog.at_level(logging.WARNING, logger="zero_kernels"):
            _ext.load("ops")
    finally:
        holder.wait(timeout=60)
    waits = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
    assert waits, [r.getMessage() for r in caplog.records]
    found = re.search(r"building it for (\d+) s; waited (\d+) s so far", waits[0])
    assert found and int(found[1]) >= 1 and int(found[2]) >= 1, waits[0]


def test_lock_of_a_killed_build_is_removed_not_waited_on(fake_build: dict, caplog) -> None:
    holder = _holder(fake_build["dir"], torch_lock=True, seconds=120.0)
    holder.kill()  # SIGKILL mid-build: torch's lock and the holder's record stay behind
    holder.wait()
    assert (fake_build["dir"] / "lock").exists()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        _ext.load("comm")
    assert time.monotonic() - start < 30
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert f"process {holder.pid} was interrupted and is no longer running" in messages, messages


def test_torch_lock_is_judged_by_its_owner(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the zero_kernels lock held, torch's lock is stale unless its recorded owner may still build."""
    import socket

    host, now = socket.gethostname(), time.time()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    young, old = 60.0, _build_lock.STALE_LOCK_S + 60.0
    assert _build_lock._stale_because(None, young) is not None  # the last build finished: nobody owns it
    assert "no longer running" in _build_lock._stale_because((int(gone.stdout), host, now), young)
    assert _build_lock._stale_because((os.getpid(), host, now), old) is None  # alive: wait, however old
    assert _build_lock._stale_because((1, "elsewhere", now), young) is None  # cannot be checked: young is kept
    assert "cannot be checked" in _build_lock._stale_because((1, "elsewhere", now), old)
    monkeypatch.setattr(_build_lock, "fcntl", None)  # no flock (Windows): age alone, for an unknown owner
    assert _build_lock._stale_because(None, young) is None and _build_lock._stale_because(None, old) is not None
