"""The optimizer state on disk stays in its files where nothing needs it whole. A checkpoint save reads it one
buffer at a time (at stage 3 one unit's, not the whole shard's) and leaves it there: after the save no buffer's
state stays in host memory, and the next step writes what a step writes, not the whole state again. Leaving stage
3's ``gathered_params()`` reads none of it: the parameters' edits made in the block reach the masters through the
update (or the next read of the state). What a save holds, the state read, and the run after, are those of the same
run without offload, bit for bit, also after edits of the parameters (a parameter the next step leaves alone
included)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import zero_kernels as zk
import zero_kernels.optim as zo
from zero_kernels.checkpoint import sharded
from zero_kernels.checkpoint.format import ShardReader
from zero_kernels.stages import placement

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 40), nn.Tanh(), nn.Linear(40, 8)]
    return nn.Sequential(*layers).to(torch.bfloat16)


def _opt(
    model: nn.Module, stage: int, disk: "Path | None", host_ratio: "float | None" = None, persistence: int = 0
) -> zo.ShardedFusedAdam:
    kw: dict = {"stage3_param_persistence_threshold": persistence}
    if disk is not None:
        disk.mkdir(exist_ok=True)
        kw.update(offload_optimizer={"device": "nvme", "nvme_path": str(disk)}, sub_group_size=512)
    if host_ratio is not None:  # the host tier keeps a part of each buffer's state, the rest stays on the device
        kw["offload_optimizer"] = {"device": "cpu", "ratio": host_ratio}
    return zo.ShardedFusedAdam(model, lr=1e-2, stage=stage, reduce_bucket_size=256, **kw)


def _step(model: nn.Module, opt: zo.ShardedFusedAdam, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    model(torch.randn(4, 32, generator=g).to(torch.bfloat16)).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def _edit(model: nn.Module, opt: zo.ShardedFusedAdam) -> None:
    """In-place writes into the parameters between steps, inside ``gathered_params()`` (stage 3 gives them whole
    there only)."""
    with opt.gathered_params(), torch.no_grad():
        model[2].weight.mul_(1.5)
        model[0].bias.add_(0.25)


def _resident_at_reads(opt: zo.ShardedFusedAdam, monkeypatch: pytest.MonkeyPatch, made: str = "merge") -> list[int]:
    """How many of ``opt``'s buffers hold their state whole in host memory, after each read of one from the tier
    (``made``: after each call of that ``placement`` function, which makes one whole)."""
    counts: list[int] = []
    make = getattr(placement, made)

    def counted(tier, buf) -> None:
        make(tier, buf)
        counts.append(sum(placement.resident(b) for b in opt._pipeline.buffers))

    monkeypatch.setattr(placement, made, counted)
    return counts


def _state(opt: zo.ShardedFusedAdam) -> dict:
    return copy.deepcopy(opt.full_state_dict()["state"])


def _same_state(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for i in a:
        for kind in a[i]:
            assert torch.equal(torch.as_tensor(a[i][kind]), torch.as_tensor(b[i][kind])), (what, i, kind)


def _same_run(plain: nn.Module, tiered: nn.Module, a: zo.ShardedFusedAdam, b: zo.ShardedFusedAdam, what: str) -> None:
    """The run with offload (``tiered``, ``b``) has the state and the weights of the run without, bit for bit."""
    _same_state(_state(b), _state(a), what)
    with a.gathered_params(), b.gathered_params():
        for (name, p), q in zip(plain.named_parameters(), tiered.parameters()):
            assert torch.equal(p, q), name


def _loaded(path: Path, stage: int) -> dict:
    """The state a checkpoint gives a new optimizer without offload."""
    model = _model()
    opt = _opt(model, stage, None)
    zk.checkpoint.load(path, model, opt)
    return _state(opt)


@pytest.mark.parametrize("stage", [2, 3])
def test_save_reads_the_state_in_place_and_leaves_it_in_its_files(
    stage: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, tiered = _model(), _model()
    a, b = _opt(plain, stage, None), _opt(tiered, stage, tmp_path / "nvme")
    buffers, tier = b._pipeline.buffers, b._pipeline.tier
    assert len(buffers) == (3 if stage == 3 else 1)
    for step in range(STEPS):
        _step(plain, a, step)
        _step(tiered, b, step)
    before = dict(tier.traffic())
    _step(plain, a, STEPS)
    _step(tiered, b, STEPS)
    written = tier.traffic()["written"] - before["written"]  # what a step writes
    _edit(plain, a)
    _edit(tiered, b)
    reads = _resident_at_reads(b, monkeypatch)
    zk.checkpoint.save(tmp_path / "plain", plain, a)
    zk.checkpoint.save(tmp_path / "tiered", tiered, b)
    assert len(reads) == len(buffers) and max(reads) == 1  # one buffer's state in host memory at a time
    assert not any(placement.resident(buf) for buf in buffers)  # back where it lives between steps
    _same_state(_loaded(tmp_path / "tiered", stage), _loaded(tmp_path / "plain", stage), "saved")
    before = dict(tier.traffic())
    _step(plain, a, STEPS + 1)
    _step(tiered, b, STEPS + 1)
    assert tier.traffic()["written"] - before["written"] == written  # nothing written back for the save
    _same_run(plain, tiered, a, b, "after the next step")


@pytest.mark.parametrize("stage", [1, 3])
def test_save_gives_the_host_tier_back_its_part_of_a_split_state(stage: int, tmp_path: Path) -> None:
    """The host tier lets its part of a split buffer's state go when the state is read in whole: the save, which
    splits the buffer again after reading it, gives the tier that part back."""
    plain, tiered = _model(), _model()
    a, b = _opt(plain, stage, None), _opt(tiered, stage, None, host_ratio=0.5)
    buffers = b._pipeline.buffers
    for step in range(2):
        _step(plain, a, step)
        _step(tiered, b, step)
    assert any(not placement.resident(buf) for buf in buffers)  # split: part on the device, part in the tier
    _edit(plain, a)
    _edit(tiered, b)
    zk.checkpoint.save(tmp_path / "plain", plain, a)
    zk.checkpoint.save(tmp_path / "tiered", tiered, b)
    _same_state(_loaded(tmp_path / "tiered", stage), _loaded(tmp_path / "plain", stage), "saved")
    _step(plain, a, 2)
    _step(tiered, b, 2)
    _same_run(plain, tiered, a, b, "after the next step")


@pytest.mark.parametrize("stage", [1, 3])
def test_a_master_written_after_a_save_starts_from_the_edits_the_save_took(stage: int, tmp_path: Path) -> None:
    """A save gives the masters the parameters' edits; the state on disk, which it leaves unwritten, owes them to its
    next read: a master written from outside after the save adds to the edited value, as without offload."""
    plain, tiered = _model(), _model()
    a, b = _opt(plain, stage, None), _opt(tiered, stage, tmp_path / "nvme")
    for step in range(2):
        _step(plain, a, step)
        _step(tiered, b, step)
    _edit(plain, a)
    _edit(tiered, b)
    zk.checkpoint.save(tmp_path / "plain", plain, a)
    zk.checkpoint.save(tmp_path / "tiered", tiered, b)
    for model, opt in ((plain, a), (tiered, b)):
        opt.state[model[2].weight]["master"].add_(0.0625)
    assert torch.equal(b.state[tiered[2].weight]["master"], a.state[plain[2].weight]["master"])
    _step(plain, a, 2)
    _step(tiered, b, 2)
    with a.gathered_params(), b.gathered_params():
        for (name, p), q in zip(plain.named_parameters(), tiered.parameters()):
            assert torch.equal(p, q), name


def test_edits_a_save_took_stay_taken_when_the_parameters_go_back(tmp_path: Path) -> None:
    """An edit the save gave the masters stays in them when a later write puts the parameters back to what the
    masters held before: the save writes back a buffer whose masters took edits (a master that took them only at a
    later read would not see them)."""
    plain, tiered = _model(), _model()
    a, b = _opt(plain, 1, None), _opt(tiered, 1, tmp_path / "nvme")
    for step in range(2):
        _step(plain, a, step)
        _step(tiered, b, step)
    for model, opt in ((plain, a), (tiered, b)):
        with torch.no_grad():
            model[2].weight.mul_(2)
        zk.checkpoint.save(tmp_path / str(id(opt)), model, opt)
        with torch.no_grad():
            model[2].weight.mul_(0.5)  # back to the values before the edit, bit for bit
    assert torch.equal(b.state[tiered[2].weight]["master"], a.state[plain[2].weight]["master"])
    _step(plain, a, 2)
    _step(tiered, b, 2)
    _same_state(_state(b), _state(a), "after the next step")


class _Branches(nn.Module):
    """A trunk and two heads; the second is left out of some steps (no gradient: the update leaves it alone)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.head, self.side = nn.Linear(32, 48), nn.Linear(48, 8), nn.Linear(48, 8)

    def forward(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.head(h) + self.side(h) if side else self.head(h)


def test_leaving_gathered_params_reads_no_state_and_the_edits_are_adopted(tmp_path: Path) -> None:
    plain, tiered = _Branches().to(torch.bfloat16), _Branches().to(torch.bfloat16)
    a, b = _opt(plain, 3, None), _opt(tiered, 3, tmp_path / "nvme")
    buffers = b._pipeline.buffers

    def step(side: bool, n: int) -> None:
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
        for model, opt in ((plain, a), (tiered, b)):
            model(x, side).float().square().mean().backward()
            opt.step()
            opt.zero_grad()

    for n in range(2):
        step(True, n)
    for model, opt in ((plain, a), (tiered, b)):
        with opt.gathered_params(), torch.no_grad():
            model.trunk.weight.mul_(1.5)
            model.side.weight.add_(0.25)  # the next step leaves it alone: its master takes it at the read below
    assert not any(placement.resident(buf) for buf in buffers)  # nothing read in for the block
    step(False, 2)
    assert not any(placement.resident(buf) for buf in buffers)
    for (name, p), q in zip(plain.named_parameters(), tiered.parameters()):
        assert torch.equal(a.state[p]["master"], b.state[q]["master"]), name
    _same_state(_state(b), _state(a), "after the step")
    step(True, 3)
    _same_state(_state(b), _state(a), "after the next")


@pytest.mark.parametrize("stage", [2, 3])
def test_load_writes_the_state_into_its_files_one_buffer_at_a_time(
    stage: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _model()
    opt = _opt(source, stage, None)
    for step in range(STEPS):
        _step(source, opt, step)
    zk.checkpoint.save(tmp_path / "ckpt", source, opt)
    plain, tiered = _model(), _model()
    a, b = _opt(plain, stage, None), _opt(tiered, stage, tmp_path / "nvme")
    buffers, tier = b._pipeline.buffers, b._pipeline.tier
    for model, o in ((plain, a), (tiered, b)):
        _step(model, o, 0)  # a state in the files to load over
    before = dict(tier.traffic())
    _step(plain, a, 1)
    _step(tiered, b, 1)
    written = tier.traffic()["written"] - before["written"]  # what a step writes
    reads, blanks = _resident_at_reads(b, monkeypatch), _resident_at_reads(b, monkeypatch, "_blank")
    zk.checkpoint.load(tmp_path / "ckpt", plain, a)
    loaded, read = tier.traffic()["written"], tier.traffic()["read"]
    zk.checkpoint.load(tmp_path / "ckpt", tiered, b)
    assert not reads and tier.traffic()["read"] == read  # nothing read from the files it overwrites
    assert len(blanks) == len(buffers) and max(blanks) == 1  # one buffer's state in host memory at a time
    assert not any(placement.resident(buf) for buf in buffers)  # written back to its files by the load
    assert tier.traffic()["written"] - loaded == sum(buf.layout.shard_numel for buf in buffers) * 12
    before = dict(tier.traffic())
    _step(plain, a, STEPS)
    _step(tiered, b, STEPS)
    assert tier.traffic()["written"] - before["written"] == written  # nothing left for the step to write back
    _same_state(_state(b), _state(a), "after the next step")


def test_a_corrupted_checkpoint_changes_nothing_in_the_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The values a load writes into the files are checked (their blocks' checksums) before anything changes: a
    checksum that fails in the last block (of 4 kB) raises before the first buffer is written."""
    monkeypatch.setattr(sharded, "BLOCK_BYTES", 4096)
    source = _model()
    opt = _opt(source, 3, None)
    _step(source, opt, 0)
    version = zk.checkpoint.save(tmp_path / "ckpt", source, opt)
    (rank_file,) = version.glob("rank*")
    data = bytearray(rank_file.read_bytes())
    assert len(data) > 8 * 4096
    data[-8] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    plain, tiered = _model(), _model()
    a, b = _opt(plain, 3, None), _opt(tiered, 3, tmp_path / "nvme")
    _step(plain, a, 1)
    _step(tiered, b, 1)
    assert not any(placement.resident(buf) for buf in b._pipeline.buffers)  # loaded in place
    with pytest.raises(zk.checkpoint.CheckpointError, match="corrupted"):
        zk.checkpoint.load(tmp_path / "ckpt", tiered, b)
    _same_state(_state(b), _state(a), "after the failed load")  # as the run that did not load


def _saved_and_two_runs(path: Path) -> tuple[nn.Module, nn.Module, zo.ShardedFusedAdam, zo.ShardedFusedAdam]:
    """A stage-3 checkpoint of one step at ``path / "ckpt"``, and two new runs to load it: (plain, tiered, their
    optimizers), the second with its state on disk."""
    source = _model()
    opt = _opt(source, 3, None)
    _step(source, opt, 0)
    zk.checkpoint.save(path / "ckpt", source, opt)
    plain, tiered = _model(), _model()
    return plain, tiered, _opt(plain, 3, None), _opt(tiered, 3, path / "nvme")


def test_a_write_that_fails_in_a_load_leaves_the_state_for_the_next_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    plain, tiered, a, b = _saved_and_two_runs(tmp_path)
    buffers, tier = b._pipeline.buffers, b._pipeline.tier
    spill, failed = type(tier).spill, []

    def failing(self, key, tensors) -> None:
        if not failed:
            failed.append(key)
            raise OSError(5, "Input/output error")
        spill(self, key, tensors)

    monkeypatch.setattr(type(tier), "spill", failing)
    for model, o in ((plain, a), (tiered, b)):
        zk.checkpoint.load(tmp_path / "ckpt", model, o)
    assert [id(buf) for buf in buffers if placement.resident(buf)] == failed  # the loaded values kept
    assert "stays in host memory until the next step: [Errno 5] Input/output error" in caplog.text
    _step(plain, a, 1)
    _step(tiered, b, 1)  # writes it
    assert not any(placement.resident(buf) for buf in buffers)
    _same_state(_state(b), _state(a), "after the next step")


def test_a_read_that_fails_part_way_refuses_steps_until_a_load_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The values a load writes into the files are read again as they are written: a read of the checkpoint's file
    that fails there (an I/O error once it was checked) stops the load after earlier buffers were written. It raises
    naming the file (an ``OSError`` naming none, and the next step went on from a state half loaded), steps, saves
    and state dicts are refused until a load completes, and the load repeated leaves the state a load that never
    failed leaves."""
    plain, tiered, a, b = _saved_and_two_runs(tmp_path)
    _step(plain, a, 1)
    _step(tiered, b, 1)
    zk.checkpoint.load(tmp_path / "ckpt", plain, a)
    apply, pread, applied = sharded.BufferLoad.apply, ShardReader._pread, []

    def counted(self: sharded.BufferLoad) -> None:
        applied.append(self)
        apply(self)

    def failing(self: ShardReader, offset: int, n: int) -> bytes:
        if len(applied) > 1:  # once the first buffer is written
            raise OSError(5, "Input/output error")
        return pread(self, offset, n)

    monkeypatch.setattr(sharded.BufferLoad, "apply", counted)
    monkeypatch.setattr(ShardReader, "_pread", failing)
    with pytest.raises(zk.checkpoint.CheckpointError, match=r"rank00000.bin failed: \[Errno 5\].* stopped part way"):
        zk.checkpoint.load(tmp_path / "ckpt", tiered, b)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match=r"^ShardedFusedAdam.step\(\): the last zk.checkpoint.load stopped part way"):
        _step(tiered, b, 2)
    with pytest.raises(zk.checkpoint.CheckpointError, match="stopped part way.*nothing was written"):
        zk.checkpoint.save(tmp_path / "ckpt", tiered, b)
    for read in (b.state_dict, b.full_state_dict):  # a state dict of it would be saved as whole
        with pytest.raises(RuntimeError, match=r"state_dict\(\): the last zk.checkpoint.load stopped part way"):
            read()
    zk.checkpoint.load(tmp_path / "ckpt", tiered, b)
    _step(plain, a, 2)
    _step(tiered, b, 2)
    _same_run(plain, tiered, a, b, "after the next step")


def test_a_checkpoint_written_to_during_a_load_is_refused_where_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The values read again as they are written are compared with those checked (a block checked once is not
    checked again): a shard file written to in place since the check (every 7th byte flipped) stops the load, where
    it loaded the new bytes without a word (the masters off a clean load's by up to 6e37)."""
    source = _model()
    opt = _opt(source, 3, None)
    _step(source, opt, 0)
    version = zk.checkpoint.save(tmp_path / "ckpt", source, opt)
    (rank_file,) = version.glob("rank*")
    model = _model()
    b = _opt(model, 3, tmp_path / "nvme")
    _step(model, b, 1)
    apply = sharded.BufferLoad.apply

    def written_to_first(self: sharded.BufferLoad) -> None:
        data = bytearray(rank_file.read_bytes())
        data[::7] = bytes(x ^ 0x40 for x in data[::7])
        with open(rank_file, "r+b") as f:  # in place: the file the load holds open
            f.write(data)
        monkeypatch.setattr(sharded.BufferLoad, "apply", apply)
        apply(self)

    monkeypatch.setattr(sharded.BufferLoad, "apply", written_to_first)
    with pytest.raises(zk.checkpoint.CheckpointError, match="changed since the load checked it.*stopped part way"):
        zk.checkpoint.load(tmp_path / "ckpt", model, b)
    with pytest.raises(RuntimeError, match="stopped part way"):
        _step(model, b, 2)


@pytest.mark.parametrize("persistence", [0, 10**6])
def test_edits_of_a_block_stay_taken_when_a_later_block_puts_the_parameters_back(
    persistence: int, tmp_path: Path
) -> None:
    """A block's edits reach the masters as without offload, where they took them as the block ended: a later block
    that puts the parameters back to what the masters held before does not hide them (with every parameter in
    gathered units, and with every one persistent). An empty block reads no state of a gathered unit."""
    plain, tiered = _model(), _model()
    a, b = _opt(plain, 3, None, persistence=persistence), _opt(tiered, 3, tmp_path / "nvme", persistence=persistence)
    buffers = b._pipeline.buffers
    for step in range(2):
        _step(plain, a, step)
        _step(tiered, b, step)
    with b.gathered_params():
        pass
    assert not any(placement.resident(buf) for buf in buffers if not buf.persistent)
    for factor in (2.0, 0.5):  # back to the values before the first block, bit for bit
        for model, opt in ((plain, a), (tiered, b)):
            with opt.gathered_params(), torch.no_grad():
                model[2].weight.mul_(factor)
    assert torch.equal(b.state[tiered[2].weight]["master"], a.state[plain[2].weight]["master"])
    _step(plain, a, 2)
    _step(tiered, b, 2)
    _same_state(_state(b), _state(a), "after the next step")


@pytest.mark.parametrize("disk", [False, True])
def test_a_corrupted_checkpoint_gives_no_amsgrad_maximum(disk: bool, tmp_path: Path) -> None:
    """A run without AMSGrad that fails to load a corrupted checkpoint of a run with it keeps no maximum: the zeros a
    load starts it from come once the checkpoint is checked (in host memory, or new files for a state on disk)."""
    source = _model()
    opt = zo.ShardedFusedAdam(source, lr=1e-2, stage=1, reduce_bucket_size=256, amsgrad=True)
    _step(source, opt, 0)
    version = zk.checkpoint.save(tmp_path / "ckpt", source, opt)
    (rank_file,) = version.glob("rank*")
    data = bytearray(rank_file.read_bytes())
    data[-8] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    model = _model()
    b = _opt(model, 1, tmp_path / "nvme" if disk else None)
    _step(model, b, 1)
    files = b._pipeline.tier.disk_bytes() if disk else 0
    with pytest.raises(zk.checkpoint.CheckpointError, match="corrupted"):
        zk.checkpoint.load(tmp_path / "ckpt", model, b)
    assert all("max_exp_avg_sq" not in s for s in _state(b).values())
    assert (b._pipeline.tier.disk_bytes() if disk else 0) == files
