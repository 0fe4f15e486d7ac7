"""Stage 3's parameter shards off the device where the optimizer state is not all offloaded (``offload_param``
without ``offload_optimizer``, or with its ``ratio`` below 1): in host memory (cpu) or in files (nvme), bit for bit
the weights and state without it on 2 gloo ranks, the copies a GPU makes run here too (``HostTier.share_host`` off:
2 + 2 bytes per parameter per step in bf16), what ``memory_report`` shows, checkpoints both ways."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch

import zero_kernels as zk
from tests.helpers.dist import run_ranks
from tests.helpers.lockstep import BUCKET, ROWS, STAGE3, Net, batch
from tests.offload.exactness import copying, pair_case
from tests.offload.test_offload_exact import in_files, param_files
from zero_kernels.offload import HostTier

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PARAMS = {"device": "cpu", "pin_memory": True}


def _exact_ranks(rank: int, world: int, scratch: str) -> None:
    nvme = Path(scratch) / f"nvme{rank}"
    nvme.mkdir(exist_ok=True)
    files, mixed = param_files(Path(scratch), rank), param_files(Path(scratch), rank, max_in_cpu=40)
    for dtype in DTYPES:  # a CPU machine: the shards are host memory already, nothing moves
        result = pair_case(rank, world, 3, dtype, None, PARAMS)
        assert result["param_traffic"] == {"up": 0, "down": 0}, result
    # shards in files: compared after every step, and only after the last (the gathers and the updates read them
    # from the files; some units kept in host memory under max_in_cpu)
    pair_case(rank, world, 3, torch.bfloat16, None, files)
    pair_case(rank, world, 3, torch.bfloat16, None, files, in_files)
    pair_case(rank, world, 3, torch.bfloat16, None, mixed, lambda opt: in_files(opt, kept=True))
    with copying():
        for params, dtypes in ((PARAMS, DTYPES), (files, (torch.bfloat16, torch.float32))):
            for dtype in dtypes:
                result = pair_case(rank, world, 3, dtype, None, params)
                off = result["shard_numel"] - result["device_numel"]
                assert off > result["shard_numel"] / 2, "most parameters must be in sharded units"
                moved = result["steps"] * off * torch.finfo(dtype).bits // 8  # every step: the kernel decides a skip
                assert result["param_traffic"] == {"up": moved, "down": moved}, (params, dtype, result)
        for offload in ({"device": "cpu", "ratio": 0.3}, {"device": "nvme", "nvme_path": str(nvme), "ratio": 0.3}):
            for params, dtype in ((PARAMS, torch.bfloat16), (PARAMS, torch.float32), (files, torch.bfloat16)):
                result = pair_case(rank, world, 3, dtype, offload, params)
                assert result["param_traffic"]["up"] > 0, (offload, dtype, result)
                assert result["traffic"]["up"] < result["traffic"]["down"], "the tier's part of a shard stays"


@pytest.mark.distributed
def test_host_parameter_shards_are_exact_on_two_ranks(tmp_path: Path) -> None:
    run_ranks(_exact_ranks, 2, str(tmp_path), timeout_s=300.0)


def _opt(model: Net, params: dict | None, **kwargs) -> zk.ShardedFusedAdam:
    extra = {"offload_param": params} if params else {}
    return zk.ShardedFusedAdam(model, lr=2e-2, stage=3, reduce_bucket_size=BUCKET, amsgrad=True, **STAGE3, **extra,
                               **kwargs)  # fmt: skip


def _train(model: Net, opt: zk.ShardedFusedAdam, steps: range) -> None:
    for step in steps:
        model(batch(step, ROWS)).backward()
        opt.step()
        opt.zero_grad()


def test_memory_report_counts_the_shards_under_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HostTier, "share_host", False)
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    plain = copy.deepcopy(model)
    opt, ref = _opt(model, PARAMS), _opt(plain, None)
    shards = [buf.param_shard for buf in opt._pipeline.buffers if not buf.persistent]
    assert shards and all(s.device.type == "cpu" for s in shards)
    assert [id(s) for s in shards] == [id(s) for s in opt._pipeline.host_params.tensors()]
    on_host = sum(s.numel() * s.element_size() for s in shards)
    report, plain_report = opt.memory_report(), ref.memory_report()
    assert report["host"] == on_host and report["disk"] == 0, report
    assert report["params"] == plain_report["params"] - on_host, (report, plain_report)
    assert report["optimizer"] == plain_report["optimizer"], "the state stays on the device"


@pytest.mark.parametrize("saved_with, loaded_with", [("cpu", None), (None, "cpu"), ("nvme", None), (None, "nvme")])
def test_checkpoints_load_with_and_without_shards_off_the_device(
    saved_with: str | None, loaded_with: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three steps, saved, loaded into a fresh model and optimizer, two more: the weights of five steps straight
    (nothing under ``nvme_path`` needed to resume)."""
    monkeypatch.setattr(HostTier, "share_host", False)
    blocks = {None: None, "cpu": PARAMS, "nvme": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0}}
    saved_with, loaded_with = blocks[saved_with], blocks[loaded_with]
    torch.manual_seed(0)
    model = Net()
    straight_model = copy.deepcopy(model)
    straight = _opt(straight_model, None)
    _train(straight_model, straight, range(5))
    opt = _opt(model, saved_with)
    _train(model, opt, range(3))
    zk.checkpoint.save(tmp_path / "ckpt", model, opt)
    opt._pipeline.close()
    torch.manual_seed(1)
    resumed_model = Net()
    resumed = _opt(resumed_model, loaded_with)
    zk.checkpoint.load(tmp_path / "ckpt", resumed_model, resumed)
    _train(resumed_model, resumed, range(3, 5))
    with straight.gathered_params(), resumed.gathered_params():
        for (name, p), q in zip(straight_model.named_parameters(), resumed_model.parameters()):
            assert torch.equal(p, q), name


def test_offload_param_is_acted_on_without_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    files = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0}
    for params, offload in ((PARAMS, None), (files, None), (files, {"device": "cpu", "ratio": 0.5})):
        with caplog.at_level(logging.WARNING, logger="zero_kernels"):
            opt = _opt(Net(), params, **({"offload_optimizer": offload} if offload else {}))
        assert not [r for r in caplog.records if "offload_param" in r.getMessage()]
        assert opt._pipeline.host_params is not None
        assert (opt._pipeline.disk_params is not None) == (params is files)
        opt._pipeline.close()
    assert not (tmp_path / "zero_kernels").exists(), "the files are removed at close"


class _InFlight:
    """Stands for a copy up still reading the host shards (``stages.uploads``): notes their values when waited for."""

    def __init__(self, shards: list[torch.Tensor]):
        self.shards, self.seen = shards, None

    def synchronize(self) -> None:
        self.seen = [s.clone() for s in self.shards]


def _writers(model: Net, opt: zk.ShardedFusedAdam, other: dict, saved: Path) -> dict:
    """Each host write into the parameter shards, between steps."""

    def assign() -> None:
        with torch.no_grad():
            model.emb.weight.data = other["emb.weight"].clone()
            model(batch(8, ROWS))  # taken into the shard where the module is next gathered

    def edit() -> None:
        with opt.gathered_params():
            with torch.no_grad():
                model.emb.weight.add_(1.0)

    def load() -> None:
        with opt.gathered_params():
            model.load_state_dict(other)

    def step() -> None:
        model(batch(9, ROWS)).backward()
        opt.step()

    return {
        "model.load_state_dict": load,
        "zk.checkpoint.load": lambda: zk.checkpoint.load(saved, model, opt),
        "a value assigned to a freed parameter": assign,
        "gathered_params() writing back": edit,
        "the step": step,
    }


@pytest.mark.parametrize("offload", [None, "cpu"], ids=["params alone", "with the state"])
def test_host_writers_wait_for_copies_up_in_flight(
    offload: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A host write into a shard a copy up may still read waits for it first (on a GPU: a gather queued behind
    other work would read half-new values)."""
    monkeypatch.setattr(HostTier, "share_host", False)
    torch.manual_seed(0)
    model = Net()
    other = {k: v + 0.5 for k, v in Net().state_dict().items()}
    opt = _opt(model, PARAMS, **({"offload_optimizer": offload} if offload else {}))
    _train(model, opt, range(2))
    zk.checkpoint.save(tmp_path / "ckpt", model, opt)
    pipeline = opt._pipeline
    for what, write in _writers(model, opt, other, tmp_path / "ckpt").items():
        shards = [buf.param_shard for buf in pipeline.buffers if not buf.persistent]
        before = [s.clone() for s in shards]
        pending = _InFlight(shards)
        pipeline.uploads._last[(0, 0)] = pending
        write()
        assert pending.seen is not None, f"{what}: wrote the shards without waiting for the copies up"
        assert all(torch.equal(a, b) for a, b in zip(pending.seen, before)), f"{what}: waited after writing"
        assert not all(torch.equal(a, b) for a, b in zip(shards, before)), f"{what}: wrote nothing (the test)"
        assert not pipeline.uploads._last


def _always_copied_up(self, t: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``UnitGathers.on_device`` as on a GPU, where a host shard is never on the gathered buffer's device."""
    self.uploaded += t.numel() * t.element_size()
    return self.uploads.copy_up(t, full.device)


class _Pending:
    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("read", ["state_dict", "full_state_dict", "checkpoint"])
def test_a_master_written_from_outside_waits_for_the_copies_up_before_writing_the_shard(
    read: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A master written through ``opt.state`` reaches the host parameter shard at the next state read (``push``): on
    a GPU the gathers' copies up from that pinned shard may still be queued then, so the write waits for them first
    (it did only at the step). Run on the CPU with each copy up leaving a pending event, as CUDA's would."""
    from zero_kernels.stages import master, uploads
    from zero_kernels.stages.stage3 import gathers

    def copy_up(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        self._last[("pending", id(t))] = _Pending()
        return t.to(device)

    from zero_kernels.stages.stage3.pipeline import Stage3Pipeline

    pending_at_push: list[int] = []  # copies up pending when push takes a shard to write
    pushing = []
    push, param_shard = master.push, Stage3Pipeline.param_shard

    def watched_push(pipeline, buf) -> None:
        pushing.append(True)
        try:
            push(pipeline, buf)
        finally:
            pushing.pop()

    def watched_shard(self, buf, bucket):
        if pushing:
            pending_at_push.append(len(self.uploads._last))
        return param_shard(self, buf, bucket)

    monkeypatch.setattr(uploads.Uploads, "copy_up", copy_up)
    monkeypatch.setattr(gathers.UnitGathers, "on_device", _always_copied_up)
    monkeypatch.setattr(HostTier, "share_host", False)
    monkeypatch.setattr(master, "push", watched_push)
    monkeypatch.setattr(Stage3Pipeline, "param_shard", watched_shard)
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    opt = zk.ShardedFusedAdam(model, stage=3, reduce_bucket_size=BUCKET, offload_param=PARAMS, **STAGE3)
    for step in range(2):
        model(batch(step, ROWS).to(torch.bfloat16)).backward()  # the second's gathers leave copies up pending
        if step == 0:
            opt.step()
            opt.zero_grad()
    assert opt._pipeline.uploads._last
    with torch.no_grad():
        opt.state[model.emb.weight]["master"].mul_(1.0)  # written from outside
    if read == "checkpoint":
        zk.checkpoint.save(str(tmp_path / "ckpt"), model, opt)
    else:
        getattr(opt, read)()
    assert pending_at_push and all(n == 0 for n in pending_at_push), pending_at_push


def _qwz_uploads(rank: int, world: int) -> None:
    from zero_kernels.stages.stage3 import gathers

    gathers.UnitGathers.on_device = _always_copied_up
    HostTier.share_host = False
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    opt = zk.ShardedFusedAdam(model, stage=3, reduce_bucket_size=BUCKET, offload_param=PARAMS,
                              zero_quantized_weights=True, **STAGE3)  # fmt: skip
    pipeline = opt._pipeline
    shards = [buf for buf in pipeline.buffers if id(buf) in pipeline.host_params.moved]
    assert shards
    before = pipeline.unit_gathers.uploaded
    with torch.no_grad():
        model(batch(0, ROWS).to(torch.bfloat16))  # the forward gathers every sharded unit once, quantized
    exact = sum(buf.layout.shard_numel * 2 for buf in shards)  # bf16 shards, exact
    uploaded = pipeline.unit_gathers.uploaded - before
    assert uploaded > exact, (uploaded, exact)  # the exact shard crossed (counted), and the payload


@pytest.mark.distributed
def test_qwz_copies_this_rank_s_exact_shard_up_and_counts_it() -> None:
    """With ``zero_quantized_weights`` a gather keeps this rank's chunk exact: the shard, in host memory with
    ``offload_param``, is copied up with the payload (counted; it was read from host memory inside the wait)."""
    run_ranks(_qwz_uploads, 2)
