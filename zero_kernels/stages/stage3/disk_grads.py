"""Stage 3's reduced gradient shards in files, with the optimizer state on disk (``offload_optimizer`` on nvme,
``ratio`` 1), as DeepSpeed's stage 3 swaps each sub-group's gradients out to NVMe with its state (ZeRO-Infinity).

Files. One per buffer: ``u<n>.grads`` in the state tier's run directory (under ``offload_optimizer.nvme_path``),
this rank's gradient shard in the dtype the stage keeps it in (``Pipeline.accumulate_dtype_of``), its bytes
reserved when the buffer is added (a disk without room raises ``OSError`` naming the key). Bytes move through the
tier's engine, and the files go with the tier's (``close``, a killed run). ``buf.grad_shard`` is a ``meta``
stand-in of the shard's size and dtype.

Backward. When a bucket's reduction completes (``reduced``) this rank's part goes into a pool buffer
(``offload.ShardFiles``: ``offload_optimizer.buffer_count`` page-aligned buffers of the largest bucket part),
the terms of the step's gradient column are taken from those final values (``stats.partial``: the squared
norm, the finiteness sum, or both: the kinds the last step asked for, both before the first step), and the
buffer is written to the file in the background (after the part's write before: ``ShardFiles.write``), back in the
pool once written. A bucket reduced again before the step (a late gradient; every accumulation
micro-step) reads its part back (started when the bucket before it in the window's first micro-step was reduced:
``_read_next``), adds, takes the terms again (but not on a micro-step before the window's last,
``Pipeline.window_ends``: the next one replaces them) and writes; ``zero`` writes zeros where no reduction wrote
(``grad_state.zero_unwritten``).

Step. The statistics sum the terms in bucket order (``column``: ``stats.grad_column``'s value bit for bit,
with no read of the gradients; a kind of term not taken, as when ``clip_grad_norm_`` is first called, is
computed from the file's values, the same ones). The update asks for each bucket's part in the step's order
(``step``): read ahead into free pool buffers as the update goes, given back by ``used``. Rare paths read or
write a whole shard at once: ``whole`` (a window saved inside an accumulation window) and ``assign`` (a
window restored); ``read`` (one bucket's part, for ``Pipeline.grad_shard`` called from outside the update).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

from ...offload.aio import IOHandle
from ...offload.mapped import mapped_empty
from ...offload.shard_files import Lease, ShardFiles
from .. import stats
from ..eager import weakly
from ..layout import Bucket

if TYPE_CHECKING:
    from ..buffers import FlatBuffer

Key = tuple[int, int]  # (id(buffer), bucket index)


class DiskGrads:
    """The gradient shards' files of one stage-3 pipeline (see the module docstring).

    Args:
        files: the files and their pool (in the state tier's directory, through its engine).
    """

    def __init__(self, files: ShardFiles):
        self.files = files
        self.order: list[tuple["FlatBuffer", Bucket]] = []  # every bucket, in the step's order
        self.terms: dict[Key, dict[bool, torch.Tensor]] = {}  # norm (True: squared norm, False: finiteness) -> term
        self.wanted = {True, False}  # the kinds of term taken as buckets are reduced
        self._asked: set[bool] = set()  # the kinds asked for since the last step
        self._at: dict[Key, int] = {}  # its place in ``order``
        self._writing: dict[int, tuple[Lease, IOHandle, int]] = {}  # id(lease) -> (lease, its write, its file)
        self._ahead: dict[Key, tuple[Lease, IOHandle]] = {}  # reads started before use (update, accumulation)
        self._after: dict[Key, Key] = {}  # the bucket reduced next, in the order of a window's first micro-step
        self._last: Optional[Key] = None  # the last bucket of that order so far
        self._using: dict[Key, Lease] = {}  # what the update reads now

    # ---------------------------------------------------------------- setting up
    def add(self, buf: "FlatBuffer", dtype: torch.dtype, name: str) -> None:
        """Reserve the file of ``buf``'s gradient shard (``dtype``; ``name``: the unit, for errors)."""
        self.files.add(id(buf), buf.layout.shard_numel, dtype, f"the gradient shard of {name}")
        self.files.fit(max((b.shard_numel for b in buf.layout.buckets), default=0) * dtype.itemsize)
        buf.grad_shard = torch.empty(buf.layout.shard_numel, dtype=dtype, device="meta")
        for bucket in buf.layout.buckets:
            self._at[(id(buf), bucket.index)] = len(self.order)
            self.order.append((buf, bucket))

    def remove(self, buf: "FlatBuffer") -> None:
        """Forget a buffer that could not be set up (``add_param_group`` on a disk without room): its file removed, its
        buckets out of the step's order; nothing of it if it has no file."""
        if id(buf) not in self.files.paths:
            return
        self.files.remove(id(buf))
        self.order = [(b, k) for b, k in self.order if b is not buf]
        self._at = {(id(b), k.index): i for i, (b, k) in enumerate(self.order)}
        for key in [k for k in self.terms if k[0] == id(buf)]:
            del self.terms[key]

    # ---------------------------------------------------------------- backward
    def reduced(
        self, buf: "FlatBuffer", bucket: Bucket, mine: torch.Tensor, first: bool, *, final: bool = True
    ) -> None:
        """A reduction of ``bucket`` completed (``mine``: this rank's part): the first since the step is the part's
        value, a later one is added to it (read back from the file). ``final`` False: an accumulation micro-step
        before the window's last, whose sum the next one changes: no terms taken (a step that comes first computes
        them from the file)."""
        key = (id(buf), bucket.index)
        if first:
            self._forget(key)
            self._after.pop(key, None)  # its successor in this window's order, if any, is set when it comes
            if self._last is not None:
                self._after[self._last] = key
            self._last = key
            lease = self._take(buf, bucket)
            values = lease.tensor if buf.device.type == "cpu" else torch.empty_like(lease.tensor, device=buf.device)
            values.copy_(mine)
        else:
            lease, read = self._ahead.pop(key, None) or self._start(buf, bucket, wait=True)
            self.files.hold(lease, weakly(self._written, id(lease)))  # written from it next
            try:
                self._read_next(key)  # may raise a failed write of the file, which its read waits for
                read.wait()
            except OSError:
                with contextlib.suppress(OSError):
                    read.wait()  # nothing reads into the buffer any more
                self.files.put(lease)  # not written from: back at once
                raise
            values = lease.tensor.to(buf.device).add_(mine)
        self._store(buf, bucket, lease, values, terms=final)

    def _read_next(self, key: Key) -> None:
        """Start reading the sum of the bucket reduced after ``key`` (in the window's first micro-step) into a free
        pool buffer, so that its reduction finds it read: the read runs while backward computes. Not ``key`` itself
        (its part is written next: a read started now would hold the sum before it), which follows itself when it was
        the last bucket reduced before ``zero_grad()`` and the first after."""
        after = self._after.get(key)
        if after is None or after == key or after in self._ahead or after not in self._at:
            return
        self._reclaim()
        self._start(*self.order[self._at[after]], wait=False)

    def _reclaim(self) -> None:
        """Put the buffers whose writes finished back in the pool (else they wait there for a ``take`` that must
        wait, and reads ahead, which take only free buffers, find none)."""
        for held in [held for held, (_, write, _) in self._writing.items() if write.done()]:
            self._written(held)

    def _forget(self, key: Key) -> None:
        """A read started ahead of ``key``'s part goes (the part is about to be written)."""
        if key in self._ahead:
            self._drop(key)

    def zero(self, buf: "FlatBuffer", bucket: Bucket) -> None:
        """No reduction wrote ``bucket`` since the step: its part is zeros."""
        self._forget((id(buf), bucket.index))
        lease = self._take(buf, bucket)
        self._store(buf, bucket, lease, lease.tensor.to(buf.device).zero_())

    def _take(self, buf: "FlatBuffer", bucket: Bucket) -> Lease:
        lease = self.files.take(bucket.shard_numel, self.files.paths[id(buf)][1], lambda: None)
        self.files.hold(lease, weakly(self._written, id(lease)))  # its files hold this: no reference cycle
        return lease

    def _store(
        self, buf: "FlatBuffer", bucket: Bucket, lease: Lease, values: torch.Tensor, *, terms: bool = True
    ) -> None:
        """Take the terms of the part's ``values`` (on the gradients' device; ``terms`` False: none, the ones of the
        values before dropped) and write it from ``lease`` (after the part's write before, one of a window
        ``zero_grad()`` dropped: ``ShardFiles.write``)."""
        self.terms[(id(buf), bucket.index)] = self._terms(values) if terms else {}
        if values.data_ptr() != lease.tensor.data_ptr():
            lease.tensor.copy_(values)
        try:
            write = self.files.write(id(buf), lease.tensor, bucket.shard_offset)
        except OSError:  # a failed write of the same bytes, waited for first: this one not started
            self.files.put(lease)
            raise
        self._writing[id(lease)] = (lease, write, id(buf))

    def _terms(self, values: torch.Tensor) -> dict[bool, torch.Tensor]:
        """The wanted kinds of term of a part's final ``values``. The squared norm widens 16-bit values to fp32 first
        (``stats.partial``); in host memory this widens them into a copy on a mapping of its own (the same values,
        the same term bit for bit), not into a temporary from the heap (``offload.mapped``)."""
        wide = values
        if True in self.wanted and values.device.type == "cpu" and values.dtype in (torch.bfloat16, torch.float16):
            wide = mapped_empty(values.numel(), torch.float32).copy_(values)
        return {norm: stats.partial(wide if norm else values, norm=norm) for norm in self.wanted}

    def _written(self, key: int) -> None:
        """A part's write done: its buffer goes back (after a write that failed too, whose error is raised here unless
        it was raised where the file's writes were waited for)."""
        lease, write, file = self._writing.pop(key)
        try:
            self.files.wait_write(file, write)
        finally:
            self.files.put(lease)

    # ---------------------------------------------------------------- the step
    def column(self, norm: bool) -> Iterator[torch.Tensor]:
        """Every bucket's term, in the step's order: squared norms (``norm``), else finiteness sums."""
        self._asked.add(norm)
        for buf, bucket in self.order:
            terms = self.terms[(id(buf), bucket.index)]
            if norm not in terms:  # not taken when it was reduced (or not its last reduction): from the file's values
                terms[norm] = stats.partial(self.read(buf, bucket), norm=norm)
            yield terms[norm]

    def step(self, buf: "FlatBuffer", bucket: Bucket) -> torch.Tensor:
        """This rank's gradients of ``bucket`` in host memory for the update (read ahead where a pool buffer was
        free); the next buckets' reads start here. ``used`` gives the buffer back."""
        key = (id(buf), bucket.index)
        lease, read = self._ahead.pop(key, None) or self._start(buf, bucket, wait=True)
        self.files.hold(lease, lambda: self.used(buf, bucket))
        self._using[key] = lease
        self._reclaim()
        for later, later_bucket in self.order[self._at[key] + 1 : self._at[key] + self.files.buffer_count]:
            ahead = (id(later), later_bucket.index)
            if ahead not in self._ahead and self._start(later, later_bucket, wait=False) is None:
                break
        read.wait()
        return lease.tensor

    def _start(self, buf: "FlatBuffer", bucket: Bucket, *, wait: bool) -> Optional[tuple[Lease, IOHandle]]:
        """Start reading ``bucket``'s part into a pool buffer (``wait`` False: only into a free one; None if none)."""
        key = (id(buf), bucket.index)
        dtype = self.files.paths[id(buf)][1]
        lease = self.files.take(bucket.shard_numel, dtype, lambda: self._drop(key), wait=wait)
        if lease is None:
            return None
        try:
            started = (lease, self.files.read(id(buf), lease.tensor, bucket.shard_offset))
        except OSError:  # a failed write of the file, waited for first: the read not started
            self.files.put(lease)
            raise
        if not wait:
            self._ahead[key] = started
        return started

    def _drop(self, key: Key) -> None:
        """A read started ahead goes: its buffer back once it is done (or failed, raised here)."""
        lease, read = self._ahead.pop(key)
        try:
            read.wait()
        finally:
            self.files.put(lease)

    def used(self, buf: "FlatBuffer", bucket: Bucket) -> None:
        """The update is done with ``bucket``'s gradients: their buffer goes back."""
        lease = self._using.pop((id(buf), bucket.index), None)
        if lease is not None:
            self.files.put(lease)

    def finish_step(self) -> None:
        """After the step's last bucket: every buffer back (reads ahead are dropped); the next reductions take the
        kinds of term this step asked for."""
        self.wanted, self._asked = self._asked or self.wanted, set()
        self._last = None
        for key in list(self._ahead):
            self._drop(key)
        for buf, bucket in [(b, k) for b, k in self.order if (id(b), k.index) in self._using]:
            self.used(buf, bucket)

    # ---------------------------------------------------------------- rare paths
    def read(self, buf: "FlatBuffer", bucket: Bucket) -> torch.Tensor:
        """A copy of this rank's gradients of ``bucket``, on the gradients' device."""
        part = self.files.io.empty(bucket.shard_numel, self.files.paths[id(buf)][1])
        self.files.read(id(buf), part, bucket.shard_offset).wait()
        return part.to(buf.device)

    def whole(self, buf: "FlatBuffer") -> torch.Tensor:
        """A copy of this rank's whole gradient shard of ``buf`` (host memory)."""
        shard = self.files.io.empty(buf.layout.shard_numel, self.files.paths[id(buf)][1])
        self.files.read(id(buf), shard).wait()
        return shard

    def assign(self, buf: "FlatBuffer", values: torch.Tensor) -> None:
        """Write ``values`` (a whole shard) into ``buf``'s file (after backward's writes still in flight there:
        ``ShardFiles.write``), and take every bucket's terms from them."""
        shard = self.files.io.empty(buf.layout.shard_numel, self.files.paths[id(buf)][1]).copy_(values.reshape(-1))
        on_device = shard.to(buf.device)
        for bucket in buf.layout.buckets:
            self._forget((id(buf), bucket.index))
            part = buf.shard_slice(on_device, bucket)
            self.terms[(id(buf), bucket.index)] = self._terms(part)
        self.files.write(id(buf), shard).wait()

    # ---------------------------------------------------------------- memory
    def close(self) -> None:
        """Every write done (the tier removes the files with its own)."""
        self.files.close()


def start(tier: Any) -> Optional[DiskGrads]:
    """The gradient files of a stage-3 pipeline whose state tier is the disk with all the state in it, else None."""
    if tier is None or tier.kind != "disk" or tier.config.ratio != 1.0:
        return None
    return DiskGrads(ShardFiles(tier.directory, tier.io, tier.config.buffer_count, "grads", owned=False))
