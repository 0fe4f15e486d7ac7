"""The host tier: bytes crossing per step (counted), no host copy where the device is host memory (the copies
themselves run with ``share_host`` off, as from a GPU), the host Adam's threads, what memory_report shows."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zero_kernels.optim as zo
import zero_kernels.stages.offloaded as offloaded
from zero_kernels.offload import THREADS_VARIABLE, HostTier, cpu_threads

BUCKET = 4096  # elements


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 32)).to(dtype)


def _train(model: nn.Module, opt: zo.ShardedFusedAdam, steps: int, dtype: torch.dtype) -> None:
    for step in range(steps):
        model(
            torch.randn(4, 64, generator=torch.Generator().manual_seed(step)).to(dtype)
        ).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture
def copying(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier copies to and from the "device" as from a GPU, though both are host memory here."""
    monkeypatch.setattr(HostTier, "share_host", False)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype, per_param", [(torch.bfloat16, 4), (torch.float32, 8)])
def test_bytes_crossing_per_step(stage: int, dtype: torch.dtype, per_param: int, copying: None) -> None:
    """bf16: the gradient down and the parameters up, 2 bytes each (4 per parameter); fp32: 4 each (8)."""
    model = _model(dtype)
    opt = zo.ShardedFusedAdam(model, stage=stage, reduce_bucket_size=BUCKET, offload_optimizer={"device": "cpu"})
    steps = 3
    _train(model, opt, steps, dtype)
    tier = opt._pipeline.tier
    numel = sum(buf.layout.shard_numel for buf in opt._pipeline.buffers)
    traffic = tier.traffic()
    size = torch.finfo(dtype).bits // 8
    assert traffic["up"] == steps * numel * size
    assert traffic["down"] == steps * numel * size  # the gradients (edits are found without copying down)
    assert (traffic["up"] + traffic["down"]) / (steps * numel) <= per_param + 0.01
    assert traffic["init"] == numel * size  # the parameters' first copy down


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_no_host_copy_where_the_device_is_host_memory(stage: int, dtype: torch.dtype, monkeypatch) -> None:
    """On a CPU-only machine the host Adam reads the reduced gradient shard and writes the parameter shard in
    place: the tensors it is given share their storage, the tier holds no copy, and nothing is counted as
    crossing."""
    seen = []
    real = offloaded.launch

    def spy(pipeline, buf, bucket, h, decision, with_grad, tensors, **kwargs):
        params = tensors.master if tensors.out is None else tensors.out
        seen.append((_same_storage(tensors.grad, pipeline.grad_shard(buf, bucket)),
                     _same_storage(params, pipeline.param_shard(buf, bucket))))  # fmt: skip
        return real(pipeline, buf, bucket, h, decision, with_grad, tensors, **kwargs)

    monkeypatch.setattr(offloaded, "launch", spy)
    model = _model(dtype)
    opt = zo.ShardedFusedAdam(model, stage=stage, reduce_bucket_size=BUCKET, offload_optimizer={"device": "cpu"})
    _train(model, opt, 2, dtype)
    tier = opt._pipeline.tier
    assert seen and all(grads and params for grads, params in seen), seen
    assert all(s.params is None and s.grads is None for s in tier.shards.values())
    assert tier.traffic() == {"down": 0, "up": 0, "init": 0}


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.data_ptr() == b.data_ptr()


@pytest.mark.parametrize("shared", [True, False])
def test_memory_report_shows_the_host_tier(shared: bool, monkeypatch) -> None:
    monkeypatch.setattr(HostTier, "share_host", shared)
    model = _model(torch.bfloat16)
    opt = zo.ShardedFusedAdam(model, stage=1, reduce_bucket_size=BUCKET, offload_optimizer={"device": "cpu"})
    _train(model, opt, 1, torch.bfloat16)
    report = opt.memory_report()
    numel = sum(buf.layout.shard_numel for buf in opt._pipeline.buffers)
    assert report["optimizer"] == 0 and report["disk"] == 0
    copies = 0 if shared else 2 + 2  # the host copies of parameters and gradients, where they are made
    assert report["host"] == numel * (12 + copies)  # master, m, v
    plain = zo.ShardedFusedAdam(_model(torch.bfloat16), stage=1, reduce_bucket_size=BUCKET)
    plain_report = plain.memory_report()  # every key at every stage: 0 where nothing is offloaded
    assert plain_report["host"] == plain_report["disk"] == 0 and plain_report["optimizer"] == numel * 12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_stage3_offload_param_keeps_the_shards_in_the_host_copies(dtype: torch.dtype, caplog, copying) -> None:
    """The HF ZeRO-3 template (``offload_param`` and ``offload_optimizer`` on the cpu), from a "device" that is
    not host memory: each unit's parameter shard is the tier's host copy, so nothing goes up at the step (only
    the gradients come down), the shards count under ``host`` and not ``params``, and no warning says the key is
    ignored."""
    cpu = {"device": "cpu", "pin_memory": True}
    kwargs = dict(reduce_bucket_size=BUCKET, stage3_param_persistence_threshold=0)
    model = _model(dtype)
    with caplog.at_level("WARNING", logger="zero_kernels"):
        opt = zo.ShardedFusedAdam(model, stage=3, offload_optimizer=cpu, offload_param=cpu, **kwargs)
    assert "offload_param" not in caplog.text
    steps = 2
    _train(model, opt, steps, dtype)
    pipeline, tier = opt._pipeline, opt._pipeline.tier
    for buf in pipeline.buffers:
        assert buf.param_shard.data_ptr() == tier.shards[id(buf)].params.data_ptr()
    numel = sum(buf.layout.shard_numel for buf in pipeline.buffers)
    size = torch.finfo(dtype).bits // 8
    assert tier.traffic()["up"] == 0 and tier.traffic()["down"] == steps * numel * size
    twin = _model(dtype)
    plain = zo.ShardedFusedAdam(twin, stage=3, offload_optimizer=cpu, **kwargs)
    _train(twin, plain, steps, dtype)
    report, before = opt.memory_report(), plain.memory_report()
    assert before["params"] - report["params"] == numel * size  # the device shards are gone
    assert report["host"] == before["host"]  # they were the host copies already
    with opt.gathered_params(), plain.gathered_params():
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q)


def test_stage3_offload_param_on_host_memory_keeps_the_shards_in_place() -> None:
    """Where the device is host memory, ``offload_param`` cpu keeps each shard where it is (no second copy) and
    the memory report is that of ``offload_optimizer`` alone."""
    cpu = {"device": "cpu", "pin_memory": True}
    kwargs = dict(reduce_bucket_size=BUCKET, stage3_param_persistence_threshold=0, offload_optimizer=cpu)
    model, twin = _model(torch.bfloat16), _model(torch.bfloat16)
    opt = zo.ShardedFusedAdam(model, stage=3, offload_param=cpu, **kwargs)
    plain = zo.ShardedFusedAdam(twin, stage=3, **kwargs)
    _train(model, opt, 2, torch.bfloat16)
    _train(twin, plain, 2, torch.bfloat16)
    pipeline = opt._pipeline
    assert pipeline.params_offloaded and all(s.params is None for s in pipeline.tier.shards.values())
    assert pipeline.tier.traffic() == {"down": 0, "up": 0, "init": 0}
    report, before = opt.memory_report(), plain.memory_report()
    assert report["params"] == before["params"] > 0 and report["host"] == before["host"] > 0
    with opt.gathered_params(), plain.gathered_params():
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q)


def test_cpu_adam_threads_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(THREADS_VARIABLE, "3")
    assert cpu_threads(0.8) == 3
    monkeypatch.setenv(THREADS_VARIABLE, "zero")
    with pytest.raises(ValueError, match=f"{THREADS_VARIABLE}='zero'"):
        cpu_threads(0.8)
    monkeypatch.delenv(THREADS_VARIABLE)
    assert cpu_threads(1e-9) == 1


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_a_bad_threads_value_is_a_value_error_at_construction(monkeypatch, tmp_path, device) -> None:
    """As every other ``ZERO_KERNELS_*`` variable's: not an ``OSError`` saying the tier could not start."""
    monkeypatch.setenv(THREADS_VARIABLE, "0")
    offload = {"device": device, "nvme_path": str(tmp_path)}
    with pytest.raises(ValueError, match=f"^environment variable {THREADS_VARIABLE}='0': expected an integer >= 1$"):
        zo.ShardedFusedAdam(_model(torch.float32), stage=2, offload_optimizer=offload)
    assert not list(tmp_path.iterdir())


def test_the_update_runs_on_the_tiers_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(THREADS_VARIABLE, "2")
    seen = []
    real = offloaded.launch

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(offloaded, "launch", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _model(torch.float32)
        opt = zo.ShardedFusedAdam(model, stage=1, offload_optimizer={"device": "cpu"})
        _train(model, opt, 1, torch.float32)
        assert seen and set(seen) == {2} and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_pinning_only_where_cuda_is() -> None:
    from zero_kernels.config.offload import OffloadOptimizerConfig

    tier = HostTier(OffloadOptimizerConfig(device="cpu", pin_memory=True))
    assert tier.pin is torch.cuda.is_available()
    assert tier.zeros(8).is_pinned() is torch.cuda.is_available()


def test_host_update_never_asks_triton_for_host_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert offloaded.host_impl("triton") == "auto" and offloaded.host_impl("cpu") == "cpu"
    monkeypatch.setenv("ZERO_KERNELS_IMPL", "triton")
    assert offloaded.host_impl(None) == "auto"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton runs on the CPU: the same kernel as without offload
    assert offloaded.host_impl("triton") == "triton"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fingerprint_sees_swaps_and_signs_of_zero(dtype: torch.dtype) -> None:
    """What ``HostTier.changed`` compares on a GPU: equal bits give equal prints; swapped elements, a
    -0.0 for a 0.0 or one changed bit do not."""
    from zero_kernels.offload.host import fingerprint

    t = torch.randn(100_003).to(dtype)
    t[7] = 0.0
    assert torch.equal(fingerprint(t), fingerprint(t.clone()))
    swapped = t.clone()
    swapped[[10, 20]] = t[[20, 10]]
    signed = t.clone()
    signed[7] = -0.0
    flipped = t.clone()
    flipped.view(torch.int16)[99_999] ^= 1
    for other in (swapped, signed, flipped):
        assert not torch.equal(fingerprint(t), fingerprint(other))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fingerprint_sees_swaps_any_distance_apart(dtype: torch.dtype) -> None:
    """Swaps of two elements 251 and 502 apart, of two embedding rows 251 apart, and two swaps with opposite
    differences the same distance apart (the plain and the position-weighted sums stay equal) change the print."""
    from zero_kernels.offload.host import fingerprint

    torch.manual_seed(0)
    t = torch.randn(4096).to(dtype)
    emb = torch.randn(600, 64).to(dtype)
    edits = []
    for i, j in ((10, 10 + 251), (10, 10 + 502)):
        edits.append((t, t.clone()))
        edits[-1][1][[i, j]] = t[[j, i]]
    rows = emb.clone()
    rows[[3, 254]] = emb[[254, 3]]
    edits.append((emb, rows))
    paired = torch.zeros(4096, dtype=dtype)
    paired[[100, 307]] = 1.0  # one 1.0 moves 7 up, the other 7 down
    opposite = paired.clone()
    opposite[[100, 107, 300, 307]] = paired[[107, 100, 307, 300]]
    edits.append((paired, opposite))
    if dtype == torch.float32:  # two elements whose low and high words differ by +1 and -1: a swap cancels both
        pair = torch.zeros(4096, dtype=dtype)
        pair.view(torch.int16)[[20, 21, 600, 601]] = torch.tensor([0, 0x3F80, 1, 0x3F7F], dtype=torch.int16)
        swapped = pair.clone()
        swapped[[10, 300]] = pair[[300, 10]]
        edits.append((pair, swapped))
    for before, after in edits:
        assert not torch.equal(before, after)
        assert not torch.equal(fingerprint(before), fingerprint(after))


def test_fingerprint_is_the_sums_mod_2_64(monkeypatch: pytest.MonkeyPatch) -> None:
    """The three sums against Python integers mod 2**64, over chunks (``_CHUNK`` made small) and at positions
    near 2**40 where the int64 products wrap."""
    from zero_kernels.offload import host

    def reference(t: torch.Tensor, at: int) -> list[int]:
        ws = host.words(t).tolist()
        sums = [sum(w * (at + i + 1) ** k for i, w in enumerate(ws)) for k in (0, 1, 2)]
        return [(s + 2**63) % 2**64 - 2**63 for s in sums]  # as signed int64

    monkeypatch.setattr(host, "_CHUNK", 7)
    t = torch.randn(50).to(torch.bfloat16)
    t[3] = -0.0
    assert host.fingerprint(t).tolist() == reference(t, 0)
    far = 2**40
    assert host._sums(host.words(t), far).tolist() == reference(t, far)
    assert host.fingerprint(torch.empty(0)).tolist() == [0, 0, 0]


def test_edit_swapping_rows_251_apart_is_adopted_as_without_offload(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU branch of ``HostTier.changed`` (``fingerprint``, forced here) finds a swap of two embedding rows
    251 apart between steps: the offloaded run keeps the edit and ends bit for bit where the plain run does."""
    monkeypatch.setattr(HostTier, "share_host", False)
    monkeypatch.setattr(HostTier, "bitwise", lambda self, device: False)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Embedding(300, 16), nn.Flatten(), nn.Linear(16 * 4, 1)).to(torch.bfloat16)
    plain, tiered = base, copy.deepcopy(base)
    a = zo.ShardedFusedAdam(plain, lr=1e-2, stage=2)
    b = zo.ShardedFusedAdam(tiered, lr=1e-2, stage=2, offload_optimizer={"device": "cpu"})
    x = torch.randint(0, 300, (8, 4), generator=torch.Generator().manual_seed(0))
    for step in range(3):
        for model, opt in ((plain, a), (tiered, b)):
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                with torch.no_grad():
                    model[0].weight[[3, 254]] = model[0].weight[[254, 3]].clone()
        for p, q in zip(plain.parameters(), tiered.parameters()):
            assert torch.equal(p, q), f"step {step}"
