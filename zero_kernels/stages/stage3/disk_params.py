"""Stage 3's units whose parameter shard lives in a file: ``offload_param`` with ``device: nvme`` (ZeRO-Infinity),
with or without ``offload_optimizer``.

Which units. In buffer order, the units whose shards fit in ``max_in_cpu`` elements of this rank (DeepSpeed keeps
that many parameter elements in host memory and the rest on NVMe) keep their shard in host memory, as with
``device: cpu`` (the state tier's host copy with all the state offloaded, else ``host_params``); every unit from the
first that does not fit goes to a file (``offload.ParamFiles``).
Persistent units stay on the device. The shard sizes are the same on every rank, so every rank chooses the same.

Where the shard is. A file unit's ``buf.param_shard`` is a ``meta`` stand-in while its file holds it. ``resident``
reads it in whole (``Stage3Buffer.ready``: the state door, a value given to a parameter between steps, an edit
inside ``gathered_params()``); the next step writes it back and frees it. A checkpoint's save reads one unit's
shard in at a time and lets it go again (``read_briefly``: its file holds the same bytes), unless it gave the shard a
master written from outside; the end of a ``gathered_params()`` block reads every shard in before it writes any
edit back and lets go those it left as they were (``read_all_in``, ``let_go``); a checkpoint's load writes each
into its file without reading it first and lets it go (``loading``).

Gathers. ``source`` gives a unit's all-gather its shard: the resident one, or a pool buffer filled from the file
(by a read ``read_ahead`` started with the scheduler's prefetch, or one module before it, when there was one);
``done`` gives the buffer back once the gathers are waited for (the pool may also ask for it earlier: the unit
then waits for its gathers).

Step. The update (the host Adam, or the device's on a copy of the buffer: ``Stage3Pipeline.device_params``) reads
and writes each bucket's shard in a pool buffer filled from the file (``step_params``: the kernel reads the
parameters too, to adopt edits; the host Adam skips the read where it writes every element of the bucket's shard
and the file holds what a step last wrote there from the master: ``from_master``. A shard read in whole since may
hold an edit, or weights newer than a master loaded, and keeps that until a step writes every element of the bucket
from the master: one that leaves a parameter without a gradient alone writes its shard back as it was read);
``stepped`` writes it back in the background (the buffer returns to the pool when the write is done; one a step cut
short by an exception left unwritten returns unwritten, when the pool needs it or at that bucket's next update; one
whose write failed leaves its values in the unit's shard read in whole, which the gathers send and the next step
writes); ``finish_step`` waits for the writes and frees the resident shards.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch

from ...offload.param_files import ParamFiles
from ...offload.shard_files import Lease
from ..layout import Bucket
from ..master import written

if TYPE_CHECKING:
    from .pipeline import Stage3Buffer

log = logging.getLogger("zero_kernels")


def refuse_with(options: Any) -> None:
    """``offload_param`` on nvme does not combine with ZeRO++'s weight gathers (their copies follow the shard's
    tensor, which the pool reuses): raise ``ValueError`` naming the keys."""
    for key, on in (("zero_quantized_weights", bool(options.quantized_weights)),
                    ("zero_hpz_partition_size", int(options.hpz_partition_size) > 1)):  # fmt: skip
        if on:
            raise ValueError(
                f"zero_optimization.offload_param.device='nvme' does not combine with zero_optimization.{key} yet: "
                "use offload_param.device 'cpu', or turn the ZeRO++ option off"
            )


def stand_in(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """What ``param_shard`` holds while the file holds the shard."""
    return torch.empty(numel, dtype=dtype, device="meta")


def copied_up(device: torch.device) -> Optional[Any]:
    """On CUDA, an event on the current stream, which the gathers' wait ordered after the copy up of the shard they
    sent: the pool waits for it only when it hands the buffer out again, so the host does not wait for the device at
    every gather. None elsewhere (nothing to wait for)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class DiskParams:
    """The file units of one stage-3 pipeline (see the module docstring).

    Args:
        files: the shards' files and pool.
        max_in_cpu: ``offload_param.max_in_cpu``, elements of this rank's shards kept in host memory.
    """

    def __init__(self, files: ParamFiles, max_in_cpu: int):
        self.files = files
        self.room = int(max_in_cpu)
        self.units: dict[int, "Stage3Buffer"] = {}  # id(buffer) -> the file unit
        self._ahead: dict[int, tuple[Lease, Any]] = {}  # id(buffer) -> (lease, read) started ahead of its gather
        self._gathering: dict[int, Lease] = {}  # id(buffer) -> the lease its gathers read
        self._stepping: dict[tuple[int, int], Lease] = {}  # (id(buffer), bucket) -> the lease the update writes
        self._writing: dict[int, tuple[Lease, Any, "Stage3Buffer", Bucket]] = {}  # id(lease) -> (lease, write, ...)
        self._read_in: set[tuple[int, int]] = set()  # (id(buffer), bucket) read in whole since written from the master

    # ---------------------------------------------------------------- setting up
    def choose(self, buffers: list["Stage3Buffer"], name: Callable[["Stage3Buffer"], str]) -> list["Stage3Buffer"]:
        """Reserve the files of the units of ``buffers`` that go to files (see the module docstring); returns them.
        On an error the files reserved here are removed before it propagates."""
        chosen = []
        try:
            for buf in buffers:
                numel = buf.layout.shard_numel
                if numel <= self.room:
                    self.room -= numel
                    continue
                self.room = -1  # every later unit goes to a file too
                self.files.add(id(buf), numel, buf.dtype, name(buf))
                chosen.append(buf)
        except (OSError, ValueError):
            for buf in chosen:
                self.files.remove(id(buf))
            raise
        return chosen

    def discard(self, buf: "Stage3Buffer") -> None:
        """Forget a unit that could not be set up (``add_param_group`` on a disk without room): its file removed, if it
        has one."""
        self.units.pop(id(buf), None)
        if id(buf) in self.files.paths:
            self.files.remove(id(buf))

    def place(self, buf: "Stage3Buffer", shard: torch.Tensor) -> None:
        """Write a new file unit's shard (``shard``, host memory) into its file; ``param_shard`` becomes a stand-in."""
        self.files.write(id(buf), shard).wait()
        self.units[id(buf)] = buf
        buf.param_shard = stand_in(buf.layout.shard_numel, buf.dtype)
        buf.params_in = functools.partial(_read_in, weakref.ref(self), weakref.ref(buf))

    def holds(self, buf: "Stage3Buffer") -> bool:
        return id(buf) in self.units

    @staticmethod
    def in_file(buf: "Stage3Buffer") -> bool:
        return buf.param_shard is not None and buf.param_shard.device.type == "meta"

    def resident(self, buf: "Stage3Buffer") -> None:
        """Read the whole shard of a file unit into host memory (``buf.param_shard``), until the next step."""
        if not self.in_file(buf):
            return
        shard = self.files.io.empty(buf.layout.shard_numel, buf.dtype)
        self.files.read(id(buf), shard).wait()
        buf.param_shard = shard
        self._read_in.update((id(buf), bucket.index) for bucket in buf.layout.buckets)

    @contextlib.contextmanager
    def read_briefly(self, buf: "Stage3Buffer") -> Iterator[None]:
        """A block that reads ``buf``'s shard (a checkpoint's save): a shard its file holds is read in for it and let
        go after it (``let_go``). Where the buffer's master was written from outside, the block gives the parameters
        its values (``master.settle``): that shard stays read in until the next step writes it back."""
        if not self._kept_in_file(buf) or written(buf):
            yield
            return
        before = self._marks(buf)
        self.resident(buf)
        try:
            yield
        finally:
            if not self.in_file(buf):
                self.let_go(buf, before)

    def read_all_in(self, bufs: list["Stage3Buffer"]) -> dict[int, set[tuple[int, int]]]:
        """Read every shard of ``bufs`` that its file holds in whole (before a block that may write any of them: the
        end of ``gathered_params()``); returns, per buffer read in now, its buckets' marks from before (``let_go``)."""
        marks = {}
        for buf in bufs:
            if self._kept_in_file(buf):
                marks[id(buf)] = self._marks(buf)
                self.resident(buf)
        return marks

    def _marks(self, buf: "Stage3Buffer") -> set[tuple[int, int]]:
        """``buf``'s buckets read in whole since a step last wrote them from the master (``from_master``)."""
        return {key for key in self._read_in if key[0] == id(buf)}

    def let_go(self, buf: "Stage3Buffer", marks: set[tuple[int, int]]) -> None:
        """A shard ``read_all_in`` read in, which the block left as it was: back to its file (which holds those
        bytes), its buckets' marks as before (``from_master``)."""
        self._let_go(buf)
        self._read_in.difference_update({(id(buf), bucket.index) for bucket in buf.layout.buckets})
        self._read_in.update(marks)

    @contextlib.contextmanager
    def loading(self, buf: "Stage3Buffer") -> Iterator[None]:
        """A block that writes every parameter element of ``buf``'s shard (a checkpoint's load): a shard its file
        holds is made whole without a read (zeros: the layout's padding holds zeros, as the update leaves it), then
        written into its file and let go. The loaded weights may not be what their masters round to: the next update
        reads them (``_read_in``) to adopt them. A write that fails keeps the shard read in for the next step to
        write, with a warning. A block that raises (a load cut short) lets the shard go unwritten: its file holds the
        weights from before the load, which the next update reads and adopts too, never the zeros."""
        if not self._kept_in_file(buf):
            yield
            return
        if id(buf) in self._ahead:
            self._drop_ahead(id(buf))  # read for a gather before the load: stale once the file holds the load
        shard = self.files.io.empty(buf.layout.shard_numel, buf.dtype)
        buf.param_shard = shard.zero_()
        self._read_in.update((id(buf), bucket.index) for bucket in buf.layout.buckets)
        try:
            yield
        except BaseException:
            self._let_go(buf)
            raise
        try:
            self.files.wait_write(id(buf), self.files.write(id(buf), shard))
        except OSError as err:
            log.warning("zero_kernels: the loaded parameter shard stays in host memory until the next step: %s", err)
            return
        self._let_go(buf)

    def _kept_in_file(self, buf: "Stage3Buffer") -> bool:
        return id(buf) in self.units and self.in_file(buf)

    def _let_go(self, buf: "Stage3Buffer") -> None:
        buf.param_shard = stand_in(buf.layout.shard_numel, buf.dtype)

    def from_master(self, buf: "Stage3Buffer", bucket: Bucket) -> bool:
        """Whether ``bucket``'s part of the shard is in its file alone, as a step wrote it from the master."""
        return self.in_file(buf) and (id(buf), bucket.index) not in self._read_in

    # ---------------------------------------------------------------- gathers
    def read_ahead(self, buf: "Stage3Buffer") -> None:
        """Start reading the shard of a file unit into a free pool buffer for its next gather (none free: nothing)."""
        key = id(buf)
        if key not in self.units or not self.in_file(buf) or key in self._ahead or key in self._gathering:
            return
        lease = self.files.take(buf.layout.shard_numel, buf.dtype, lambda: self._drop_ahead(key), wait=False)
        if lease is None:
            return  # every pool buffer is in use: the gather reads when it starts
        self._ahead[key] = (lease, self.files.read(key, lease.tensor))

    def _drop_ahead(self, key: int) -> None:
        lease, read = self._ahead.pop(key)
        read.wait()
        self.files.put(lease)

    def source(self, buf: "Stage3Buffer", release: Callable[[], None]) -> torch.Tensor:
        """The shard a gather of ``buf`` sends; ``release`` is called when the pool needs its buffer back before
        ``done`` (it must wait for the gathers and call ``done``)."""
        key = id(buf)
        if key not in self.units or not self.in_file(buf):
            return buf.param_shard
        ahead = self._ahead.pop(key, None)
        if ahead is None:
            lease = self.files.take(buf.layout.shard_numel, buf.dtype, release)
            read = self.files.read(key, lease.tensor)
        else:
            lease, read = ahead
            self.files.hold(lease, release)
        try:
            read.wait()
        except OSError:
            self.files.put(lease)  # nothing gathers from it: back at once
            raise
        self._gathering[key] = lease
        return lease.tensor

    def done(self, buf: "Stage3Buffer") -> None:
        """The gathers of ``buf`` are over: its pool buffer goes back."""
        lease = self._gathering.pop(id(buf), None)
        if lease is not None:
            self.files.put(lease, copied_up(buf.device))

    # ---------------------------------------------------------------- the step
    def step_params(self, buf: "Stage3Buffer", bucket: Bucket, read: bool = True) -> torch.Tensor:
        """This rank's shard of ``bucket`` in host memory for the host Adam (written by it, and read unless
        ``read`` is False: the update overwrites every element, and a shard still in its file holds no edit)."""
        if not self.in_file(buf):
            return buf.shard_slice(buf.param_shard, bucket)
        left = self._stepping.pop((id(buf), bucket.index), None)
        if left is not None:
            self._back(left)
        lease = self.files.take(bucket.shard_numel, buf.dtype, lambda: None)
        self.files.hold(lease, lambda: self._back(lease))
        if read:
            try:
                self.files.read(id(buf), lease.tensor, bucket.shard_offset).wait()
            except OSError:
                self.files.put(lease)
                self._keep_failed()
                raise
        self._stepping[(id(buf), bucket.index)] = lease
        return lease.tensor

    def stepped(self, buf: "Stage3Buffer", bucket: Bucket, params: torch.Tensor, whole: bool) -> None:
        """The update wrote ``params`` (from ``step_params``; ``whole``: every element from the master): start
        writing them back to the file."""
        try:
            write = self.files.write(id(buf), params, bucket.shard_offset)
        except OSError:
            self._keep_failed()
            raise
        if whole:
            self._read_in.discard((id(buf), bucket.index))
        lease = self._stepping.pop((id(buf), bucket.index), None)
        if lease is not None:
            self._writing[id(lease)] = (lease, write, buf, bucket)

    def _back(self, lease: Lease) -> None:
        """Give a pool buffer of the update back once its write (``stepped``) is done. One that a step cut short (an
        exception in the update) left before its write goes back unwritten: the file keeps the bucket's shard as it
        was before that update. A write that failed raises, its values kept in the unit's shard read in whole
        (``_keep``)."""
        held = self._writing.pop(id(lease), None)
        try:
            if held is not None:
                try:
                    self.files.wait_write(id(held[2]), held[1])
                finally:
                    if _failed(held[1]):  # raised here, or where the file's writes were waited for
                        self._keep(held[2], held[3], lease)
        finally:
            for key in [key for key, stepping in self._stepping.items() if stepping is lease]:
                del self._stepping[key]
            self.files.put(lease)

    def _keep(self, buf: "Stage3Buffer", bucket: Bucket, lease: Lease) -> None:
        """The write of ``bucket``'s updated shard (in ``lease``) failed: the unit's shard is read in whole with those
        values in it, as if edited, so that its gathers send them and the next step writes them (the file holds the
        shard before the update, which the update would take for an edit of the parameters, undoing it in the
        master)."""
        self.resident(buf)
        buf.shard_slice(buf.param_shard, bucket).copy_(lease.tensor)

    def _keep_failed(self) -> None:
        """After an error from the files: the updates whose writes failed (that error, raised where the file's writes
        were waited for) are kept (``_keep``) and their buffers back."""
        for lease, *_ in [held for held in self._writing.values() if _failed(held[1])]:
            with contextlib.suppress(OSError):  # raised already, where it was waited for first
                self._back(lease)

    def finish_step(self) -> None:
        """After the step's last bucket: every write done, every buffer back, the resident shards freed (their
        files hold what the step wrote)."""
        for lease, *_ in list(self._writing.values()):
            self._back(lease)
        for key in list(self._ahead):
            self._drop_ahead(key)  # read before the step: stale
        self.files.finish()
        for buf in self.units.values():
            if not self.in_file(buf):
                self._let_go(buf)

    # ---------------------------------------------------------------- memory
    def resident_shards(self) -> list[torch.Tensor]:
        """The shards read in whole now (host memory, until the next step)."""
        return [buf.param_shard for buf in self.units.values() if not self.in_file(buf)]

    def close(self) -> None:
        self.files.close()


def start(options: Any, engine: Any, agree: Callable[[Optional[str]], None]) -> Optional[DiskParams]:
    """The file units' manager when ``offload_param`` is on nvme, else None; a directory that cannot be used on
    some rank raises ``OSError`` on every rank (``agree``)."""
    config = options.offload_param
    if config.device != "nvme":
        return None
    refuse_with(options)
    files: Optional[ParamFiles] = None
    problem: Optional[str] = None
    try:
        files = ParamFiles(config, options.aio, rank=engine.rank)
    except OSError as err:
        problem = str(err)
    try:
        agree(problem)
    except OSError:
        if files is not None:
            files.close()
        raise
    return DiskParams(files, config.max_in_cpu)


def _failed(write: Any) -> bool:
    """Whether a write that is done failed (waiting for it again raises its error anew)."""
    try:
        write.wait()
    except OSError:
        return True
    return False


def _read_in(owner: "weakref.ref[DiskParams]", buf: "weakref.ref[Stage3Buffer]") -> None:
    """``buf.params_in``: ``owner.resident(buf)``, both held weakly (the buffer holds this and the disk parameters
    hold the buffer: a reference cycle kept them and the files until Python's collector ran)."""
    disk, unit = owner(), buf()
    if disk is not None and unit is not None:
        disk.resident(unit)
