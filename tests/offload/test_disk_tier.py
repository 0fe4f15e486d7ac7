"""The disk tier: the state in files of the expected size while training (the memory freed), a killed run's
files removed at the next start, and a missing, unwritable or full ``nvme_path`` refused with its name
before anything changes."""

from __future__ import annotations

import contextlib
import copy
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch import nn

import zero_kernels.optim as zo
from zero_kernels.config import ZeroOptions
from zero_kernels.config.offload import AioConfig, OffloadOptimizerConfig
from zero_kernels.offload import DiskTier, disk, run_directory

SUB_GROUP = 2048


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 32)).to(torch.bfloat16)


def _opt(model: nn.Module, path: Path, **extra) -> zo.ShardedFusedAdam:
    offload = {"device": "nvme", "nvme_path": str(path), "pipeline_read": True, "pipeline_write": True, **extra}
    return zo.ShardedFusedAdam(model, stage=2, reduce_bucket_size=1024, sub_group_size=SUB_GROUP,
                               offload_optimizer=offload)  # fmt: skip


def _step(model: nn.Module, opt: zo.ShardedFusedAdam) -> None:
    model(torch.randn(4, 64).to(torch.bfloat16)).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_sub_group_size_zero_swaps_each_bucket_alone(tmp_path: Path) -> None:
    """``sub_group_size: 0`` (Axolotl's templates; DeepSpeed: every parameter its own sub-group): one sub-group
    per bucket, the smallest unit the disk tier swaps."""
    model = _model()
    offload = {"device": "nvme", "nvme_path": str(tmp_path)}
    opt = zo.ShardedFusedAdam(model, stage=2, reduce_bucket_size=1024, sub_group_size=0, offload_optimizer=offload)
    _step(model, opt)
    (buf,) = opt._pipeline.buffers
    assert len(buf.layout.buckets) > 1
    assert [(first, end) for first, end, *_ in buf.groups] == [(b.index, b.index + 1) for b in buf.layout.buckets]


def test_state_lives_in_files_while_training(tmp_path: Path) -> None:
    model = _model()
    opt = _opt(model, tmp_path)
    pipeline = opt._pipeline
    tier = pipeline.tier
    for _ in range(2):
        _step(model, opt)
    (buf,) = pipeline.buffers
    assert tier.root.parent.parent == tmp_path / "zero_kernels" and tier.root.name == "rank0"
    assert len(buf.groups) > 1 and all(numel <= SUB_GROUP for *_, numel in buf.groups)
    expected = {f"b0.g{g}.{kind}": numel * 4 for g, (*_, numel) in enumerate(buf.groups)
                for kind in ("exp_avg", "exp_avg_sq", "master")}  # fmt: skip
    assert {p.name: p.stat().st_size for p in tier.root.iterdir()} == expected
    assert all(getattr(buf, k).numel() == 0 for k in ("exp_avg", "exp_avg_sq", "master"))  # freed: none on the device
    report = opt.memory_report()
    assert report["disk"] == sum(expected.values()) == buf.layout.shard_numel * 12
    swap_buffers = 4 * 3 * (SUB_GROUP * 4 + 4096)  # buffer_count (4) x kinds x a sub-group, aligned
    assert report["optimizer"] == 0 and report["host"] <= swap_buffers + buf.layout.shard_numel * 4
    m = next(iter(opt.full_state_dict()["state"].values()))["exp_avg"]  # read in from the files
    assert m.abs().sum() > 0 and buf.exp_avg.device.type == "cpu"
    _step(model, opt)
    assert buf.exp_avg.numel() == 0  # written back and freed again by the step
    opt._pipeline.tier.close()
    assert not tier.run.exists()


def test_files_removed_when_the_optimizer_is_collected(tmp_path: Path) -> None:
    model = _model()
    opt = _opt(model, tmp_path)
    run = opt._pipeline.tier.run
    assert run.exists()
    del opt
    import gc

    gc.collect()
    assert not run.exists()


def test_del_removes_the_files_at_once(tmp_path: Path) -> None:
    """No reference cycle keeps a stage 1-2 disk tier (a split buffer's swap-in held the buffer) until Python's
    collector runs: ``del opt`` removes its files then, as it frees the optimizer."""
    import gc

    model = _model()
    opt = _opt(model, tmp_path, ratio=0.5)
    _step(model, opt)
    run = opt._pipeline.tier.run
    gc.disable()
    try:
        del opt
        assert not run.exists()
    finally:
        gc.enable()


KILLED = textwrap.dedent(
    """
    import os, signal, sys, torch
    import zero_kernels.optim as zo
    model = torch.nn.Linear(8, 8)
    opt = zo.ShardedFusedAdam(model, stage=1, offload_optimizer={"device": "nvme", "nvme_path": sys.argv[1]})
    print(opt._pipeline.tier.run, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_killed_runs_files_removed_at_the_next_start(tmp_path: Path) -> None:
    env = {**os.environ, "ZERO_KERNELS_IMPL": "torch"}
    done = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path)], capture_output=True, text=True, env=env)
    assert done.returncode == -signal.SIGKILL, done.stderr
    stale = Path(done.stdout.strip())
    assert stale.is_dir() and any(stale.rglob("*.exp_avg"))  # left behind by the killed run
    live = tmp_path / "zero_kernels" / f"{os.uname().nodename}-{os.getpid()}-keep"
    live.mkdir()  # a run of a process that is alive is never touched
    tier = _tier(tmp_path)
    assert not stale.exists() and live.exists() and tier.root.exists()
    tier.close()
    assert live.is_dir() and not tier.run.exists()  # the closed run took only its own directory


FORKED = textwrap.dedent(
    """
    import gc, os, sys, torch
    import zero_kernels.optim as zo
    model = torch.nn.Linear(8, 8)
    opt = zo.ShardedFusedAdam(model, stage=1, offload_optimizer={"device": "nvme", "nvme_path": sys.argv[1]})
    def step():
        model(torch.ones(2, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    step()
    pid = os.fork()
    if pid == 0:
        if sys.argv[2] == "del":
            del opt
            gc.collect()
        sys.exit(0)  # a normal exit: the finalizers run, in the child
    os.waitpid(pid, 0)
    assert any(opt._pipeline.tier.root.iterdir()), "the child removed the parent's files"
    step()
    print("ok", flush=True)
    """
)


@pytest.mark.parametrize("how", ["exit", "del"])
def test_a_forked_child_leaves_the_parents_files(tmp_path: Path, how: str) -> None:
    """A child of ``os.fork()`` shares the run's lock and runs its finalizer at exit (or when it drops its copy of
    the optimizer): it must not remove the parent's directory, which the parent's next step reads."""
    env = {**os.environ, "ZERO_KERNELS_IMPL": "torch"}
    done = subprocess.run([sys.executable, "-c", FORKED, str(tmp_path), how], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    assert not (tmp_path / "zero_kernels").exists()  # the parent's exit removed its own run


_KEPT: list = []


def _hold_a_run(nvme_path: str, told: "multiprocessing.queues.Queue") -> None:
    from zero_kernels.offload.run_directory import RunDirectory

    _KEPT.append(RunDirectory(nvme_path, "offload_optimizer.nvme_path", 0))  # alive when the process ends
    told.put(str(_KEPT[-1].run))


def test_a_process_multiprocessing_forked_removes_its_run_when_it_ends(tmp_path: Path) -> None:
    """A rank started by multiprocessing's fork (Accelerate's ``notebook_launcher``) ends with ``os._exit``, which
    runs no interpreter exit: its files stayed on the disk until the next run on the host removed them."""
    context = multiprocessing.get_context("fork")
    told = context.Queue()
    child = context.Process(target=_hold_a_run, args=(str(tmp_path), told))
    child.start()
    run = Path(told.get(timeout=60))
    child.join(60)
    assert child.exitcode == 0 and not run.exists(), f"the ended process left {sorted(run.rglob('*'))}"


HOLDER = textwrap.dedent(
    """
    import sys
    from zero_kernels.offload.run_directory import RunDirectory
    directory = RunDirectory(sys.argv[1], "offload_optimizer.nvme_path", 0)
    print(directory.run, flush=True)
    sys.stdin.readline()
    """
)


def _tier(path: Path) -> DiskTier:
    config = OffloadOptimizerConfig(device="nvme", nvme_path=str(path))
    return DiskTier(config, AioConfig(), rank=0, sub_group_size=ZeroOptions().sub_group_size)


def test_a_live_run_is_kept_whatever_its_pid_says(tmp_path: Path) -> None:
    """A run's owner holds its lock while it lives: a run whose pid names no process here (one started in another
    PID namespace, such as a container with the host's network and so its host name) is kept while its owner runs,
    and removed by the next start once the owner is killed."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    env = {**os.environ, "ZERO_KERNELS_IMPL": "torch"}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        run = Path(holder.stdout.readline().strip())
        assert run.is_dir(), holder.poll()
        seen_elsewhere = run.with_name(f"{os.uname().nodename}-{int(gone.stdout)}-elsewhere")
        run.rename(seen_elsewhere)  # its pid as a process in another PID namespace shows here: none that runs
        tier = _tier(tmp_path)
        assert seen_elsewhere.is_dir() and (seen_elsewhere / "rank0").is_dir()
        tier.close()
    finally:
        holder.kill()
        holder.wait()
    assert holder.returncode == -signal.SIGKILL
    tier = _tier(tmp_path)
    assert not seen_elsewhere.exists() and tier.root.is_dir()
    tier.close()


def test_relative_nvme_path_is_made_absolute_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative ``nvme_path`` is taken from the working directory at start: a later ``os.chdir`` changes
    nothing (the steps read and write the same files, which go when the optimizer is closed); ``~`` is the home
    directory; a missing one names the path it was taken as."""
    (tmp_path / "here" / "nv").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    model = _model()
    opt = _opt(model, Path("nv"))
    _step(model, opt)
    tier = opt._pipeline.tier
    assert tier.run.parent == tmp_path / "here" / "nv" / "zero_kernels"
    monkeypatch.chdir(tmp_path / "elsewhere")
    for _ in range(2):
        _step(model, opt)
    assert tier.bytes_read > 0 and tier.root.is_dir()
    tier.close()
    assert not (tmp_path / "here" / "nv" / "zero_kernels").exists() and not any(Path().iterdir())
    monkeypatch.setenv("HOME", str(tmp_path / "here"))
    tier = _tier(Path("~/nv"))
    assert tier.run.parent == tmp_path / "here" / "nv" / "zero_kernels"
    tier.close()
    missing = str(tmp_path / "elsewhere" / "nv")
    with pytest.raises(OSError, match=f"nvme_path='nv' is not a directory .*: {missing!r}"):
        _tier(Path("nv"))


def _untouched(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    opt = zo.ShardedFusedAdam(model, stage=2)  # the model is still good for an optimizer without offload
    _step(model, opt)


def test_missing_nvme_path_is_refused_naming_it(tmp_path: Path) -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    missing = tmp_path / "no" / "such"
    with pytest.raises(OSError, match=f"nvme_path={str(missing)!r} is not a directory"):
        _opt(model, missing)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(OSError, match="is not a directory"):
        _opt(model, a_file)
    _untouched(model, before)


@contextlib.contextmanager
def _tmpfs(where: Path, options: str) -> Iterator[Path]:
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): needs root and mount")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_unwritable_nvme_path_is_refused_naming_it(tmp_path: Path) -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with _tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        with pytest.raises(OSError, match=f"nvme_path={str(ro)!r}: cannot write .*(Read-only|read-only)"):
            _opt(model, ro)
    _untouched(model, before)


def test_full_disk_is_refused_naming_path_and_bytes(tmp_path: Path) -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with _tmpfs(tmp_path / "small", "size=64k") as small:
        with pytest.raises(OSError, match=rf"cannot reserve \d+ bytes in '{small}/zero_kernels/.*No space left"):
            _opt(model, small)
        assert not (small / "zero_kernels").exists()  # the failed run's files are gone, and its empty parent
    _untouched(model, before)


def test_add_param_group_on_a_full_disk_keeps_the_other_groups_state(tmp_path: Path) -> None:
    """``add_param_group`` on a disk without room for the new group's state raises naming the key, and only the new
    group's files go: the state already in files stays, and training goes on bit for bit as the same run without
    offload (before, the refusal closed the whole tier: every file of the run was removed and each later step
    raised "this FileIO is closed"); with room made, the group is added and trains."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 32)).to(torch.bfloat16)
    late_plain = nn.Linear(32, 32).to(torch.bfloat16)
    tiered, late_tiered = copy.deepcopy(plain), copy.deepcopy(late_plain)
    pairs = [(plain, late_plain, zo.ShardedFusedAdam(plain, stage=2, reduce_bucket_size=1024))]

    def step(model: nn.Module, late: "nn.Module | None", opt: zo.ShardedFusedAdam, seed: int) -> None:
        torch.manual_seed(seed)
        out = model(torch.randn(4, 64).to(torch.bfloat16))
        (out if late is None else late(out)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    with _tmpfs(tmp_path / "small", "size=1m") as small:
        pairs.append((tiered, late_tiered, _opt(tiered, small)))
        for seed in range(2):
            for model, _, opt in pairs:
                step(model, None, opt, seed)
        files = sorted(p.name for p in pairs[1][2]._pipeline.tier.root.iterdir())
        filler = small / "filler"
        filler.write_bytes(b"\0" * _room(str(small)))
        with pytest.raises(OSError, match=r"offload_optimizer.nvme_path: cannot reserve .*No space left"):
            pairs[1][2].add_param_group({"params": list(late_tiered.parameters())})
        assert len(pairs[1][2].param_groups) == 1
        assert sorted(p.name for p in pairs[1][2]._pipeline.tier.root.iterdir()) == files  # only the new ones went
        for seed in range(2, 4):
            for model, _, opt in pairs:
                step(model, None, opt, seed)
            _same_pair(pairs, state=seed == 3)
        filler.unlink()
        for _, late, opt in pairs:
            opt.add_param_group({"params": list(late.parameters())})
        for seed in range(4, 6):
            for model, late, opt in pairs:
                step(model, late, opt, seed)
        _same_pair(pairs, state=True)
        del pairs[1:]  # its files go before the disk does


def _same_pair(pairs: list, state: bool) -> None:
    (a, la, oa), (b, lb, ob) = pairs
    for p, q in zip(list(a.parameters()) + list(la.parameters()), list(b.parameters()) + list(lb.parameters())):
        assert torch.equal(p, q)
    if state:
        ours, theirs = ob.full_state_dict()["state"], oa.full_state_dict()["state"]
        assert ours.keys() == theirs.keys()
        for i in ours:
            for k in theirs[i]:
                assert torch.equal(ours[i][k], theirs[i][k]), (i, k)


def _amsgrad_on_a_full_disk(rank: int, world: int, disks: list[str], when: str) -> None:
    """Rank 1's disk has room for the moments but not for AMSGrad's maximum (made with the group: at the build, or
    at the first step with the flag switched on): every rank raises the same ``OSError`` there, before any update
    (before, rank 1 raised alone, at the step after other buckets were updated, and rank 0 waited in its next
    collective), and none of the maximum's files is left."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 48), nn.Linear(48, 48))  # each maximum more than the start probe's page
    before = {k: v.clone() for k, v in model.state_dict().items()}
    offload = {"device": "nvme", "nvme_path": disks[rank]}
    groups = lambda: [{"params": list(model[0].parameters())}, {"params": list(model[1].parameters())}]  # noqa: E731
    match = r"could not make AMSGrad's maximum \(max_exp_avg_sq\) in its files; nothing was updated: rank 1: .*space"
    opt = zo.ShardedFusedAdam(groups(), stage=2, offload_optimizer=offload)
    if rank == 1:  # leave room for the moments only (the build), or none (the step)
        free = _room(disks[1])
        if when == "build":
            del opt  # its files go at once
            free = _room(disks[1]) - free + run_directory._PROBE_BYTES  # the start's probe file, removed after
        Path(disks[1], "filler").write_bytes(b"\0" * (_room(disks[1]) - (free if when == "build" else 0)))
    if when == "build":
        with pytest.raises(OSError, match=match):
            last = groups()
            last[1]["amsgrad"] = True  # the last group's maximum: every moment is made before it
            zo.ShardedFusedAdam(last, stage=2, offload_optimizer=offload)
        return
    model(torch.ones(2, 48)).square().mean().backward()
    opt.param_groups[1]["amsgrad"] = True  # torch reads the flag at each step
    with pytest.raises(OSError, match=match):
        opt.step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing updated, on any rank
    assert not list(opt._pipeline.tier.root.glob("*.max_exp_avg_sq"))


def _room(where: str) -> int:
    stat = os.statvfs(where)
    return stat.f_bavail * stat.f_frsize


@pytest.mark.distributed
@pytest.mark.parametrize("when", ["build", "step"])
def test_amsgrad_on_a_full_disk_raises_on_every_rank(tmp_path: Path, when: str) -> None:
    from tests.helpers.dist import run_ranks

    with _tmpfs(tmp_path / "d0", "size=1m") as d0, _tmpfs(tmp_path / "d1", "size=1m") as d1:
        run_ranks(_amsgrad_on_a_full_disk, 2, [str(d0), str(d1)], when)


def _amsgrad_after_one_rank_read(rank: int, world: int, where: str) -> None:
    """Rank 0 alone reads the state (``state_dict()``: its buffers read in whole until the next step), then every
    rank switches amsgrad on: the maximum is made on every rank alike, through the same exchange (rank 0 made it
    in host memory and skipped the exchange, rank 1 waited in it: a deadlock), and training stays bit for bit
    that without offload."""
    models = [nn.Sequential(nn.Linear(24, 24), nn.Linear(24, 4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    path = Path(where) / f"r{rank}"
    path.mkdir(exist_ok=True)
    offload = {"device": "nvme", "nvme_path": str(path)}
    opts = [zo.ShardedFusedAdam(models[0], stage=2, offload_optimizer=offload), zo.ShardedFusedAdam(models[1], stage=2)]
    for step in range(3):
        for model, opt in zip(models, opts):
            model(torch.full((2, 24), 0.1 * (step + rank + 1))).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                if rank == 0:
                    opt.state_dict()
                opt.param_groups[0]["amsgrad"] = True
    assert all(torch.equal(a, b) for a, b in zip(*(m.parameters() for m in models)))


@pytest.mark.distributed
def test_amsgrad_switched_on_after_a_state_read_on_one_rank(tmp_path: Path) -> None:
    from tests.helpers.dist import run_ranks

    run_ranks(_amsgrad_after_one_rank_read, 2, str(tmp_path), timeout_s=60)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_state_views_and_copies_go_through_the_tier(device: str, tmp_path: Path) -> None:
    """Writes into ``opt.state[p]`` reach the tier's state (the disk tier: read in, written back at the step),
    and a deep copy or a pickle gets a tier of its own with the same state."""
    import copy
    import io

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)).to(torch.bfloat16)
    tiered = copy.deepcopy(plain)
    offload = {"device": device, "nvme_path": str(tmp_path)}
    a = zo.ShardedFusedAdam(plain, stage=2, amsgrad=True)
    b = zo.ShardedFusedAdam(tiered, stage=2, amsgrad=True, offload_optimizer=offload, sub_group_size=16,
                            reduce_bucket_size=16)  # fmt: skip
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    for model, opt in ((plain, a), (tiered, b)):
        for step in range(3):
            model(x).float().sum().backward()
            if step == 1:
                p = next(model.parameters())
                opt.state[p]["exp_avg"].fill_(0.25)
                opt.state[p]["master"].add_(0.5)
            opt.step()
            opt.zero_grad()
    for p, q in zip(plain.parameters(), tiered.parameters()):
        assert torch.equal(p, q)
    copied = copy.deepcopy(b)
    assert copied._pipeline.tier is not b._pipeline.tier and type(copied._pipeline.tier) is type(b._pipeline.tier)
    pickled = io.BytesIO()
    torch.save(b, pickled)
    for other in (copied, torch.load(io.BytesIO(pickled.getvalue()), weights_only=False)):
        theirs, ours = other.full_state_dict()["state"], b.full_state_dict()["state"]
        assert all(torch.equal(theirs[i][k], ours[i][k]) for i in ours for k in ours[i])


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_a_new_buffers_state_goes_to_its_files_piece_by_piece(
    ratio: float, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new buffer's state, and AMSGrad's maximum made at the first step, start in their files without a whole
    shard of them in host memory: the master is written ``disk.PIECE`` elements at a time (made small here, so
    pieces end inside sub-groups and buckets), and the rest is new files, which read zeros. Read back, the master
    is the bf16 parameters widened and the rest zeros, element by element, and training matches the same
    optimizer without offload bit for bit (``ratio`` 0.5: the first buckets stay on the device)."""
    import copy

    from zero_kernels.offload import aio, host

    piece = 300
    monkeypatch.setattr(disk, "PIECE", piece)
    largest = [0]

    def tracked(make):
        def allocate(self, numel, *args, **kwargs):
            largest[0] = max(largest[0], numel)
            return make(self, numel, *args, **kwargs)

        return allocate

    for owner, name in ((aio.FileIO, "empty"), (host.HostTier, "empty"), (host.HostTier, "zeros")):
        monkeypatch.setattr(owner, name, tracked(getattr(owner, name)))
    model = _model()
    plain = copy.deepcopy(model)
    offload = {"device": "nvme", "nvme_path": str(tmp_path), "ratio": ratio}
    opt = zo.ShardedFusedAdam(model, stage=2, reduce_bucket_size=1024, sub_group_size=SUB_GROUP, amsgrad=True,
                              offload_optimizer=offload)  # fmt: skip
    (buf,) = opt._pipeline.buffers
    opt._pipeline.allocate_max_exp_avg_sq(0)  # as the first step does
    assert buf.layout.shard_numel > 4 * piece and largest[0] <= piece
    assert (buf.tier_from > 0) == (ratio < 1) and len(buf.groups) > 1
    buf.ready()  # read in from the files
    for bucket in buf.layout.buckets:
        assert torch.equal(buf.shard_slice(buf.master, bucket), opt._pipeline.param_shard(buf, bucket).float())
    assert buf.master.any() and buf.max_exp_avg_sq.numel() == buf.layout.shard_numel
    assert not any(t.any() for t in (buf.exp_avg, buf.exp_avg_sq, buf.max_exp_avg_sq))
    ref = zo.ShardedFusedAdam(plain, stage=2, reduce_bucket_size=1024, amsgrad=True)
    for step in range(3):
        for m, o in ((model, opt), (plain, ref)):
            torch.manual_seed(step)
            _step(m, o)
    kinds = ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p, q)
        assert all(torch.equal(opt.state[p][k], ref.state[q][k]) for k in kinds)


class _WithEmpty(nn.Module):
    """A trainable parameter of no elements (a zero-length prompt) in a unit of its own, beside a layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 3)
        self.prefix = nn.Module()
        self.prefix.w = nn.Parameter(torch.empty(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).square().sum() + self.prefix.w.sum()


@pytest.mark.parametrize("params", [None, "cpu", "nvme"], ids=["state on disk", "+ parameters in host", "+ on disk"])
def test_a_zero_element_parameter_trains_at_stage3_on_disk(tmp_path: Path, params: "str | None") -> None:
    """Its unit reserves empty files (``posix_fallocate`` refuses a length of 0), no pool room and no parameter file;
    the weights are those of the same model without offload, bit for bit."""
    disk = {"device": "nvme", "nvme_path": str(tmp_path)}
    extra = {"offload_param": {**disk, "device": params, "max_in_cpu": 0}} if params else {}
    models = [_WithEmpty(), _WithEmpty()]
    opts = [
        zo.ShardedFusedAdam(m, lr=0.1, stage=3, stage3_param_persistence_threshold=0, **kw)
        for m, kw in zip(models, ({}, {"offload_optimizer": disk, **extra}))
    ]
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for model, opt in zip(models, opts):
            model(x).backward()
            opt.step()
            opt.zero_grad()
    with opts[0].gathered_params(), opts[1].gathered_params():
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(a, b)


class _Growing(nn.Module):
    """Layers appended while training goes on (progressive growing): each new one gets a param group of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last, self.grown = nn.Linear(32, 8), nn.Linear(8, 8), nn.ModuleList()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        for block in self.grown:
            h = h + block(h)
        return self.last(h)


def test_stage3_add_param_group_on_a_full_disk_keeps_the_files_before(tmp_path: Path) -> None:
    """Stage 3 with the state on disk (the gradient shards in files too): a module appended while training is given
    to ``add_param_group`` on a disk without room for its gradient files: refused naming the key, and once room is
    made it is added and the run trains bit for bit as without offload (before, the refusal closed the whole tier,
    and the next add, like every step, failed on the run's deleted directory)."""
    runs = {}
    with _tmpfs(tmp_path / "small", "size=1m") as small:
        extra = {"offload_optimizer": {"device": "nvme", "nvme_path": str(small)}, "sub_group_size": 64}
        for name, kwargs in (("plain", {}), ("disk", extra)):
            torch.manual_seed(0)
            model = _Growing().to(torch.bfloat16)
            opt = zo.ShardedFusedAdam(model, lr=1e-2, stage=3, reduce_bucket_size=64,
                                      stage3_param_persistence_threshold=0, **kwargs)  # fmt: skip
            block = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 8)).to(torch.bfloat16)
            for step in range(5):
                if step == 2:
                    model.grown.append(block)
                    if kwargs:
                        (small / "filler").write_bytes(b"\0" * _room(str(small)))
                        with pytest.raises(OSError, match=r"cannot reserve .*\.grads' .*No space left"):
                            opt.add_param_group({"params": list(block.parameters()), "lr": 2e-2})
                        (small / "filler").unlink()
                    opt.add_param_group({"params": list(block.parameters()), "lr": 2e-2})
                x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
                model(x).float().square().mean().backward()
                opt.step()
                opt.zero_grad()
            with opt.gathered_params():
                runs[name] = [p.detach().clone() for p in model.parameters()]
            opt._pipeline.close()
    assert len(runs["plain"]) == len(runs["disk"]) and all(
        torch.equal(a, b) for a, b in zip(runs["plain"], runs["disk"])
    )


class _Wider(nn.Linear):
    """An fp32 layer in a bf16 model (its own buffer at stages 1-2: one per dtype)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).to(x.dtype)


@pytest.mark.parametrize(
    "stage, params, mixed, full_at",
    [(2, None, True, 2), (3, None, False, 1), (3, None, False, 2), (3, "nvme", False, 2), (3, "cpu", False, 2)],
    ids=[
        "stage 2, its second buffer", "stage 3, its first unit", "stage 3, its second unit", "+ parameters on disk",
        "+ parameters in host, half the state",
    ],
)  # fmt: skip
def test_add_param_group_failing_part_way_leaves_the_run_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: int, params: "str | None", mixed: bool, full_at: int
) -> None:
    """The disk fills up while ``add_param_group`` reserves the state files of the group's ``full_at``-th buffer
    (unit at stage 3), after the buffers before it were set up: ``OSError`` naming the key, the path and what is
    full, and every buffer of the group is taken back (its files removed, its parameters whole and unchanged): the
    run trains on bit for bit as the same run that never made the call, and adds the group once room is made.
    Before, the buffers set up before stayed (a later step failed: ``KeyError``, ``IndexError``), and stage 3 left
    the parameters taken apart (``mat2 must be a matrix``)."""
    from zero_kernels.offload.disk import DiskTier as Tier

    add_buffer, calls = Tier.add_buffer, []

    def filling(self: Tier, *args, **kwargs) -> None:
        calls.append(None)
        if len(calls) == full_at:
            (small / "filler").write_bytes(b"\0" * _room(str(small)))
        add_buffer(self, *args, **kwargs)

    runs, blocks = {}, {}
    with _tmpfs(tmp_path / "small", "size=1m") as small:
        disk = {"device": "nvme", "nvme_path": str(small)}
        extra = {"offload_optimizer": disk}
        if params == "nvme":
            extra["offload_param"] = {**disk, "max_in_cpu": 0}
        elif params == "cpu":  # the parameter shards in host memory, half the state on the device
            extra = {"offload_optimizer": {**disk, "ratio": 0.5}, "offload_param": {"device": "cpu"}}
        for name in ("never", "failed"):
            torch.manual_seed(0)
            model = _Growing().to(torch.bfloat16)
            opt = zo.ShardedFusedAdam(model, lr=1e-2, stage=stage, reduce_bucket_size=64, sub_group_size=64,
                                      stage3_param_persistence_threshold=0, **extra)  # fmt: skip
            block = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), (_Wider if mixed else nn.Linear)(64, 8))
            block[0].to(torch.bfloat16)
            block[2].to(torch.float32 if mixed else torch.bfloat16)
            before = [p.detach().clone() for p in block.parameters()]
            for step in range(6):
                if step == 2:
                    model.grown.append(block)  # stage 3 gathers only the model's own parameters
                if step == 2 and name == "failed":
                    files = sorted(p.name for p in small.rglob("*") if p.is_file())
                    monkeypatch.setattr(Tier, "add_buffer", filling)
                    with pytest.raises(OSError, match=rf"nvme_path: cannot reserve .* in '{small}/.*No space left"):
                        opt.add_param_group({"params": list(block.parameters()), "lr": 2e-2})
                    monkeypatch.setattr(Tier, "add_buffer", add_buffer)
                    (small / "filler").unlink()
                    assert len(calls) == full_at and len(opt.param_groups) == 1
                    assert sorted(p.name for p in small.rglob("*") if p.is_file()) == files  # only the new ones went
                    assert all(torch.equal(p, q) for p, q in zip(block.parameters(), before))  # whole, unchanged
                if step == 4:  # room made: added on both
                    opt.add_param_group({"params": list(block.parameters()), "lr": 2e-2})
                x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
                model(x).float().square().mean().backward()
                opt.step()
                opt.zero_grad()
                if step in (3, 5):
                    with opt.gathered_params() if stage == 3 else contextlib.nullcontext():
                        runs[name, step] = [p.detach().clone() for p in model.parameters()]
            blocks[name] = block
            opt._pipeline.close()
    for step in (3, 5):
        assert len(runs["never", step]) == len(runs["failed", step])
        for a, b in zip(runs["never", step], runs["failed", step]):
            assert torch.equal(a, b), step
