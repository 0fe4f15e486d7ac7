"""The disk tier's swap buffers (slots) between steps: with ``pipeline_read`` a step's end reads the next step's
first sub-groups, a slot written back keeps its sub-group (where the slots hold every sub-group, nothing is read
again), and whatever writes the files between steps (a state loaded, an edit of ``opt.state``, AMSGrad switched
on) is what the next step reads: the weights and state stay bit for bit those of the same run without offload. A
spill whose write fails leaves no other write running, to land over later ones."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
from torch import nn

import zero_kernels.optim as zo

BUCKET = 256
SUB_GROUP = 512


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 16)).to(torch.bfloat16)


def _pair(
    path: Path, buffers: int, read: bool = True, write: bool = False, sub_group: int = SUB_GROUP
) -> tuple[list, list]:
    """(models, optimizers): the same model twice, one optimizer without offload and one with the state on disk
    (``read``/``write``: ``pipeline_read``/``pipeline_write``; writes at once make the slots used deterministic)."""
    plain = _model()
    tiered = copy.deepcopy(plain)
    offload = {"device": "nvme", "nvme_path": str(path), "buffer_count": buffers,
               "pipeline_read": read, "pipeline_write": write}  # fmt: skip
    kwargs = dict(stage=2, lr=1e-2, reduce_bucket_size=BUCKET)
    a = zo.ShardedFusedAdam(plain, **kwargs)
    b = zo.ShardedFusedAdam(tiered, offload_optimizer=offload, sub_group_size=sub_group, **kwargs)
    return [plain, tiered], [a, b]


def _step(model: nn.Module, opt: zo.ShardedFusedAdam, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(4, 32).to(torch.bfloat16)).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def _same(models: list, opts: list, state: bool = True) -> None:
    """The weights equal; ``state``: the optimizer state too (read through the state door: the disk tier reads it
    all in, and the next step writes it all back)."""
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    if not state:
        return
    ours, theirs = opts[1].full_state_dict()["state"], opts[0].full_state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for i in ours:
        for k in theirs[i]:
            assert torch.equal(ours[i][k], theirs[i][k]), (i, k)


def _files(tier, key: int, g: int, kind: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(tier.path(key, g, kind).read_bytes()), dtype=torch.float32)


def test_a_steps_end_reads_the_next_steps_first_sub_groups(tmp_path: Path) -> None:
    models, opts = _pair(tmp_path, buffers=2)
    tier = opts[1]._pipeline.tier
    (buf,) = opts[1]._pipeline.buffers
    assert len(buf.groups) > 2  # more sub-groups than slots
    for seed in range(3):
        for model, opt in zip(models, opts):
            _step(model, opt, seed)
        held = sorted(s.holds for s in tier.slots)
        assert held == [(id(buf), 0), (id(buf), 1)], held  # read after the step, before the next one's update
        for slot in tier.slots:
            slot.wait_reads()
            key, g = slot.holds
            for kind in slot.kinds:
                numel = tier.groups[key][g]
                assert torch.equal(slot.tensors[kind][:numel], _files(tier, key, g, kind)), (g, kind)
        _same(models, opts)


def test_slots_in_use_stay_within_the_swap_pool(tmp_path: Path) -> None:
    """8 buffers of ``sub_group_size`` 64 elements (DeepSpeed's pool: 512 per state kind) and sub-groups of whole
    256-element buckets: two slots swap them (one updated, the next read ahead), the others are never allocated."""
    models, opts = _pair(tmp_path, buffers=8, sub_group=64)
    tier = opts[1]._pipeline.tier
    (buf,) = opts[1]._pipeline.buffers
    assert len(buf.groups) > 2 and max(numel for *_, numel in buf.groups) == BUCKET
    for seed in range(3):
        for model, opt in zip(models, opts):
            _step(model, opt, seed)
        assert [bool(s.tensors) for s in tier.slots] == [True, True] + [False] * 6
        assert sorted(s.holds[1] for s in tier.slots[:2]) == [0, 1]
    _same(models, opts)


@pytest.mark.parametrize("write", [False, True])
@pytest.mark.parametrize("buffers, sub_group", [(4, 10**9), (8, SUB_GROUP)])
def test_slots_holding_every_sub_group_read_nothing_again(
    tmp_path: Path, write: bool, buffers: int, sub_group: int
) -> None:
    """The sub-groups fit the swap pool (one, with DeepSpeed's default ``sub_group_size`` 1e9 over a small shard;
    or a few, each within ``sub_group_size``): after the first step the slots hold them, and they are written every
    step, never read again."""
    models, opts = _pair(tmp_path, buffers=buffers, write=write, sub_group=sub_group)
    tier = opts[1]._pipeline.tier
    (buf,) = opts[1]._pipeline.buffers
    state_bytes = buf.layout.shard_numel * 4 * 3  # master, exp_avg, exp_avg_sq
    assert len(buf.groups) <= buffers and (len(buf.groups) == 1) == (sub_group == 10**9)
    moved = []
    for seed in range(4):
        before = tier.traffic()
        for model, opt in zip(models, opts):
            _step(model, opt, seed)
        moved.append({k: tier.traffic()[k] - before[k] for k in ("read", "written")})
        _same(models, opts, state=False)
    _same(models, opts)
    assert moved[0] == {"read": state_bytes, "written": state_bytes}, moved
    assert moved[1:] == [{"read": 0, "written": state_bytes}] * 3, moved  # written every step, never read again


def test_without_pipeline_read_each_step_reads_its_state(tmp_path: Path) -> None:
    models, opts = _pair(tmp_path, buffers=8, read=False)
    tier = opts[1]._pipeline.tier
    (buf,) = opts[1]._pipeline.buffers
    for seed in range(2):
        for model, opt in zip(models, opts):
            _step(model, opt, seed)
        assert all(s.holds is None or s.stored for s in tier.slots)
    _same(models, opts)


def _load_other_state(models: list, opts: list) -> None:
    for model, opt in zip(models, opts):
        other_model, other = copy.deepcopy((model, opt))  # together: the copy steps the copied model
        _step(other_model, other, 7)
        saved = other.state_dict()
        assert not torch.equal(saved["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
        opt.load_state_dict(saved)


def _edit_state(models: list, opts: list) -> None:
    for model, opt in zip(models, opts):
        p = next(model.parameters())
        opt.state[p]["exp_avg"].fill_(0.25)
        opt.state[p]["master"].add_(0.5)


def _amsgrad_on(models: list, opts: list) -> None:
    for opt in opts:
        opt.param_groups[0]["amsgrad"] = True


def _set_weights(models: list, opts: list) -> None:
    for model in models:
        with torch.no_grad():
            next(model.parameters()).mul_(0.5)


@pytest.mark.parametrize("buffers", [2, 8])
@pytest.mark.parametrize("change", [_load_other_state, _edit_state, _amsgrad_on, _set_weights])
def test_what_changes_between_steps_is_what_the_next_step_reads(change: Callable, buffers: int, tmp_path: Path) -> None:
    models, opts = _pair(tmp_path, buffers=buffers)
    tier = opts[1]._pipeline.tier
    for seed in range(2):
        for model, opt in zip(models, opts):
            _step(model, opt, seed)
    assert any(s.holds is not None for s in tier.slots)
    change(models, opts)
    for seed in range(2, 4):
        for model, opt in zip(models, opts):
            _step(model, opt, seed)
        _same(models, opts)


@pytest.mark.parametrize("buffers", [1, 2])
@pytest.mark.parametrize("read", [False, True])
@pytest.mark.parametrize("stop", [2, 4])
def test_a_step_cut_short_leaves_the_state_partly_updated_as_without_offload(
    stop: int, read: bool, buffers: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception from the update's ``stop``-th launch (sub-groups of 2 buckets: one updated in its slot, not
    stored; the fourth: in the second sub-group, whose slot the next step's first load must store, not take over),
    then, as a loop catching it would, ``zero_grad()``, a state read (``read``: a checkpoint there) and more steps:
    the weights and state stay those of the same run without offload (a state read there lost that slot's update:
    it read the files, and the next step dropped the slot)."""
    import zero_kernels.stages.offloaded as offloaded
    import zero_kernels.stages.update as update

    models, opts = _pair(tmp_path, buffers=buffers, write=True)
    assert opts[1]._pipeline.buffers[0].groups[0][1] == 2  # the first sub-group holds 2 buckets
    for seed in range(2):
        for model, opt in zip(models, opts):
            _step(model, opt, seed)
    for model, opt in zip(models, opts):
        calls = []

        def cut(real: Callable) -> Callable:
            def launch(*args, **kwargs):
                calls.append(1)
                if len(calls) == stop:
                    raise KeyboardInterrupt("in the update")
                return real(*args, **kwargs)

            return launch

        with monkeypatch.context() as patched:
            patched.setattr(update, "launch", cut(update.launch))
            patched.setattr(offloaded, "launch", cut(offloaded.launch))
            with pytest.raises(KeyboardInterrupt):
                _step(model, opt, 2)
        opt.zero_grad()
        if read:
            opt.state_dict()
    for seed in range(3, 6):
        for model, opt in zip(models, opts):
            _step(model, opt, seed)
        _same(models, opts, state=False)
    _same(models, opts)


def _stopping_at(launched: list[int], stop: list[Optional[int]]) -> Callable[[Callable], Callable]:
    """Wraps a kernel launch: counts the launches in ``launched[0]``, and raises ``KeyboardInterrupt`` at launch
    ``stop[0]`` (None: never)."""

    def counted(real: Callable) -> Callable:
        def launch(*args, **kwargs):
            if stop[0] is not None and launched[0] == stop[0]:
                raise KeyboardInterrupt("before the same launch")
            launched[0] += 1
            return real(*args, **kwargs)

        return launch

    return counted


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_a_read_cut_short_leaves_no_slot_claiming_its_sub_group(
    nth: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt inside the ``nth`` read submission of a step (the tier's own read or one ahead), the run without
    offload interrupted before the same kernel launch, then more steps: the same weights and state (the slot
    claimed the sub-group before its reads were submitted, and the next step trained on its old bytes)."""
    import zero_kernels.stages.offloaded as offloaded
    import zero_kernels.stages.update as update
    from zero_kernels.offload.aio import FileIO

    models, opts = _pair(tmp_path, buffers=2)
    for seed in range(2):
        for model, opt in zip(models, opts):
            _step(model, opt, seed)
    launched, reads, stop = [0], [0], [None]

    counted = _stopping_at(launched, stop)
    real_read = FileIO.read

    def read(self, *args, **kwargs):
        reads[0] += 1
        if reads[0] == nth:
            raise KeyboardInterrupt("in a read")
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(update, "launch", counted(update.launch))
    monkeypatch.setattr(offloaded, "launch", counted(offloaded.launch))
    with monkeypatch.context() as patched:
        patched.setattr(FileIO, "read", read)
        with pytest.raises(KeyboardInterrupt):
            _step(models[1], opts[1], 2)
    opts[1].zero_grad()
    stop[0], launched[0] = launched[0], 0
    with pytest.raises(KeyboardInterrupt):
        _step(models[0], opts[0], 2)
    opts[0].zero_grad()
    stop[0] = None
    for seed in range(3, 6):
        for model, opt in zip(models, opts):
            _step(model, opt, seed)
        _same(models, opts, state=False)
    _same(models, opts)


@pytest.mark.parametrize("io", ["write", "read"])
@pytest.mark.parametrize("write", [False, True])
def test_a_failed_io_is_raised_once_and_training_goes_on_once_the_disk_is_back(
    io: str, write: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One state write (or read) fails in a step (the disk refused it: EIO), then works again: the step raises that
    error naming the file, and the state can be read and training goes on, bit for bit as the same run without
    offload cut short before the same launch (the slot keeps the sub-group's new values and writes them again, or
    reads the sub-group again). Before, the failed request stayed in its slot and every later step, state read or
    checkpoint raised the same error again, the disk working or not."""
    import errno

    import zero_kernels.stages.offloaded as offloaded
    import zero_kernels.stages.update as update
    from zero_kernels.offload.aio import FileIO, IOHandle

    models, opts = _pair(tmp_path, buffers=1 if io == "read" else 2, read=io != "read", write=write)
    for seed in range(2):
        for model, opt in zip(models, opts):
            _step(model, opt, seed)
    launched, stop, failed = [0], [None], []

    counted = _stopping_at(launched, stop)
    real_io = getattr(FileIO, io)

    def failing(self, path, tensor, offset=0):
        if not failed and launched[0] >= 1:  # the step's first sub-group is updated: fail its next request
            failed.append(path)
            return IOHandle(str(path), tensor, lambda: (errno.EIO, f"{io} of bytes 0..{tensor.nbytes}"), lambda: True)
        return real_io(self, path, tensor, offset)

    monkeypatch.setattr(update, "launch", counted(update.launch))
    monkeypatch.setattr(offloaded, "launch", counted(offloaded.launch))
    with monkeypatch.context() as patched:
        patched.setattr(FileIO, io, failing)
        with pytest.raises(OSError, match="Input/output error") as caught:
            _step(models[1], opts[1], 2)
    assert failed and str(caught.value.filename) == str(failed[0])
    opts[1].zero_grad()
    stop[0], launched[0] = launched[0], 0
    with pytest.raises(KeyboardInterrupt):
        _step(models[0], opts[0], 2)
    opts[0].zero_grad()
    stop[0] = None
    _same(models, opts)  # the state reads (the disk is back)
    for seed in range(3, 6):
        for model, opt in zip(models, opts):
            _step(model, opt, seed)
        _same(models, opts, state=False)
    _same(models, opts)


class _Late:
    """A write that runs only when waited for: as late as the engine's workers may finish it."""

    def __init__(self, start: Callable) -> None:
        self._start, self._handle = start, None

    def wait(self) -> None:
        if self._handle is None:
            self._handle = self._start()
        self._handle.wait()

    def done(self) -> bool:
        return self._handle is not None and self._handle.done()


def test_a_failed_spill_leaves_no_write_to_land_over_the_next_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A buffer's state spilled into its files (the step after a state read): one sub-group's write fails (EIO)
    while the other's still runs. ``spill`` raises once every write is done; a write left running could land after
    the retried spill and the step's update of that sub-group, putting the old values back in its file."""
    import errno

    from tests.offload.test_disk_tier import _tier
    from zero_kernels.offload.aio import FileIO, IOHandle

    tier = _tier(tmp_path)
    tier.add_buffer(1, [8, 8], ("exp_avg",))
    old, new = torch.arange(16.0), torch.full((8,), -1.0)
    late: list[_Late] = []
    real = FileIO.write

    def write(self, path, tensor, offset=0):
        if ".g0." in str(path):
            return IOHandle(str(path), tensor, lambda: (errno.EIO, "writing"), lambda: True)
        late.append(_Late(lambda: real(self, path, tensor, offset)))
        return late[-1]

    with monkeypatch.context() as patched:
        patched.setattr(FileIO, "write", write)
        with pytest.raises(OSError, match="Input/output error"):
            tier.spill(1, {"exp_avg": old.clone()})
    tier.spill(1, {"exp_avg": old.clone()})  # the disk is back: the next step spills again
    tier.load(1, 1, ("exp_avg",))["exp_avg"].copy_(new)
    tier.store(1, 1)
    tier.finish()
    late[0].wait()  # the engine finishes what it was given
    out = torch.empty(16)
    tier.fill(1, {"exp_avg": out})
    assert torch.equal(out, torch.cat([old[:8], new])), out
    tier.close()


def test_an_update_whose_writes_failed_twice_is_written_once_the_disk_is_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One slot; a step's update of sub-group 1 fails to be written (EIO: the step raises, the slot keeps the new
    values), and so does the next step, whose first load writes them first. The step after, the disk back, writes
    them before its first load reads into that slot: the update is kept, not dropped for the read (the load was
    taken for a bucket of the sub-group loaded last, which writes nothing first)."""
    import errno

    from zero_kernels.config.offload import AioConfig, OffloadOptimizerConfig
    from zero_kernels.offload import DiskTier
    from zero_kernels.offload.aio import FileIO, IOHandle

    config = OffloadOptimizerConfig(device="nvme", nvme_path=str(tmp_path), buffer_count=1)
    tier = DiskTier(config, AioConfig(), rank=0, sub_group_size=8)
    tier.add_buffer(1, [8, 8], ("exp_avg",))
    real = FileIO.write

    def failing(self, path, tensor, offset=0):
        if ".g1." in str(path):
            return IOHandle(str(path), tensor, lambda: (errno.EIO, "writing"), lambda: True)
        return real(self, path, tensor, offset)

    def update(g: int, value: float) -> None:
        tier.load(1, g, ("exp_avg",))["exp_avg"].fill_(value)
        tier.store(1, g)

    update(0, 1.0)
    update(1, 1.0)
    tier.finish()
    with monkeypatch.context() as patched:
        patched.setattr(FileIO, "write", failing)
        update(0, 2.0)
        with pytest.raises(OSError, match="Input/output error"):
            update(1, 2.0)
        with pytest.raises(OSError, match="Input/output error"):
            update(0, 3.0)  # writes sub-group 1 first, which fails again
    for g in range(2):
        assert torch.equal(tier.load(1, g, ("exp_avg",))["exp_avg"], torch.full((8,), 2.0)), g
        tier.store(1, g)
    tier.finish()
    out = torch.empty(16)
    tier.fill(1, {"exp_avg": out})
    assert torch.equal(out, torch.full((16,), 2.0)), out
    tier.close()
