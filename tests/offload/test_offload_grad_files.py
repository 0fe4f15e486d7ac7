"""Stage 3's gradient shards in files with the optimizer state on disk (``offload_optimizer`` nvme: ZeRO-Infinity's
gradient swap, ``stages.stage3.disk_grads``): weights and Adam state bit for bit those of the same run without
offload, compared after every step at 1 and 2 gloo ranks (bf16, fp16 with loss scaling and overflow steps, fp32;
clipping; a non-finite step; two backward passes before a step and a round owed after ``no_sync``; a parameter
without a gradient; ``zero_grad(set_to_none=False)`` between backward and step (between micro-steps, ignored);
``gradient_accumulation_steps`` 2, in the gradients' dtype and in fp32; ``clip_grad_norm_``); the files on disk
while training (after a backward they hold the resident shard's bytes) and gone after ``close``; no resident
gradient shard in ``memory_report``; the gradients read once per step (the statistics read nothing); the statistics
taken at a window's last micro-step only; reads ahead: each later micro-step's bucket sums and the update's
gradients found read before use, none following a link from a window before; a checkpoint saved inside an
accumulation window resumed with and without offload; writes that finish in reverse order: a window loaded right
after a backward, a backward dropped by ``zero_grad()`` before the one the step uses; one bucket after
``zero_grad(set_to_none=False)`` between backward and step (it follows itself in the read-ahead order); a disk
without room for the gradients refused naming the key."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Optional

import pytest
import torch

import zero_kernels.checkpoint as ck
import zero_kernels.optim as zo
import zero_kernels.stages.stage3.disk_grads as disk_grads_module
from tests.helpers.dist import run_ranks
from tests.helpers.lockstep import BUCKET, ROWS, STAGE3, Net, batch, extra_rows, local
from tests.offload.exactness import assert_same
from tests.offload.test_disk_tier import _tmpfs
from zero_kernels.offload.aio import FileIO

CLIP = 0.05
KINDS = ("plain", "twice", "owed", "nonfinite", "plain", "zeroed", "partial", "plain")


def _disk(path: Path) -> dict:
    path.mkdir(parents=True, exist_ok=True)
    return {"device": "nvme", "nvme_path": str(path), "buffer_count": 2}  # a pool of 2: writes wait for a buffer


def _opt(model: Net, offload: Optional[dict], dtype: torch.dtype, clip: bool = True, **kw) -> zo.ShardedFusedAdam:
    if dtype == torch.float16:
        kw["fp16"] = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 2}
    if offload is not None:
        kw.update(offload_optimizer=offload, sub_group_size=32)
    return zo.ShardedFusedAdam(model, lr=2e-2, stage=3, reduce_bucket_size=BUCKET, amsgrad=True,
                               max_grad_norm=CLIP if clip else None, **STAGE3, **kw)  # fmt: skip


def _pair(
    disk: dict, dtype: torch.dtype = torch.bfloat16, clip: bool = True, **kw
) -> tuple[Net, Net, zo.ShardedFusedAdam, zo.ShardedFusedAdam]:
    """(plain, tiered, a, b): the same seeded model twice, ``a`` training it without offload and ``b`` with the
    state and the gradients on disk (``disk``: the ``offload_optimizer`` block)."""
    torch.manual_seed(0)
    plain = Net().to(dtype)
    tiered = copy.deepcopy(plain)
    return plain, tiered, _opt(plain, None, dtype, clip, **kw), _opt(tiered, disk, dtype, clip, **kw)


def _backward(model: Net, opt: zo.ShardedFusedAdam, x: torch.Tensor, extra, inf: bool = False) -> None:
    dtype = next(model.parameters()).dtype
    loss = model(x.to(dtype), extra).float()
    if inf:
        loss = loss * torch.tensor(float("inf"))
    opt.backward(loss) if dtype == torch.float16 else loss.backward()


def _one_step(model: Net, opt: zo.ShardedFusedAdam, rank: int, world: int, step: int, kind: str,
              clip: bool) -> Optional[float]:  # fmt: skip
    """One step of ``kind`` (see ``KINDS``) on this rank's rows; without ``clip`` (in the optimizer), from the
    fourth step, returns the norm ``clip_grad_norm_`` measured (the gradient files' norm terms are not taken
    before: computed from the files then)."""
    x = batch(step, 2 * world * ROWS)
    rows = [x[(m * world + rank) * ROWS : (m * world + rank + 1) * ROWS] for m in range(2)]
    extra = None if kind == "partial" else local(extra_rows(step, world), rank, 3)
    inf = kind == "nonfinite" and next(model.parameters()).dtype != torch.float16  # fp16 overflows by itself
    if opt.gradient_accumulation_steps == 2:
        _backward(model, opt, rows[0], extra)
        opt.step()  # a micro-step: no update
        if kind == "zeroed":  # ignored between micro-steps
            opt.zero_grad(set_to_none=False)
        _backward(model, opt, rows[1], extra, inf)
    elif kind in ("twice", "owed"):
        _backward(model, opt, rows[0], extra)
        with opt.no_sync() if kind == "owed" else contextlib.nullcontext():
            _backward(model, opt, rows[1], extra)
    else:
        _backward(model, opt, rows[0], extra, inf)
    if kind == "zeroed" and opt.gradient_accumulation_steps == 1:  # the step applies zero gradients to the
        opt.zero_grad(set_to_none=False)  # parameters the last step updated
    norm = None if clip or step < 3 else float(opt.clip_grad_norm_(CLIP))
    opt.step()
    opt.zero_grad()
    return norm


def _grad_files(opt: zo.ShardedFusedAdam) -> list[Path]:
    return sorted(opt._pipeline.tier.root.glob("u*.grads"))


def _on_disk_only(opt: zo.ShardedFusedAdam) -> None:
    """Between steps the gradient shards are files of their full size; nothing of them is resident."""
    pipeline = opt._pipeline
    sizes = sorted(buf.layout.shard_numel * buf.grad_shard.dtype.itemsize for buf in pipeline.buffers)
    assert sizes and sorted(p.stat().st_size for p in _grad_files(opt)) == sizes
    assert all(buf.grad_shard.device.type == "meta" for buf in pipeline.buffers)
    assert opt.memory_report()["grads"] == 0


def pair(rank: int, world: int, scratch: Path, dtype: torch.dtype, *, clip: bool = True, **kw) -> None:
    """Train without offload and with the state and the gradients on disk, comparing after every step."""
    plain, tiered, a, b = _pair(_disk(scratch / f"nvme{rank}"), dtype, clip, **kw)
    files = b._pipeline.disk_grads.files
    shard_bytes = sum(buf.layout.shard_numel * buf.grad_shard.dtype.itemsize for buf in b._pipeline.buffers)
    for step, kind in enumerate(KINDS):
        what = f"{dtype} {kw} clip {clip} step {step} ({kind})"
        read = files.traffic()["read"]
        norms = [_one_step(model, opt, rank, world, step, kind, clip) for model, opt in ((plain, a), (tiered, b))]
        assert norms[0] == norms[1] or norms[0] != norms[0] and norms[1] != norms[1], f"{what}: norms {norms}"
        assert a.skipped_steps == b.skipped_steps, what
        assert files.traffic()["read"] - read >= shard_bytes, what  # every bucket's gradients read by the update
        if kind == "plain" and not kw:  # one reduction per bucket: the statistics read nothing more
            assert files.traffic()["read"] - read == shard_bytes, what
        _on_disk_only(b)
        assert_same(a, b, plain, tiered, what)
    assert a.skipped_steps >= 1, "the schedule must skip a step"
    root = b._pipeline.tier.root
    b.pipeline.close()
    assert not root.exists(), "the files outlived the pipeline's close()"


def _pairs_ranks(rank: int, world: int, scratch: str) -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        pair(rank, world, Path(scratch) / str(dtype), dtype)
    pair(rank, world, Path(scratch) / "accum", torch.bfloat16, gradient_accumulation_steps=2)
    pair(rank, world, Path(scratch) / "wide", torch.bfloat16, gradient_accumulation_steps=2, grad_accum_dtype="fp32")
    pair(rank, world, Path(scratch) / "clip", torch.bfloat16, clip=False)  # clip_grad_norm_ measures


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2], ids=lambda w: f"world{w}")
def test_gradients_in_files_train_bit_for_bit_as_without_offload(world: int, tmp_path: Path) -> None:
    run_ranks(_pairs_ranks, world, str(tmp_path), timeout_s=420.0)


# ---------------------------------------------------------------- a window saved and resumed
def _window_ranks(rank: int, world: int, scratch: str) -> None:
    """Saved after the first micro-step of a 2-step window (fp32 sums of bf16 gradients: in the files), resumed
    with the gradients in files and without offload; both continue as the uninterrupted run."""
    root = Path(scratch)
    kw = dict(gradient_accumulation_steps=2, grad_accum_dtype="fp32")

    def run(offload: Optional[dict], resume: Optional[dict] = None, *, save: bool = False):
        """Three steps with ``offload``; ``save``: stop at the window's middle, saved; ``resume``: load there into
        a new model and optimizer with ``resume`` (an empty dict: no offload)."""
        torch.manual_seed(0)
        model = Net().to(torch.bfloat16)
        opt = _opt(model, offload, torch.bfloat16, **kw)
        for step in range(3):
            x = batch(step, 2 * world * ROWS)
            for m in range(2):
                _backward(model, opt, x[(m * world + rank) * ROWS : (m * world + rank + 1) * ROWS], None)
                if step == 1 and m == 0 and save:
                    ck.save(root / "window", model, opt)
                    return None
                if step == 1 and m == 0 and resume is not None:
                    torch.manual_seed(1)
                    model = Net().to(torch.bfloat16)
                    opt = _opt(model, resume or None, torch.bfloat16, **kw)
                    ck.load(root / "window", model, opt)
                opt.step()
            opt.zero_grad()
        return model, opt

    run(_disk(root / f"saved{rank}"), save=True)
    expected_model, expected = run(None)
    for resume in (_disk(root / f"resumed{rank}"), {}):
        model, opt = run(None, resume)
        assert_same(expected, opt, expected_model, model, f"resumed with {resume or 'no offload'}")


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2], ids=lambda w: f"world{w}")
def test_a_window_saved_with_gradients_in_files_resumes_exactly(world: int, tmp_path: Path) -> None:
    run_ranks(_window_ranks, world, str(tmp_path), timeout_s=300.0)


class _Reordered:
    """A write that finishes in the worst order the engine's workers allow: only when waited for, after every later
    write to the same file still pending (``_reordered_writes``)."""

    def __init__(self, pending: list, path: Path, start) -> None:
        self._pending, self._path, self._start, self._handle = pending, path, start, None
        pending.append(self)

    def _run(self) -> None:
        if self._handle is None:
            self._handle = self._start()
            self._handle.wait()
            self._pending.remove(self)

    def wait(self) -> None:
        if self._handle is None:
            later = self._pending[self._pending.index(self) + 1 :]
            for write in reversed([w for w in later if w._path == self._path]):
                write._run()
            self._run()

    def done(self) -> bool:
        return self._handle is not None


def _reordered_writes(monkeypatch) -> None:
    """The gradient files' writes finish in reverse order (``_Reordered``)."""
    pending: list[_Reordered] = []

    write = FileIO.write

    def reordered(self, path: Path, tensor: torch.Tensor, offset: int = 0):
        if not str(path).endswith(".grads"):
            return write(self, path, tensor, offset)
        return _Reordered(pending, path, lambda: write(self, path, tensor, offset))

    monkeypatch.setattr(FileIO, "write", reordered)


def test_a_window_loaded_over_writes_in_flight_keeps_the_loaded_sums(tmp_path: Path, monkeypatch) -> None:
    """A window loaded into the optimizer right after a backward: the files take the loaded sums after backward's
    writes still in flight, which must not land over them (the next update would use that backward's sums).
    Writes here finish in reverse order; weights and state bit for bit those without offload."""
    _reordered_writes(monkeypatch)
    plain, tiered, a, b = _pair({**_disk(tmp_path / "nvme"), "buffer_count": 4}, gradient_accumulation_steps=2)
    for name, model, opt in (("plain", plain, a), ("tiered", tiered, b)):
        _backward(model, opt, batch(0, ROWS), None)
        ck.save(tmp_path / name, model, opt)  # inside the window
        opt.step()
        _backward(model, opt, batch(1, ROWS), None)
        ck.load(tmp_path / name, model, opt)  # backward's writes still in flight
        opt.step()
        _backward(model, opt, batch(2, ROWS), None)
        opt.step()
        opt.zero_grad()
    assert_same(a, b, plain, tiered, "after the load")


def test_a_dropped_windows_writes_in_flight_do_not_land_over_the_next_backwards(tmp_path: Path, monkeypatch) -> None:
    """A backward whose gradients ``zero_grad()`` drops without a step (a GAN's discriminator after the generator's
    backward), then the backward the step uses: each bucket's first write of the new window waits for its write of
    the dropped one, else that could land later (the update would use the dropped gradients). Writes here finish in
    reverse order; weights and state bit for bit those without offload."""
    _reordered_writes(monkeypatch)
    plain, tiered, a, b = _pair({**_disk(tmp_path), "buffer_count": 8})
    for step in range(2):
        for model, opt in ((plain, a), (tiered, b)):
            _backward(model, opt, batch(10 + step, ROWS), None)
            opt.zero_grad()
            _backward(model, opt, batch(step, ROWS), None)
            opt.step()
            opt.zero_grad()
        assert_same(a, b, plain, tiered, f"step {step}")


@pytest.mark.parametrize("io,nth", [("write", 1), ("read", 1), ("write", 7), ("write", 8)])
def test_a_failed_gradient_file_request_is_raised_and_training_goes_on(
    io: str, nth: int, tmp_path: Path, monkeypatch
) -> None:
    """One request on the gradients' files fails (EIO) in a backward (the ``nth`` write of a bucket's sum, or the first
    read back in the window's second micro-step): the backward raises it, the loop drops the window (``zero_grad()``)
    and goes on, bit for bit as the same run whose window was dropped without a failure. Before, the failed request's
    pool buffer was never given back (every later step raised a KeyError from the pool), and a failed write was raised
    again by the next wait for the file's writes, in a later window. A late bucket's write (7, 8) is raised in the
    second micro-step by the read ahead, or the write, of another part of its file, which waits for it: that part's
    buffer was left held with nothing to give it back (a KeyError from the pool when the next backward took it)."""
    import errno

    from zero_kernels.offload.aio import IOHandle

    plain, tiered, a, b = _pair(_disk(tmp_path))
    real, seen = getattr(FileIO, io), []

    def failing(self, path, tensor, offset=0):
        if str(path).endswith(".grads"):
            seen.append(path)
            if len(seen) == nth:
                return IOHandle(str(path), tensor, lambda: (errno.EIO, io), lambda: True)
        return real(self, path, tensor, offset)

    for step in range(4):
        for model, opt in ((plain, a), (tiered, b)):
            if step == 1:  # the run without offload drops the window it ran whole
                with monkeypatch.context() as patched:
                    if opt is b:
                        patched.setattr(FileIO, io, failing)
                    with contextlib.nullcontext() if opt is a else pytest.raises(OSError, match="Input/output"):
                        for micro in range(2):
                            _backward(model, opt, batch(20 + micro, ROWS), None)
                opt.zero_grad()
                continue
            _backward(model, opt, batch(step, ROWS), None)
            opt.step()
            opt.zero_grad()
    assert len(seen) >= nth
    assert_same(a, b, plain, tiered, "after the failure")


def test_a_disk_without_room_for_the_gradients_is_refused_naming_the_key(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)).to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with _tmpfs(tmp_path / "small", "size=64k") as small:  # 128 KiB of gradients for the first unit
        with pytest.raises(OSError, match=r"offload_optimizer could not start: .*offload_optimizer.nvme_path: "
                           r"cannot reserve \d+ bytes in .*u\d\.grads' \(the gradient shard of"):  # fmt: skip
            zo.ShardedFusedAdam(model, lr=1e-2, stage=3, offload_optimizer={"device": "nvme", "nvme_path": str(small)},
                                stage3_param_persistence_threshold=0)  # fmt: skip
        assert not list(small.glob("zero_kernels/*"))  # every file reserved is removed
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_the_files_hold_the_reduced_gradients_bit_for_bit(tmp_path: Path) -> None:
    """After a backward the gradient files hold, byte for byte, the resident shard of the same run without offload
    (read back from the disk, not through the optimizer)."""
    plain, tiered, a, b = _pair(_disk(tmp_path))
    for model, opt in ((plain, a), (tiered, b)):
        _backward(model, opt, batch(0, 2 * ROWS), local(extra_rows(0, 1), 0, 3))
    files = b._pipeline.disk_grads.files
    files.finish()
    for ours, theirs in zip(b._pipeline.buffers, a._pipeline.buffers):
        path, dtype = files.paths[id(ours)]
        on_disk = torch.frombuffer(bytearray(path.read_bytes()), dtype=dtype)
        assert on_disk.numel() == theirs.grad_shard.numel() and theirs.grad_shard.abs().sum() > 0
        assert torch.equal(on_disk.view(torch.int16), theirs.grad_shard.view(torch.int16)), path.name


def test_the_statistics_are_taken_at_the_last_micro_step_of_a_window(tmp_path: Path, monkeypatch) -> None:
    """With ``gradient_accumulation_steps`` 3 a micro-step before the window's last takes no statistics of the files'
    values (the next micro-step changes them): each bucket's terms are taken once per update, by the last micro-step's
    reduction, and the step's clipping reads nothing more than the update. A window whose last micro-step has no
    backward (its terms not taken) is clipped by the files' values. Weights bit for bit those without offload."""
    counted = [0]
    partial = disk_grads_module.stats.partial

    def counting(values: torch.Tensor, *, norm: bool) -> torch.Tensor:
        counted[0] += 1
        return partial(values, norm=norm)

    monkeypatch.setattr(disk_grads_module.stats, "partial", counting)
    plain, tiered, a, b = _pair(_disk(tmp_path), gradient_accumulation_steps=3)
    files = b._pipeline.disk_grads.files
    shard_bytes = sum(buf.layout.shard_numel * buf.grad_shard.dtype.itemsize for buf in b._pipeline.buffers)
    buckets = sum(len(buf.layout.buckets) for buf in b._pipeline.buffers)
    for step in range(3):
        x = batch(step, 3 * ROWS)
        read = files.traffic()["read"]
        for m in range(3 if step != 1 else 2):  # step 1: the last micro-step has no backward
            _backward(plain, a, x[m * ROWS : (m + 1) * ROWS], None)
            counted[0] = 0
            _backward(tiered, b, x[m * ROWS : (m + 1) * ROWS], None)
            kinds = len(b._pipeline.disk_grads.wanted)  # the kinds the last step asked for (both before the first)
            assert counted[0] == (kinds * buckets if m == 2 else 0), f"step {step} micro-step {m}: {counted[0]} terms"
            a.step()
            counted[0] = 0
            b.step()
            assert counted[0] == 0, f"step {step} micro-step {m}: {counted[0]} terms at its step()"
        if step == 1:  # the window's last micro-step, without a backward: the terms from the files
            a.step()
            counted[0] = 0
            b.step()
            assert counted[0] == kinds * buckets, f"step {step}: {counted[0]} terms at the step"
        if step != 1:  # the micro-steps' sums read back twice, and the update's reads: no statistics read
            assert files.traffic()["read"] - read == 3 * shard_bytes, f"step {step}"
        for opt in (a, b):
            opt.zero_grad()
        assert_same(a, b, plain, tiered, f"step {step}")


def test_a_micro_step_finds_its_bucket_sums_read_ahead(tmp_path: Path, monkeypatch) -> None:
    """From the second micro-step of a window on, each bucket's sum so far is read back before its reduction adds to
    it: the read of the bucket reduced next (in the first micro-step's order) starts when one completes, into a free
    pool buffer, so that backward computes meanwhile; every reduction after a micro-step's first finds its read
    started. Nothing more is read, and the weights are those without offload bit for bit."""
    found: list[bool] = []
    reduced = disk_grads_module.DiskGrads.reduced

    def recording(self, buf, bucket, mine, first, **kw) -> None:
        if not first:
            found.append((id(buf), bucket.index) in self._ahead)
        reduced(self, buf, bucket, mine, first, **kw)

    monkeypatch.setattr(disk_grads_module.DiskGrads, "reduced", recording)
    plain, tiered, a, b = _pair({**_disk(tmp_path), "buffer_count": 4}, gradient_accumulation_steps=3)
    files = b._pipeline.disk_grads.files
    shard_bytes = sum(buf.layout.shard_numel * buf.grad_shard.dtype.itemsize for buf in b._pipeline.buffers)
    buckets = sum(len(buf.layout.buckets) for buf in b._pipeline.buffers)
    assert buckets >= 3, "the model must have several buckets"
    for step in range(2):
        x = batch(step, 3 * ROWS)
        read = files.traffic()["read"]
        for m in range(3):
            found.clear()
            for model, opt in ((plain, a), (tiered, b)):
                _backward(model, opt, x[m * ROWS : (m + 1) * ROWS], None)
                opt.step()
            if m:
                assert found == [False] + [True] * (buckets - 1), f"step {step} micro-step {m}: {found}"
        assert files.traffic()["read"] - read == 3 * shard_bytes, f"step {step}"
        for opt in (a, b):
            opt.zero_grad()
        assert_same(a, b, plain, tiered, f"step {step}")


def test_the_update_finds_the_gradients_read_ahead(tmp_path: Path, monkeypatch) -> None:
    """The update's reads of the gradient files run ahead of use from its first bucket on: the buffers whose writes
    (backward's) have finished go back to the pool first, so every bucket after the first finds its read started."""
    found: list[bool] = []
    step = disk_grads_module.DiskGrads.step

    def recording(self, buf, bucket) -> torch.Tensor:
        found.append((id(buf), bucket.index) in self._ahead)
        return step(self, buf, bucket)

    monkeypatch.setattr(disk_grads_module.DiskGrads, "step", recording)
    plain, tiered, a, b = _pair({**_disk(tmp_path), "buffer_count": 4})
    buckets = sum(len(buf.layout.buckets) for buf in b._pipeline.buffers)
    for step_index in range(2):
        found.clear()
        for model, opt in ((plain, a), (tiered, b)):
            _backward(model, opt, batch(step_index, ROWS), None)
            b._pipeline.disk_grads.files.finish()  # backward's writes done, as when the step comes later
            opt.step()
            opt.zero_grad()
        assert found == [False] + [True] * (buckets - 1), f"step {step_index}: {found}"
        assert_same(a, b, plain, tiered, f"step {step_index}")


def _one_bucket_pair(
    path: Path, **kw
) -> tuple[torch.nn.Module, torch.nn.Module, zo.ShardedFusedAdam, zo.ShardedFusedAdam]:
    """(plain, tiered, a, b): a seeded bf16 ``Linear`` of one bucket at stage 3, trained by ``a`` without offload and
    by ``b`` with the state and the gradients on disk."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(6, 3, bias=False).to(torch.bfloat16)
    tiered = copy.deepcopy(plain)
    a, b = (zo.ShardedFusedAdam(model, lr=2e-2, stage=3, stage3_param_persistence_threshold=0, **kw,
                                **({} if offload is None else {"offload_optimizer": offload}))
            for model, offload in ((plain, None), (tiered, _disk(path))))  # fmt: skip
    assert sum(len(buf.layout.buckets) for buf in b._pipeline.buffers) == 1
    return plain, tiered, a, b


def test_a_bucket_reduced_first_after_zero_grad_reads_nothing_of_itself_ahead(tmp_path: Path) -> None:
    """One bucket: ``zero_grad(set_to_none=False)`` between backward and step makes the step reduce it again (zeros),
    first after being the last reduced, so it follows itself in the order reads ahead follow. Its reductions after
    a later window's first (a second backward before the step) must not start a read of its own part ahead of
    their write: the update would use the sum before that backward. Weights bit for bit those without offload."""
    plain, tiered, a, b = _one_bucket_pair(tmp_path, max_grad_norm=CLIP)
    for step in range(3):
        for model, opt in ((plain, a), (tiered, b)):
            for micro in range(1 if step == 0 else 2):
                model(batch(3 * step + micro, ROWS).to(torch.bfloat16)).float().square().mean().backward()
            if step == 0:
                opt.zero_grad(set_to_none=False)
            opt.step()
            opt.zero_grad()
        assert_same(a, b, plain, tiered, f"step {step}")


def test_a_bucket_reduced_first_twice_in_a_window_reads_nothing_of_itself_ahead(tmp_path: Path) -> None:
    """One bucket: a backward dropped by ``zero_grad()``, then three backward passes before the step. The first of
    them makes the bucket follow itself in the order reads ahead follow (it was the last reduced before
    ``zero_grad()``); the second must not start a read of its own part ahead of its write, or the third adds to the
    sum before the second (the step misses a backward). Weights bit for bit those without offload."""
    plain, tiered, a, b = _one_bucket_pair(tmp_path)
    for step in range(2):
        for model, opt in ((plain, a), (tiered, b)):
            model(batch(10 + step, ROWS).to(torch.bfloat16)).float().square().mean().backward()
            opt.zero_grad()
            for micro in range(3):
                model(batch(3 * step + micro, ROWS).to(torch.bfloat16)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert_same(a, b, plain, tiered, f"step {step}")


def test_no_read_ahead_follows_a_link_from_a_window_before(tmp_path: Path, monkeypatch) -> None:
    """A step after ``zero_grad(set_to_none=False)`` reduces every bucket again (zeros), after the last one reduced,
    so the order reads ahead follow links that last bucket to the first. A later window's order is its own first
    micro-step's: its last bucket starts no read of the first (the step's zeros would drop it unused)."""
    dropped = [0]
    drop = disk_grads_module.DiskGrads._drop

    def counting(self, key) -> None:
        dropped[0] += 1
        drop(self, key)

    monkeypatch.setattr(disk_grads_module.DiskGrads, "_drop", counting)
    plain, tiered, a, b = _pair({**_disk(tmp_path), "buffer_count": 4})
    for step in range(3):
        for model, opt in ((plain, a), (tiered, b)):
            for micro in range(2):
                _backward(model, opt, batch(3 * step + micro, ROWS), None)
            opt.zero_grad(set_to_none=False)
            opt.step()
        assert dropped[0] == 0, f"step {step}: {dropped[0]} reads started ahead and dropped unused"
        assert_same(a, b, plain, tiered, f"step {step}")
