"""Stage 3's parameter shards in files (``offload_param`` on nvme): what ``memory_report`` shows next to the shards
in host memory, and a missing or unwritable ``nvme_path``, a shard larger than ``buffer_size`` and ZeRO++'s weight
gathers refused with the key named before anything changes. (Exactness, checkpoints and a missing or unwritable
``nvme_path`` on 2 ranks: ``test_offload_exact``.)"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

import pytest
import torch
from torch import nn

import zero_kernels as zk
import zero_kernels.optim as zo
from tests.helpers.resident import resident_pages
from tests.offload.test_disk_tier import _Growing, _tmpfs
from zero_kernels.config.offload import AioConfig, OffloadParamConfig
from zero_kernels.offload.param_files import ParamFiles
from zero_kernels.stages.stage3.disk_params import DiskParams

KWARGS = dict(lr=1e-2, stage=3, reduce_bucket_size=512, stage3_param_persistence_threshold=0)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8)).to(torch.bfloat16)


def _train(
    model: nn.Module, opt: zo.ShardedFusedAdam, steps: int, width: int = 32, dtype: torch.dtype = torch.bfloat16
) -> None:
    for step in range(steps):
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(step)).to(dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


def _same_weights(model: nn.Module, opt: zo.ShardedFusedAdam, twin: nn.Module, other: zo.ShardedFusedAdam) -> None:
    """The two models' parameters equal bit for bit, each gathered whole by its optimizer."""
    with opt.gathered_params(), other.gathered_params():
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p, q), (name, (p - q).abs().max())


def _weights(model: nn.Module, opt: zo.ShardedFusedAdam) -> dict[str, torch.Tensor]:
    """The model's parameters, gathered whole by its optimizer."""
    with opt.gathered_params():
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def _files(path: Path, **extra) -> dict:
    return {"device": "nvme", "nvme_path": str(path), "buffer_count": 2, "max_in_cpu": 0, **extra}


def _in_files_and_in_memory(
    path: Path, steps: int
) -> tuple[nn.Module, zo.ShardedFusedAdam, nn.Module, zo.ShardedFusedAdam]:
    """(model, opt, twin, host): the same model with its shards in files and, ``twin``, in host memory (the state in
    host memory for both), each trained ``steps`` steps."""
    model = _model()
    twin = copy.deepcopy(model)
    opt = zo.ShardedFusedAdam(model, offload_optimizer="cpu", offload_param=_files(path), **KWARGS)
    host = zo.ShardedFusedAdam(twin, offload_optimizer="cpu", offload_param="cpu", **KWARGS)
    _train(model, opt, steps)
    _train(twin, host, steps)
    return model, opt, twin, host


def test_memory_report_counts_the_files_under_disk_and_only_the_pool_in_memory(tmp_path: Path) -> None:
    model, opt, twin, host = _in_files_and_in_memory(tmp_path, 2)
    pipeline = opt._pipeline
    units = list(pipeline.disk_params.units.values())
    assert len(units) == len(pipeline.buffers) == 2  # one unit per Linear: every shard in a file
    assert all(buf.param_shard.device.type == "meta" for buf in units)
    shard_bytes = sum(buf.layout.shard_numel * 2 for buf in units)
    files = sorted(tmp_path.glob("zero_kernels/*/rank0/u*.params"))
    assert len(files) == 2 and sum(f.stat().st_size for f in files) == shard_bytes
    pool = sum(t.untyped_storage().nbytes() for t in pipeline.disk_params.files.pool())
    assert 0 < pool <= 2 * (max(buf.layout.shard_numel for buf in units) * 2 + 2 * 4096)  # 2 buffers, page aligned
    report, before = opt.memory_report(), host.memory_report()
    # ``offload_param`` cpu keeps each shard where it is on a CPU-only machine (host memory already), under params
    assert report["params"] == before["params"] - shard_bytes == 0  # nothing of the shards under params
    assert report["host"] == before["host"] + pool  # the pool, and no host copy either way
    assert report["disk"] == before["disk"] + shard_bytes == shard_bytes
    _same_weights(model, opt, twin, host)
    assert not pipeline.disk_params.resident_shards()  # the block changed nothing: its end let the shards go
    assert opt.memory_report() == report
    with opt.gathered_params(), torch.no_grad():
        model[0].bias.add_(1.0)  # an edit: its unit's shard stays read in (host memory) until the next step
    assert len(pipeline.disk_params.resident_shards()) == 1
    read_back = sum(t.untyped_storage().nbytes() for t in pipeline.disk_params.resident_shards())
    after = opt.memory_report()
    assert after["params"] == 0 and after["host"] == report["host"] + read_back  # counted where they are


def test_a_copy_s_shards_read_in_whole_count_once_under_host(tmp_path: Path) -> None:
    """A pickled copy of an optimizer whose shards are in files (``offload_param`` nvme, the state on the device)
    holds them read in whole until its first step: ``memory_report`` counts them once, under ``host`` (they were
    under ``params`` too), and after that step they are in files again."""
    import io

    model = _model()
    opt = zo.ShardedFusedAdam(model, offload_param=_files(tmp_path), **KWARGS)
    _train(model, opt, 1)
    out = io.BytesIO()
    torch.save(opt, out)
    out.seek(0)
    copied = torch.load(out, weights_only=False)
    shards = sum(t.untyped_storage().nbytes() for t in copied._pipeline.disk_params.resident_shards())
    report = copied.memory_report()
    assert shards > 0 and report["params"] == 0 and report["host"] >= shards, report
    _train(copied._pipeline.module, copied, 1)
    assert copied.memory_report()["params"] == 0 and not copied._pipeline.disk_params.resident_shards()


def test_pool_buffers_keep_no_memory_once_given_back(tmp_path: Path) -> None:
    """At one rank a unit's gathers are over as soon as they start: its pool buffer goes back then, not at the unit's
    use, and a buffer given back returns its pages, so no pool buffer is resident when a module runs (forward and
    backward) nor between steps; training is exact all the same."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(3)]).to(torch.bfloat16)  # 32 pages of shard each
    twin = copy.deepcopy(model)
    opt = zo.ShardedFusedAdam(model, offload_optimizer="cpu", offload_param=_files(tmp_path), **KWARGS)
    plain = zo.ShardedFusedAdam(twin, **KWARGS)
    files = opt._pipeline.disk_params.files
    resident = []

    def count(*_) -> None:
        resident.append(sum(resident_pages(t) for t in files.pool()))

    for k, layer in enumerate(model):
        layer.register_forward_pre_hook(count)
        if k > 0:  # the first layer's input asks for no gradient
            layer.register_full_backward_pre_hook(count)
    _train(model, opt, 2, width=256)
    _train(twin, plain, 2, width=256)
    assert len(files.pool()) == 2 and resident == [0] * 10
    assert sum(resident_pages(t) for t in files.pool()) == 0
    _same_weights(model, opt, twin, plain)


@pytest.mark.parametrize(
    "extra, says",
    [
        ({"offload_param": {"buffer_size": 100}}, "offload_param.buffer_size=100 is smaller than"),
        ({"zero_quantized_weights": True}, "does not combine with zero_optimization.zero_quantized_weights"),
    ],
)
def test_what_cannot_run_is_refused_before_anything_changes(extra: dict, says: str, tmp_path: Path) -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = _files(tmp_path, **extra.get("offload_param", {}))
    options = {k: v for k, v in extra.items() if k != "offload_param"}
    with pytest.raises(ValueError, match=says):
        zo.ShardedFusedAdam(model, offload_optimizer="cpu", offload_param=params, **options, **KWARGS)
    for name, value in model.state_dict().items():
        assert value.shape == before[name].shape and torch.equal(value, before[name]), name
    assert not list(tmp_path.glob("zero_kernels/*/rank0/u*"))  # no file left


def test_values_given_between_steps_reach_the_files(tmp_path: Path) -> None:
    """A model state loaded and an edit made inside ``gathered_params()``, and a value assigned to a freed
    parameter between steps, train on exactly as without offload (the shards in files are read in to take them)."""
    model = _model()
    twin = copy.deepcopy(model)
    opt = zo.ShardedFusedAdam(model, offload_optimizer="cpu", offload_param=_files(tmp_path), **KWARGS)
    plain = zo.ShardedFusedAdam(twin, **KWARGS)
    with plain.gathered_params():
        loaded = {k: v * 0.5 for k, v in twin.state_dict().items()}
    for step in range(4):
        for m, o in ((model, opt), (twin, plain)):
            _train(m, o, 1)
            if step == 0:
                with o.gathered_params():
                    m.load_state_dict(loaded)
            if step == 1:
                with o.gathered_params():
                    m[0].weight.data.mul_(2)
            if step == 2:
                m[2].weight.data = torch.full((8, 32), 0.125, dtype=torch.bfloat16)
    assert all(buf.param_shard.device.type == "meta" for buf in opt._pipeline.disk_params.units.values())
    _same_weights(model, opt, twin, plain)
    ours, theirs = opt.full_state_dict()["state"], plain.full_state_dict()["state"]
    assert all(torch.equal(ours[i][k], theirs[i][k]) for i in theirs for k in theirs[i])


def test_a_disk_without_room_for_the_shards_is_refused_before_anything_changes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 8)).to(torch.bfloat16)  # 131 KB of shards
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with _tmpfs(tmp_path / "small", "size=64k") as small:
        with pytest.raises(OSError, match=r"offload_param could not start: .*offload_param.nvme_path: cannot reserve"):
            zo.ShardedFusedAdam(model, offload_optimizer="cpu", offload_param=_files(small), **KWARGS)
        assert not list(small.glob("zero_kernels/*/rank0/u*"))  # the files reserved are removed
    for name, value in model.state_dict().items():
        assert value.shape == before[name].shape and torch.equal(value, before[name]), name


def test_the_update_reads_a_shard_only_where_it_does_not_overwrite_it(tmp_path: Path) -> None:
    """A shard still in its file holds no edit (only a resident one can be edited), so the update reads it only
    where it keeps some elements as they are: a unit without gradients, a skipped step. Exact all the same."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32)).to(torch.bfloat16)
    twin = copy.deepcopy(model)
    opt = zo.ShardedFusedAdam(model, offload_optimizer="cpu", offload_param=_files(tmp_path), **KWARGS)
    plain = zo.ShardedFusedAdam(twin, **KWARGS)
    files = opt._pipeline.disk_params.files
    read = []
    for step, kind in enumerate(["all", "first without gradient", "not finite", "all"]):
        for m, o in ((model, opt), (twin, plain)):
            x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
            with torch.set_grad_enabled(kind != "first without gradient"):
                h = m[1](m[0](x))
            loss = m[2](h).float().square().mean() * (float("inf") if kind == "not finite" else 1.0)
            loss.backward()
            before = files.traffic()["read"]
            o.step()
            o.zero_grad()
            if o is opt:
                read.append(files.traffic()["read"] - before)
    unit = opt._pipeline.buffers[0].layout.shard_numel * 2
    assert [buf.layout.shard_numel * 2 for buf in opt._pipeline.buffers] == [unit, unit]
    assert read == [0, unit, 2 * unit, 0], read
    assert opt.skipped_steps == plain.skipped_steps == 1
    _same_weights(model, opt, twin, plain)


def test_a_shard_is_read_one_module_before_its_gather(tmp_path: Path) -> None:
    """With prefetch, the read of a file unit's shard starts in the hook of the module before the one that starts
    its gather (the gather then finds it read: it ran beside that module's compute), forward and backward; the
    gathers themselves start where they did (no collective moves). Exact all the same."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]).to(torch.bfloat16)
    twin = copy.deepcopy(model)
    kwargs = dict(KWARGS, stage3_prefetch_bucket_size=1)  # the next unit only
    opt = zo.ShardedFusedAdam(model, offload_optimizer="cpu", offload_param=_files(tmp_path, buffer_count=4), **kwargs)
    plain = zo.ShardedFusedAdam(twin, **kwargs)
    disk, scheduler = opt._pipeline.disk_params, opt._pipeline._scheduler
    clock = [0]  # modules whose units were asked for so far, forward and backward
    gather = scheduler._gather

    def ticking(*args) -> None:
        clock[0] += 1
        gather(*args)

    scheduler._gather = ticking
    read_at: dict[int, int] = {}
    late: list[tuple[int, int]] = []
    read_ahead, source = disk.read_ahead, disk.source

    def reading(buf) -> None:
        read_ahead(buf)
        if id(buf) in disk._ahead:
            read_at.setdefault(id(buf), clock[0])

    def gathering(buf, release):
        if read_at.pop(id(buf), clock[0]) >= clock[0]:
            late.append((clock[0], [id(b) for b in opt._pipeline.buffers].index(id(buf))))
        return source(buf, release)

    disk.read_ahead, disk.source = reading, gathering
    _train(model, opt, 1, width=64)  # the first passes record the order the next ones prefetch along
    clock[0], late[:] = 100, []
    _train(model, opt, 2, width=64)
    _train(twin, plain, 1, width=64)
    _train(twin, plain, 2, width=64)
    # per pass (2 forwards, 2 backwards) only the first unit and the one prefetched with it wait for their reads
    assert sorted(unit for _, unit in late) == [0, 0, 1, 1, 4, 4, 5, 5], late
    _same_weights(model, opt, twin, plain)


def test_a_gathers_pool_buffer_waits_for_its_copy_up_only_when_handed_out_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA (faked here) a unit's gathers done give the pool buffer back with an event on the current stream,
    which ordered after the copy up of the shard: the host waits for that event when the buffer is taken again,
    never for the whole stream at every gather."""
    log: list[str] = []

    class Stream:
        def synchronize(self) -> None:
            log.append("stream synchronized")

    class Event:
        def record(self, stream: Stream) -> None:
            log.append("event recorded")

        def synchronize(self) -> None:
            log.append("event waited")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    config = OffloadParamConfig(device="nvme", nvme_path=str(tmp_path), buffer_count=1, buffer_size=1000)
    files = ParamFiles(config, AioConfig(), rank=0)
    disk = DiskParams(files, max_in_cpu=0)
    files.add(1, 100, torch.bfloat16, "unit 1")
    on_gpu, on_cpu = SimpleNamespace(device=torch.device("cuda", 0)), SimpleNamespace(device=torch.device("cpu"))
    try:
        for buf, expected in ((on_gpu, ["event recorded", "event waited"]), (on_cpu, [])):
            lease = files.take(100, torch.bfloat16, lambda: None)
            disk._gathering[id(buf)] = lease
            disk.done(buf)
            assert log == expected[:1]
            again = files.take(100, torch.bfloat16, lambda: None)
            assert again.raw is lease.raw and log == expected
            files.put(again)
            log.clear()
    finally:
        files.close()


def test_a_lease_given_back_twice_is_one_free_buffer(tmp_path: Path) -> None:
    """A lease put back a second time (its holder released it already) adds nothing to the pool's free buffers:
    else two later takes got the same buffer, each writing over the other's shard."""
    config = OffloadParamConfig(device="nvme", nvme_path=str(tmp_path), buffer_count=2, buffer_size=1000)
    files = ParamFiles(config, AioConfig(), rank=0)
    files.add(1, 100, torch.bfloat16, "unit 1")
    try:
        lease = files.take(100, torch.bfloat16, lambda: None)
        files.put(lease)
        files.put(lease)
        first = files.take(100, torch.bfloat16, lambda: None)
        second = files.take(100, torch.bfloat16, lambda: None)
        assert first.raw is not second.raw
        assert len(files.pool()) == 2
    finally:
        files.close()


def _pool(path: Path, buffers: int) -> ParamFiles:
    config = OffloadParamConfig(device="nvme", nvme_path=str(path), buffer_count=buffers, buffer_size=1000)
    return ParamFiles(config, AioConfig(), rank=0)


class _Unit:
    """What ``DiskParams`` reads of a stage-3 unit: one bucket over its whole shard, in host memory."""

    def __init__(self, numel: int) -> None:
        self.layout = SimpleNamespace(shard_numel=numel, buckets=[SimpleNamespace(index=0, shard_numel=numel,
                                                                                  shard_offset=0)])  # fmt: skip
        self.dtype, self.device, self.param_shard = torch.bfloat16, torch.device("cpu"), None


def test_a_shards_file_holds_its_bytes_from_when_it_is_added(tmp_path: Path) -> None:
    """Each shard's file is reserved at its size in bytes (elements times the dtype's size) before anything is
    written: a disk without room fails then, not in the middle of a step."""
    files = _pool(tmp_path, 1)
    try:
        files.add(1, 100, torch.bfloat16, "unit 1")
        files.add(2, 10, torch.float32, "unit 2")
        assert files.disk_bytes() == 100 * 2 + 10 * 4
    finally:
        files.close()


def test_a_shard_of_buffer_size_elements_fits_one_larger_is_refused(tmp_path: Path) -> None:
    """``buffer_size`` is the largest shard a pool buffer holds: a shard of that many elements is added, one more
    element is refused naming the key."""
    files = _pool(tmp_path, 1)
    try:
        files.add(1, 1000, torch.bfloat16, "unit 1")
        with pytest.raises(ValueError, match="buffer_size=1000 is smaller"):
            files.add(2, 1001, torch.bfloat16, "unit 2")
    finally:
        files.close()


def test_a_full_pool_asks_its_oldest_holder_for_a_buffer(tmp_path: Path) -> None:
    """Every buffer held: a take calls the release of the holder that took its buffer first (a buffer taken last is
    the one its holder is about to use)."""
    files = _pool(tmp_path, 2)
    files.add(1, 100, torch.bfloat16, "unit 1")
    leases, released = {}, []

    def release(name: str) -> Callable[[], None]:
        return lambda: (released.append(name), files.put(leases[name]))

    try:
        for name in ("first", "second"):
            leases[name] = files.take(100, torch.bfloat16, release(name))
        third = files.take(100, torch.bfloat16, lambda: None)
        assert released == ["first"] and third.raw is leases["first"].raw
    finally:
        files.close()


def test_units_from_the_first_that_does_not_fit_in_max_in_cpu_go_to_files(tmp_path: Path) -> None:
    """In order, units whose shards fit in what is left of ``max_in_cpu`` stay in host memory (one that fills it
    exactly too); from the first that does not fit, every unit goes to a file, a smaller one after it too."""
    for sizes, room, in_files in (([4, 6], 4, [6]), ([4, 6, 1], 5, [6, 1])):
        files = _pool(tmp_path, 1)
        try:
            chosen = DiskParams(files, max_in_cpu=room).choose([_Unit(n) for n in sizes], lambda unit: "unit")
            assert [unit.layout.shard_numel for unit in chosen] == in_files, (sizes, room)
        finally:
            files.close()


def test_a_read_ahead_left_at_the_step_gives_way_to_what_the_step_wrote(tmp_path: Path) -> None:
    """A unit's shard read ahead for a gather that had not come when the step updated the shard: the step's end
    drops that read, and the next gather sends the values the step wrote."""
    files = _pool(tmp_path, 2)
    disk = DiskParams(files, max_in_cpu=0)
    unit = _Unit(100)
    (bucket,) = unit.layout.buckets
    try:
        disk.choose([unit], lambda unit: "unit")
        disk.place(unit, torch.full((100,), 1.0, dtype=torch.bfloat16))
        disk.read_ahead(unit)
        params = disk.step_params(unit, bucket)
        params.fill_(2.0)
        disk.stepped(unit, bucket, params, whole=True)
        disk.finish_step()
        assert torch.equal(disk.source(unit, lambda: None), torch.full((100,), 2.0, dtype=torch.bfloat16))
        disk.done(unit)
    finally:
        files.close()


def test_a_param_group_added_while_training_with_everything_on_disk_trains_as_without_offload(tmp_path: Path) -> None:
    """The state, the gradient shards and the parameter shards in files: the new group's shards, larger than any
    before, get larger pool buffers in place of the old ones, and the weights stay bit for bit those of the run
    without offload."""
    runs = {}
    for name, extra in (("plain", {}), ("disk", {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
                                               "offload_param": _files(tmp_path), "sub_group_size": 128})):  # fmt: skip
        torch.manual_seed(0)
        model = _Growing().to(torch.bfloat16)
        opt = zo.ShardedFusedAdam(model, **{**KWARGS, "reduce_bucket_size": 128}, **extra)
        for step in range(4):
            if step == 2:
                model.grown.append(nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 8)).to(torch.bfloat16))
                opt.add_param_group({"params": list(model.grown[0].parameters()), "lr": 2e-2})
            x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        with opt.gathered_params():
            runs[name] = [p.detach().clone() for p in model.parameters()]
        opt._pipeline.close()
    assert all(torch.equal(a, b) for a, b in zip(runs["plain"], runs["disk"]))


def _older_state_ranks(rank: int, world: int, scratch: str) -> None:
    """Each rank: this rank's ``state_dict()``, one more step, that state loaded back and one more step, with the
    parameter shards in files and the state in host memory or in files: the weights and state are bit for bit those
    of the same run without offload, where the loaded master, older than the weights, gives way to them."""
    runs = {}
    root = Path(scratch) / f"rank{rank}"
    root.mkdir()
    tiers = {
        "plain": {},
        "cpu": {"offload_optimizer": "cpu", "offload_param": _files(root)},
        "nvme": {"offload_optimizer": {"device": "nvme", "nvme_path": str(root)}, "offload_param": _files(root)},
    }
    for name, extra in tiers.items():
        model = _model()
        opt = zo.ShardedFusedAdam(model, **KWARGS, **extra)
        _train(model, opt, 3)
        older = copy.deepcopy(opt.state_dict())
        _train(model, opt, 1)
        opt.load_state_dict(older)
        _train(model, opt, 1)  # nothing reads the state or the weights between the load and this step
        with opt.gathered_params():
            runs[name] = [p.detach().clone() for p in model.parameters()], opt.full_state_dict()["state"]
        opt._pipeline.close()
    for name in ("cpu", "nvme"):
        assert all(torch.equal(a, b) for a, b in zip(runs["plain"][0], runs[name][0])), f"{name}: the weights differ"
        for i, entry in runs["plain"][1].items():
            for kind, value in entry.items():
                assert torch.equal(value, runs[name][1][i][kind]), f"{name}: state {i} {kind} differs"


@pytest.mark.distributed
def test_an_older_state_loaded_gives_way_to_the_weights_in_files(tmp_path: Path) -> None:
    from tests.helpers.dist import run_ranks

    run_ranks(_older_state_ranks, 2, str(tmp_path))


def test_memory_report_counts_nothing_for_the_stand_ins_of_shards_in_files(tmp_path: Path) -> None:
    """With ``offload_param`` on nvme a unit's ``param_shard`` is a ``meta`` stand-in of the shard's size: it holds no
    memory. Inside ``gathered_params()`` (no freed parameter left, whose empty storage hid it) ``memory_report``
    counted one stand-in's bytes under ``params`` as if the shard were there too; it counts only the gathered
    parameters."""
    model = _model()
    opt = zo.ShardedFusedAdam(model, offload_param=_files(tmp_path), **KWARGS)
    _train(model, opt, 1)
    pipeline = opt._pipeline
    assert all(buf.param_shard.device.type == "meta" for buf in pipeline.disk_params.units.values())
    with opt.gathered_params():
        gathered = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
        assert opt.memory_report()["params"] == sum(gathered.values())


@pytest.mark.parametrize("buffers", [1, 3])
def test_a_step_cut_short_gives_its_pool_buffer_back_and_training_goes_on(buffers: int, tmp_path: Path) -> None:
    """An exception from the second bucket's update, after its shard was read into a pool buffer and before it was
    written back (a loop catching it calls ``zero_grad()`` and goes on): that buffer goes back to the pool when the
    pool needs it, unwritten (the kernel did not run), and the weights stay bit for bit those of the same run without
    offload."""
    import zero_kernels.stages.offloaded as offloaded
    import zero_kernels.stages.update as update

    model = _model()
    twin = copy.deepcopy(model)
    opt = zo.ShardedFusedAdam(model, offload_optimizer="cpu", offload_param=_files(tmp_path, buffer_count=buffers),
                              **{**KWARGS, "reduce_bucket_size": 128})  # fmt: skip
    plain = zo.ShardedFusedAdam(twin, **{**KWARGS, "reduce_bucket_size": 128})
    for m, o in ((model, opt), (twin, plain)):
        _train(m, o, 2)
        launched = []

        def cut(real):
            def launch(*args, **kwargs):
                launched.append(1)
                if len(launched) == 2:
                    raise KeyboardInterrupt("in the update")
                return real(*args, **kwargs)

            return launch

        with pytest.MonkeyPatch.context() as patched:
            patched.setattr(update, "launch", cut(update.launch))
            patched.setattr(offloaded, "launch", cut(offloaded.launch))
            x = torch.randn(4, 32, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
            m(x).float().square().mean().backward()
            with pytest.raises(KeyboardInterrupt):
                o.step()
        o.zero_grad()
        _train(m, o, 3)
    _same_weights(model, opt, twin, plain)


def test_a_failed_write_leaves_no_other_write_of_the_file_to_land_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two writes in flight to a shard's file, the first of which fails (EIO): the read after them raises once both
    are done. The other, left running and forgotten, could land after a later write of the same bytes (here it
    finishes only when waited for, at the end, as the engine would finish it)."""
    import errno

    from tests.offload.test_disk_slots import _Late
    from zero_kernels.offload.aio import FileIO, IOHandle

    config = OffloadParamConfig(device="nvme", nvme_path=str(tmp_path), buffer_count=1, buffer_size=1000)
    files = ParamFiles(config, AioConfig(), rank=0)
    files.add(1, 16, torch.float32, "unit 1")
    late: list[_Late] = []
    real = FileIO.write

    def write(self, path, tensor, offset=0):
        if offset == 0:
            return IOHandle(str(path), tensor, lambda: (errno.EIO, "writing"), lambda: True)
        late.append(_Late(lambda: real(self, path, tensor, offset)))
        return late[-1]

    try:
        with monkeypatch.context() as patched:
            patched.setattr(FileIO, "write", write)
            files.write(1, torch.zeros(8))
            files.write(1, torch.ones(8), 8)
        with pytest.raises(OSError, match="Input/output error"):
            files.read(1, torch.empty(16))
        files.write(1, torch.full((8,), 2.0), 8).wait()
        late[0].wait()  # the engine finishes what it was given
        out = torch.empty(8)
        files.read(1, out, 8).wait()
        assert torch.equal(out, torch.full((8,), 2.0)), out
    finally:
        files.close()


def test_a_failed_state_write_keeps_the_update_of_fp32_parameters_in_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 parameters in files (their master is the shard itself) and the state on disk, written at once: the write
    of the first bucket's state fails (EIO) after its kernel ran. The step raises; the slot keeps the new moments and
    writes them once the disk is back, and the bucket's new parameters are written to their file too, so training
    goes on bit for bit as the same run without offload cut short after the same launch. Before, the parameters'
    new values were dropped with their pool buffer while the moments kept theirs: the next steps were 1e-3 off."""
    import errno

    import zero_kernels.stages.offloaded as offloaded
    import zero_kernels.stages.update as update
    from tests.offload.test_disk_slots import _stopping_at
    from zero_kernels.offload.aio import FileIO, IOHandle

    for folder in ("state", "params"):
        (tmp_path / folder).mkdir()
    plain = _model().float()
    model = copy.deepcopy(plain)
    state = {"device": "nvme", "nvme_path": str(tmp_path / "state"), "pipeline_write": False}
    kwargs = {**KWARGS, "reduce_bucket_size": 128}
    opts = [zo.ShardedFusedAdam(plain, **kwargs),
            zo.ShardedFusedAdam(model, offload_optimizer=state, offload_param=_files(tmp_path / "params"),
                                sub_group_size=128, **kwargs)]  # fmt: skip
    models = [plain, model]
    for m, o in zip(models, opts):
        _train(m, o, 2, dtype=torch.float32)
    launched, stop, failed = [0], [None], []
    counted = _stopping_at(launched, stop)
    real = FileIO.write

    def failing(self, path, tensor, offset=0):
        if not failed and launched[0] >= 1 and str(tmp_path / "state") in str(path):
            failed.append(path)
            return IOHandle(str(path), tensor, lambda: (errno.EIO, "writing"), lambda: True)
        return real(self, path, tensor, offset)

    monkeypatch.setattr(update, "launch", counted(update.launch))
    monkeypatch.setattr(offloaded, "launch", counted(offloaded.launch))
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(7))
    with monkeypatch.context() as patched:
        patched.setattr(FileIO, "write", failing)
        model(x).square().mean().backward()
        with pytest.raises(OSError, match="Input/output error"):
            opts[1].step()
    assert failed
    stop[0], launched[0] = launched[0], 0
    plain(x).square().mean().backward()
    with pytest.raises(KeyboardInterrupt):
        opts[0].step()
    stop[0] = None
    for m, o in zip(models, opts):
        o.zero_grad()
        _train(m, o, 3, dtype=torch.float32)
    _same_weights(model, opts[1], plain, opts[0])


def test_a_failed_write_of_a_shard_is_raised_once_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write of a bucket's updated shard into its file fails (EIO) in a step: the step raises that error once; the
    next steps (the disk back) train, each writing the parameters from their masters again. Before, the failed write
    stayed among the file's writes in flight and the next step's first read of the file raised it again, and the one
    after failed with an IndexError from the pool."""
    import errno

    from zero_kernels.offload.aio import FileIO, IOHandle

    model = _model()
    opt = zo.ShardedFusedAdam(model, offload_optimizer="cpu", offload_param=_files(tmp_path),
                              **{**KWARGS, "reduce_bucket_size": 128})  # fmt: skip
    _train(model, opt, 2)
    real, failed = FileIO.write, []

    def failing(self, path, tensor, offset=0):
        if not failed:
            failed.append(path)
            return IOHandle(str(path), tensor, lambda: (errno.EIO, "writing"), lambda: True)
        return real(self, path, tensor, offset)

    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    model(x).float().square().mean().backward()
    with monkeypatch.context() as patched:
        patched.setattr(FileIO, "write", failing)
        with pytest.raises(OSError, match="Input/output error"):
            opt.step()
    assert failed
    opt.zero_grad()
    _train(model, opt, 2)
    with opt.gathered_params():
        for p in model.parameters():
            assert torch.equal(p, opt.state[p]["master"].to(p.dtype).view_as(p))


def test_a_failed_read_of_a_shard_for_a_gather_is_raised_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read of a unit's shard for its gather fails (EIO) in a forward, in two windows: each forward raises it, the
    loop drops the window (``zero_grad()``) and goes on, bit for bit as the same run with the shards in host memory
    that dropped those windows. Before, the failed read's pool buffer stayed held with nothing to give it back, and
    once both were lost the next step failed with an IndexError from the pool."""
    import errno

    from zero_kernels.offload.aio import FileIO, IOHandle

    model, opt, twin, host = _in_files_and_in_memory(tmp_path, 1)
    real, failed = FileIO.read, []

    def failing(self, path, tensor, offset=0):  # the window's first read fails
        if len(failed) < window:
            failed.append(path)
            return IOHandle(str(path), tensor, lambda: (errno.EIO, "reading"), lambda: True)
        return real(self, path, tensor, offset)

    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    for window in (1, 2):
        with monkeypatch.context() as patched:
            patched.setattr(FileIO, "read", failing)
            with pytest.raises(OSError, match="Input/output error"):
                model(x).float().square().mean().backward()
        opt.zero_grad()
    assert len(failed) == 2
    _train(model, opt, 2)
    _train(twin, host, 2)
    _same_weights(model, opt, twin, host)


@pytest.mark.parametrize("state", [None, "cpu"])
def test_a_failed_write_of_an_updated_shard_keeps_the_update(
    state: Optional[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write of a bucket's updated shard into its file fails (EIO) in a step (the state on the device or in host
    memory): the step raises, and after ``zero_grad()`` the weights and the state are those of the same run with the
    shards in host memory cut short after the same launch, and stay so. Before, the file kept the shard before the
    update, which the gathers sent and the next update took for an edit of the parameters (its master went back to
    it, the moments kept the update): the weights were 0.02 (the learning rate) off."""
    import errno

    import zero_kernels.stages.offloaded as offloaded
    import zero_kernels.stages.update as update
    from tests.offload.test_disk_slots import _stopping_at
    from zero_kernels.offload.aio import FileIO, IOHandle

    model = _model()
    twin = copy.deepcopy(model)
    kwargs = {**KWARGS, "lr": 2e-2, "reduce_bucket_size": 128}
    if state is not None:
        kwargs["offload_optimizer"] = state
    opt = zo.ShardedFusedAdam(model, offload_param=_files(tmp_path), **kwargs)
    host = zo.ShardedFusedAdam(twin, offload_param="cpu", **kwargs)
    _train(model, opt, 1)
    _train(twin, host, 1)
    real, writes = FileIO.write, []

    def failing(self, path, tensor, offset=0):  # the step's second write fails
        writes.append(path)
        if len(writes) == 2:
            return IOHandle(str(path), tensor, lambda: (errno.EIO, "writing"), lambda: True)
        return real(self, path, tensor, offset)

    launched, stop = [0], [None]
    monkeypatch.setattr(update, "launch", _stopping_at(launched, stop)(update.launch))
    monkeypatch.setattr(offloaded, "launch", _stopping_at(launched, stop)(offloaded.launch))
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    model(x).float().square().mean().backward()
    twin(x).float().square().mean().backward()
    with monkeypatch.context() as patched:
        patched.setattr(FileIO, "write", failing)
        with pytest.raises(OSError, match="Input/output error"):
            opt.step()
    stop[0], launched[0] = launched[0], 0
    with pytest.raises(KeyboardInterrupt):
        host.step()
    stop[0] = None
    opt.zero_grad()
    host.zero_grad()
    for steps in (0, 2):
        _train(model, opt, steps)
        _train(twin, host, steps)
        with opt.gathered_params(), host.gathered_params():
            for p, q in zip(model.parameters(), twin.parameters()):
                assert torch.equal(p, q), (steps, (p - q).abs().max())
        for p, q in zip(model.parameters(), twin.parameters()):
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][kind], host.state[q][kind]), (steps, kind)


@pytest.mark.parametrize("state", ["cpu", "nvme"])
def test_an_older_state_loaded_gives_way_to_the_weights_of_a_module_unused_at_the_next_step(
    state: str, tmp_path: Path
) -> None:
    """An older state loaded, then a step where one module has no gradient (it keeps its older master, which does not
    round to its weights), then a step that updates it: that step takes the weights in its shard's file for an edit,
    as the run without offload takes its parameters. Before, the first step wrote the shard read in for the load back
    to its file, and the second, finding it there alone, took it for one that holds no edit: the older master won,
    0.0098 off the run without offload."""
    from tests.helpers.lockstep import BUCKET, ROWS, STAGE3, Net, batch

    torch.manual_seed(0)
    plain = Net().to(torch.bfloat16)
    model = copy.deepcopy(plain)
    offload = {"device": "nvme", "nvme_path": str(tmp_path)} if state == "nvme" else "cpu"
    kwargs = dict(lr=2e-2, stage=3, reduce_bucket_size=BUCKET, amsgrad=True, max_grad_norm=0.05, **STAGE3)
    files = _files(tmp_path)
    opts = [zo.ShardedFusedAdam(plain, **kwargs),
            zo.ShardedFusedAdam(model, offload_optimizer=offload, offload_param=files, **kwargs)]  # fmt: skip

    def step(m: nn.Module, o: zo.ShardedFusedAdam, k: int, extra: bool = True) -> None:
        m(batch(k, ROWS).to(torch.bfloat16), (0, ROWS) if extra else None).float().backward()
        o.step()
        o.zero_grad()

    for m, o in ((plain, opts[0]), (model, opts[1])):
        step(m, o, 0)
        older = copy.deepcopy(o.state_dict())
        step(m, o, 1)
        o.load_state_dict(older)
        step(m, o, 2, extra=False)  # ``extra`` keeps its older master
        step(m, o, 3)
    _same_weights(model, opts[1], plain, opts[0])


@pytest.mark.parametrize("state", [None, "cpu"])
def test_a_checkpoint_leaves_the_shards_in_their_files(state: Optional[str], tmp_path: Path) -> None:
    """A save reads each unit's shard in for its pieces and lets it go after them (its file holds the same bytes, so
    the next update still skips reading what it overwrites); a load writes each unit's shard into its file without
    reading it first (a read started ahead of a gather before it is dropped). Neither leaves a shard read in until the
    next step. Trained on, the run is the one without offload, bit for bit."""
    model, twin = _model(), _model()
    extra = {} if state is None else {"offload_optimizer": state}
    (tmp_path / "nvme").mkdir()
    opt = zo.ShardedFusedAdam(model, offload_param=_files(tmp_path / "nvme"), **extra, **KWARGS)
    plain = zo.ShardedFusedAdam(twin, **KWARGS)
    disk = opt._pipeline.disk_params
    _train(twin, plain, 1)
    _train(twin, plain, 1)
    _train(model, opt, 1)
    read = disk.files.traffic()["read"]
    _train(model, opt, 1)
    a_step = disk.files.traffic()["read"] - read  # the gathers', and the update's where it keeps elements
    for m, o in ((model, opt), (twin, plain)):
        zk.checkpoint.save(tmp_path / ("ours" if o is opt else "plain"), m, o)
    assert not disk.resident_shards()
    read = disk.files.traffic()["read"]
    _train(model, opt, 1)
    assert disk.files.traffic()["read"] - read == a_step  # as much as any step: nothing read in is left to adopt
    _train(twin, plain, 1)
    for buf in disk.units.values():
        disk.read_ahead(buf)  # as a forward cut short leaves them: stale once the load writes the files
    read = disk.files.traffic()["read"]
    for m, o in ((model, opt), (twin, plain)):
        zk.checkpoint.load(tmp_path / ("ours" if o is opt else "plain"), m, o)
    assert not disk.resident_shards() and disk.files.traffic()["read"] == read  # written, nothing read
    for m, o in ((model, opt), (twin, plain)):
        _train(m, o, 2)
    _same_weights(model, opt, twin, plain)
    ours, theirs = opt.full_state_dict()["state"], plain.full_state_dict()["state"]
    assert all(torch.equal(ours[i][k], theirs[i][k]) for i in theirs for k in theirs[i])


def test_a_shard_whose_write_fails_in_a_load_stays_read_in_for_the_next_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model, twin = _model(), _model()
    opt = zo.ShardedFusedAdam(model, offload_optimizer="cpu", offload_param=_files(tmp_path), **KWARGS)
    plain = zo.ShardedFusedAdam(twin, **KWARGS)
    for m, o in ((model, opt), (twin, plain)):
        _train(m, o, 2)
        zk.checkpoint.save(tmp_path / ("ours" if o is opt else "plain"), m, o)
        _train(m, o, 1)
    disk = opt._pipeline.disk_params
    write, failed = type(disk.files).write, []

    def failing(self, key, tensor, offset=0):
        if not failed:
            failed.append(key)
            raise OSError(5, "Input/output error")
        return write(self, key, tensor, offset)

    monkeypatch.setattr(type(disk.files), "write", failing)
    for m, o in ((model, opt), (twin, plain)):
        zk.checkpoint.load(tmp_path / ("ours" if o is opt else "plain"), m, o)
    assert [id(buf) for buf in disk.units.values() if not disk.in_file(buf)] == failed  # the loaded values kept
    assert "shard stays in host memory until the next step: [Errno 5] Input/output error" in caplog.text
    for m, o in ((model, opt), (twin, plain)):
        _train(m, o, 2)
    assert not disk.resident_shards()
    _same_weights(model, opt, twin, plain)


def test_the_end_of_a_block_lets_go_the_shards_it_left_as_they_were(tmp_path: Path) -> None:
    """Leaving ``gathered_params()`` reads each unit's shard in to write the block's values back, and lets it go
    again where its bytes did not change (a read, or writes that put back what was there): only an edited unit's
    shard stays read in until the next step. The next update reads as much as any, and the run is the one without
    offload, bit for bit."""
    model, twin = _model(), _model()
    opt = zo.ShardedFusedAdam(model, offload_optimizer="cpu", offload_param=_files(tmp_path), **KWARGS)
    plain = zo.ShardedFusedAdam(twin, **KWARGS)
    disk = opt._pipeline.disk_params
    for m, o in ((twin, plain), (twin, plain), (model, opt)):
        _train(m, o, 1)
    read = disk.files.traffic()["read"]
    _train(model, opt, 1)
    a_step = disk.files.traffic()["read"] - read
    for m, o in ((model, opt), (twin, plain)):
        with o.gathered_params(), torch.no_grad():
            m[2].weight.mul_(2).div_(2)  # the same bits again
    assert not disk.resident_shards()
    read = disk.files.traffic()["read"]
    _train(model, opt, 1)
    assert disk.files.traffic()["read"] - read == a_step
    _train(twin, plain, 1)
    for m, o in ((model, opt), (twin, plain)):
        with o.gathered_params(), torch.no_grad():
            m[2].weight.mul_(1.5)
    assert [buf.param_shard.numel() for buf in disk.units.values() if not disk.in_file(buf)] == [
        opt._pipeline.buffers[0].layout.shard_numel
    ]  # model[2]'s unit, the first buffer (the last module first)
    for m, o in ((model, opt), (twin, plain)):
        _train(m, o, 2)
    _same_weights(model, opt, twin, plain)
    ours, theirs = opt.full_state_dict()["state"], plain.full_state_dict()["state"]
    assert all(torch.equal(ours[i][k], theirs[i][k]) for i in theirs for k in theirs[i])


@pytest.mark.parametrize("state", [None, "cpu"])
def test_a_master_written_before_a_save_stays_in_the_shard_the_save_wrote(state: Optional[str], tmp_path: Path) -> None:
    """A master written through a view kept since before the last step: a save gives the parameters its values in the
    shard it read in, whose file then holds older weights, so that shard stays read in; a step that keeps some of its
    elements (a module without gradients) keeps the master's values, as the run without offload does. Before, the save
    let the shard go and that step read the older weights from its file and took them for an edit: the master's write
    was undone, 0.0071 off the run without offload (0.0082 with the state in host memory)."""
    model, twin = _model(), _model()
    extra = {} if state is None else {"offload_optimizer": state}
    (tmp_path / "nvme").mkdir()
    opt = zo.ShardedFusedAdam(model, offload_param=_files(tmp_path / "nvme"), **extra, **KWARGS)
    plain = zo.ShardedFusedAdam(twin, **KWARGS)
    for m, o in ((model, opt), (twin, plain)):
        _train(m, o, 1)
        views = [o.state[p] for p in m.parameters()]
        _train(m, o, 1)
        for view in views:
            view["master"].mul_(0.97)
        zk.checkpoint.save(tmp_path / ("ours" if o is opt else "plain"), m, o)
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
        with torch.no_grad():
            h = m[1](m[0](x))
        m[2](h).float().square().mean().backward()  # the first module without gradients
        o.step()
        o.zero_grad()
        _train(m, o, 1)
    _same_weights(model, opt, twin, plain)


def test_a_failed_read_as_gathered_params_starts_is_raised_once_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read of a unit's shard for the gathers of ``gathered_params()`` fails (EIO) as the block starts: the block
    raises it, and later blocks gather every unit and write their edits back, training on bit for bit as the run with
    the shards in host memory. Before, the block stayed entered: every later block took itself for a nested one,
    gathered nothing and wrote nothing back, and an edit inside raised a RuntimeError about a freed parameter."""
    import errno

    from zero_kernels.offload.aio import FileIO, IOHandle

    model, opt, twin, host = _in_files_and_in_memory(tmp_path, 1)
    real, failed = FileIO.read, []

    def failing(self, path, tensor, offset=0):
        if not failed:
            failed.append(path)
            return IOHandle(str(path), tensor, lambda: (errno.EIO, "reading"), lambda: True)
        return real(self, path, tensor, offset)

    with monkeypatch.context() as patched:
        patched.setattr(FileIO, "read", failing)
        with pytest.raises(OSError, match="Input/output error"):
            with opt.gathered_params():
                pass
    assert failed
    for m, o in ((model, opt), (twin, host)):
        with o.gathered_params():
            m[0].weight.data.mul_(0.5)
        _train(m, o, 2)
    _same_weights(model, opt, twin, host)


def test_a_failed_read_at_the_end_of_gathered_params_writes_none_of_the_block_s_edits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The block's end reads the shards in to write the edits into them, and the second read fails (EIO): the block
    raises it and none of its edits is written back, so training goes on bit for bit as the run with the shards in
    host memory that did not run the block. Before, the first unit had taken the block's edits and the second had not:
    the weights were those of neither run."""
    import errno

    from zero_kernels.offload.aio import FileIO, IOHandle

    model, opt, twin, host = _in_files_and_in_memory(tmp_path, 1)
    real, reads = FileIO.read, []

    def failing(self, path, tensor, offset=0):
        reads.append(path)
        if len(reads) == 2:
            return IOHandle(str(path), tensor, lambda: (errno.EIO, "reading"), lambda: True)
        return real(self, path, tensor, offset)

    with pytest.raises(OSError, match="Input/output error"):
        with opt.gathered_params():
            for p in model.parameters():
                p.data.mul_(0.5)
            monkeypatch.setattr(FileIO, "read", failing)
    monkeypatch.setattr(FileIO, "read", real)
    assert len(reads) == 2
    _train(model, opt, 2)
    _train(twin, host, 2)
    _same_weights(model, opt, twin, host)


def test_a_load_cut_short_leaves_the_weights_of_a_shard_in_its_file_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the state on disk a load reads each buffer's values again as it applies them; that read fails (EIO) for
    the first layer's bias: the load raises, and every weight is as before the load or as loaded, never zero (the file
    still holds the shard the load had not written yet); a load that then succeeds trains on bit for bit as the run
    with the shards in host memory. Before, the shard the load had made whole with zeros stayed read in: the first
    layer's weights were 0 and went on training from there."""
    from zero_kernels.checkpoint.format import TensorSource

    model, twin = _model(), _model()
    state = {"device": "nvme", "nvme_path": str(tmp_path / "state")}
    (tmp_path / "state").mkdir()
    (tmp_path / "params").mkdir()
    kwargs = dict(KWARGS, offload_optimizer=state, sub_group_size=100)
    opt = zo.ShardedFusedAdam(model, offload_param=_files(tmp_path / "params"), **kwargs)
    plain = zo.ShardedFusedAdam(twin, **kwargs)
    weights = []  # the run's (the same with and without the shards in files), saved and then before the load
    for m, o, name in ((model, opt, "ours"), (twin, plain, "plain")):
        _train(m, o, 1)
        zk.checkpoint.save(tmp_path / name, m, o)
        if o is plain:
            weights.append(_weights(twin, plain))
        _train(m, o, 1)
    saved, before = weights[0], _weights(twin, plain)
    real, reads = TensorSource.read_summed, {}

    def failing(self, key, *args):
        reads[key] = reads.get(key, 0) + 1
        if key == "optim/1/exp_avg" and reads[key] == 2:  # read again as it is applied
            raise OSError(5, "Input/output error")
        return real(self, key, *args)

    with monkeypatch.context() as patched:
        patched.setattr(TensorSource, "read_summed", failing)
        with pytest.raises(zk.checkpoint.CheckpointError, match="Input/output error.*stopped part way"):
            zk.checkpoint.load(tmp_path / "ours", model, opt)
    with opt.gathered_params():
        for name, p in model.named_parameters():
            assert bool(((p == before[name]) | (p == saved[name])).all()), (name, p.abs().max())
    for m, o, name in ((model, opt, "ours"), (twin, plain, "plain")):
        zk.checkpoint.load(tmp_path / name, m, o)
        _train(m, o, 2)
    _same_weights(model, opt, twin, plain)
