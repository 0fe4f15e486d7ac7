"""The disk tier: this rank's optimizer state in files under ``nvme_path``, swapped through host buffers.

Files. ``<nvme_path>/zero_kernels/<run>/rank<R>/b<buffer>.g<sub-group>.<kind>``, one per state kind (``exp_avg``,
``exp_avg_sq``, AMSGrad's ``max_exp_avg_sq``, the ``master`` of bf16/fp16 parameters) of each sub-group of each
buffer (``add_buffer``: the pipeline chooses the sub-groups), in this rank's ``run_directory.RunDirectory``: made and
checked at start (a missing or unwritable ``nvme_path`` raises ``OSError`` naming it before anything else is set
up), its files' bytes reserved on the disk (a disk without room for the state fails in ``add_buffer``, naming the
path and the bytes it needed), removed by ``close`` or, at the latest, when the tier is collected or the process
ends.

Swapping. ``buffer_count`` host buffers (slots) hold one sub-group each. ``load(key, g)`` returns
sub-group ``g``'s tensors, read from its files (waiting for a read started earlier) unless a slot holds them
already, and with ``pipeline_read`` starts reading ``g + 1`` into a free slot; ``store(key, g)`` writes it back,
in the background with ``pipeline_write``, else at once. So the host Adam of one sub-group runs while the next is
read and the previous written. A slot written back keeps its sub-group (the same bytes as its files) until it is
needed for another. Slots are put in use (their buffers allocated) while they stay within DeepSpeed's swap pool,
``buffer_count`` buffers of ``sub_group_size`` elements (sub-groups larger than that, whole buckets, fit fewer
times), and beyond it only as the swapping needs (one updated, the next read ahead, the last written).
``finish`` (the step's end) waits for every write, then, with ``pipeline_read``, starts reading the first
sub-groups the step loaded, as many as there are slots in use, into the slots holding the others: the next step
finds them read (read during its forward and backward), and where those slots hold every sub-group nothing is read
again. A slot's bytes are only ever its files' bytes or the step's new values on their way to them: every write
into the files from elsewhere (``spill``, ``add_zeros``, ``drop``, ``write_masters``, ``add_buffer``) first drops
the slots holding that buffer. ``spill``/``fill`` write and read a whole buffer (its state made resident for the
state door between steps, and put back at the next step).

I/O goes through ``FileIO`` (``aio``: the C++ engine, or its Python fallback, built by ``aio.file_io``); every
error names the file.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..config.offload import AioConfig, OffloadOptimizerConfig
from .aio import IOHandle, file_io, wait_all
from .host import HostTier
from .run_directory import RunDirectory

ELEMENT = 4  # bytes of every state element (fp32)
# Elements per staging buffer when a new buffer's masters are written (``write_masters``): 32 MiB of fp32, above
# glibc's largest mmap threshold, so the buffers are mapped and unmapped; below it they came from the heap, which
# kept 0.35 GB after initialize at 403M parameters (resident 0.77 GB after it instead of 0.41).
PIECE = 1 << 23


@dataclass
class _Slot:
    """One host buffer: the sub-group it holds (``(key, g)`` or None) and the I/O in flight on it."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    kinds: tuple[str, ...] = ()  # the state kinds it holds now
    holds: Optional[tuple[int, int]] = None
    stored: bool = False  # what it holds is written back (its files' bytes once the writes are done): evictable
    loaded: bool = False  # handed to the update by ``load`` and not stored yet: its bytes may differ from the files
    reading: list[IOHandle] = field(default_factory=list)
    writing: list[IOHandle] = field(default_factory=list)

    def wait_reads(self) -> None:
        """Every read done; one that failed (raised here, once) leaves the slot holding nothing: read again."""
        try:
            wait_all(self.reading)
        except OSError:
            self.reading = []
            self.holds, self.stored, self.loaded = None, False, False
            raise
        self.reading = []

    def wait_writes(self) -> None:
        """Every write done; one that failed (raised here, once) leaves the slot's bytes to be written again (as an
        update's not stored: ``DiskTier._store_cut_short``), the files lacking them."""
        try:
            wait_all(self.writing)
        except OSError:
            self.writing = []
            if self.holds is not None:
                self.stored, self.loaded = False, True
            raise
        self.writing = []

    def idle(self) -> bool:
        return not self.reading and all(h.done() for h in self.writing)


class DiskTier(HostTier):
    """Optimizer state in files (see the module docstring).

    Args:
        config: the ``offload_optimizer`` block (``device="nvme"``, ``nvme_path``, ``buffer_count``, ...).
        aio: the ``aio`` block (the I/O engine's knobs).
        rank: this process's rank (its directory).
        sub_group_size: ``zero_optimization.sub_group_size`` (the swap pool, with ``buffer_count``).
    """

    kind = "disk"

    def __init__(self, config: OffloadOptimizerConfig, aio: AioConfig, *, rank: int, sub_group_size: int):
        super().__init__(config)
        self.pool_numel = config.buffer_count * sub_group_size  # DeepSpeed's swap pool, in elements per state kind
        self.directory = RunDirectory(config.nvme_path, "offload_optimizer.nvme_path", rank)
        self.run, self.root = self.directory.run, self.directory.root
        self.io = file_io(aio)
        self.groups: dict[int, list[int]] = {}  # key -> element count of each sub-group
        self.names: dict[int, int] = {}  # key -> buffer number in the file names
        self.slots: list[_Slot] = [_Slot() for _ in range(config.buffer_count)]
        self.read_ahead = config.pipeline_read
        self.write_behind = config.pipeline_write
        self.order: list[tuple[int, int, tuple[str, ...]]] = []  # (key, g, kinds) this step loaded, in order
        self.last_order: list[tuple[int, int, tuple[str, ...]]] = []  # the last step's that loaded any
        self.bytes_read = 0
        self.bytes_written = 0

    # ---------------------------------------------------------------- files
    def path(self, key: int, g: int, kind: str) -> Path:
        return self.root / f"b{self.names[key]}.g{g}.{kind}"

    def add_buffer(self, key: int, group_numels: list[int], kinds: tuple[str, ...]) -> None:
        """Register a buffer's sub-groups (elements each) and reserve its files for ``kinds``: new files, which
        read zeros until written (POSIX: bytes past the end of a file that ``posix_fallocate`` or ``ftruncate``
        extends read as zeros)."""
        self.forget(key)
        self.names[key] = max(self.names.values(), default=-1) + 1
        self.groups[key] = list(group_numels)
        for kind in kinds:
            self.reserve(key, kind)

    def discard(self, key: int) -> None:
        """Forget a buffer that could not be set up (a disk without room for it): its files removed, the other buffers'
        state left in theirs."""
        if key in self.groups:
            self.forget(key)
            for path in self.root.glob(f"b{self.names[key]}.g*"):
                path.unlink(missing_ok=True)
            del self.groups[key], self.names[key]
        super().discard(key)

    def reserve(self, key: int, kind: str) -> None:
        """Make the files of state ``kind`` of a buffer, their bytes reserved on the disk."""
        needed = f"{sum(self.groups[key]) * ELEMENT} bytes in all for this buffer's {kind}"
        for g, numel in enumerate(self.groups[key]):
            self.directory.reserve(self.path(key, g, kind), numel * ELEMENT, needed)

    def disk_bytes(self) -> int:
        """Bytes of the state's files."""
        return self.directory.disk_bytes()

    # ---------------------------------------------------------------- whole buffers
    def spill(self, key: int, tensors: dict[str, torch.Tensor]) -> None:
        """Write a buffer's whole state (``{kind: its shard}``, host tensors) into its files; a write that fails raises
        once every write is done (none is left to land after later ones)."""
        self.forget(key)
        handles = []
        for kind, t in tensors.items():
            if not self.path(key, 0, kind).exists():
                self.reserve(key, kind)
            at = 0
            for g, numel in enumerate(self.groups[key]):
                handles.append(self.io.write(self.path(key, g, kind), t.narrow(0, at, numel).contiguous()))
                at += numel
            self.bytes_written += t.numel() * t.element_size()
        wait_all(handles)

    def add_zeros(self, key: int, kind: str) -> None:
        """New files of state ``kind`` of a buffer, all zeros (AMSGrad's maximum): any old ones removed, the new
        ones read zeros as reserved (``add_buffer``), without a byte written. A disk without room raises
        ``OSError`` with none of them left."""
        self.drop(key, kind)
        try:
            self.reserve(key, kind)
        except OSError:
            self.drop(key, kind)
            raise

    def drop(self, key: int, kind: str) -> None:
        """Remove the files of state ``kind`` of a buffer (those there are)."""
        self.forget(key)
        for g in range(len(self.groups[key])):
            self.path(key, g, kind).unlink(missing_ok=True)

    def write_masters(self, key: int, masters: list[tuple[int, torch.Tensor]]) -> None:
        """Write a new buffer's masters into its files ``PIECE`` elements at a time, never whole in host memory:
        ``masters`` are (element of the buffer's part in the tier, parameter values of any dtype), widened to
        fp32 on the way through two staging buffers. Its moments need no writes: new files read zeros as
        reserved (``add_buffer``)."""
        if not masters:
            return
        self.forget(key)
        ends = list(itertools.accumulate(self.groups[key]))
        staging = [self.io.empty(min(PIECE, ends[-1]), torch.float32) for _ in range(2)]
        writes: list[Optional[IOHandle]] = [None, None]
        handles = []
        for start, values in masters:
            flat, done = values.reshape(-1), 0
            while done < flat.numel():
                at = start + done
                g = bisect.bisect_right(ends, at)
                n = min(PIECE, flat.numel() - done, ends[g] - at)
                i = len(handles) % 2
                if writes[i] is not None:
                    writes[i].wait()  # its staging buffer is written again now
                piece = staging[i].narrow(0, 0, n)
                piece.copy_(flat.narrow(0, done, n))
                offset = (at - ends[g] + self.groups[key][g]) * ELEMENT  # from the start of sub-group g
                writes[i] = self.io.write(self.path(key, g, "master"), piece, offset)
                handles.append(writes[i])
                done += n
            self.bytes_written += flat.numel() * ELEMENT
        wait_all(handles)

    def fill(self, key: int, tensors: dict[str, torch.Tensor]) -> None:
        """Read a buffer's whole state from its files into ``{kind: host tensor}``."""
        self._write_back()
        handles = []
        for kind, t in tensors.items():
            at = 0
            for g, numel in enumerate(self.groups[key]):
                handles.append(self.io.read(self.path(key, g, kind), t.narrow(0, at, numel)))
                at += numel
            self.bytes_read += t.numel() * t.element_size()
        for h in handles:
            h.wait()

    # ---------------------------------------------------------------- sub-groups, swapped
    def load(self, key: int, g: int, kinds: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """Sub-group ``g`` of buffer ``key`` in a slot (``{kind: tensor}``), for the update to change and
        ``store``; reads the next one ahead."""
        if not self.order or self.order[-1][:2] != (key, g):  # each bucket of the sub-group loads it
            self.order.append((key, g, kinds))
        self._store_cut_short(but=(key, g))  # also where a load before raised there (a write failed again)
        slot = self._held(key, g, kinds)
        if slot is None:
            slot = self._start_read(key, g, kinds)
        slot.wait_reads()
        slot.wait_writes()  # a slot kept from the last step: the update writes into it now
        slot.stored, slot.loaded = False, True
        if self.read_ahead and g + 1 < len(self.groups[key]) and self._holding(key, g + 1) is None:
            free = self._free_slot(block=False, keep=slot)
            if free is not None:
                self._start_read(key, g + 1, kinds, free)
        numel = self.groups[key][g]
        return {kind: slot.tensors[kind].narrow(0, 0, numel) for kind in kinds}

    def store(self, key: int, g: int) -> None:
        """Write sub-group ``g`` back from its slot (in the background with ``pipeline_write``); the slot keeps it."""
        slot = self._holding(key, g)
        numel = self.groups[key][g]
        for kind in slot.kinds:
            slot.writing.append(self.io.write(self.path(key, g, kind), slot.tensors[kind].narrow(0, 0, numel)))
            self.bytes_written += numel * ELEMENT
        slot.stored, slot.loaded = True, False
        if not self.write_behind:
            slot.wait_writes()

    def finish(self) -> None:
        """The step's end: every read and write done; with ``pipeline_read`` the next step's first sub-groups read
        ahead (see the module docstring)."""
        self._settle()
        if self.order:
            self.last_order, self.order = self.order, []
        if self.read_ahead:
            self._read_next()

    def _settle(self) -> None:
        """Every read and write done (``_write_back`` first)."""
        self._write_back()
        for slot in self.slots:
            slot.wait_reads()

    def _write_back(self) -> None:
        """``_store_cut_short``, then every write waited for: the files hold what the slots do."""
        self._store_cut_short()
        for slot in self.slots:
            slot.wait_writes()

    def _store_cut_short(self, but: Optional[tuple[int, int]] = None) -> None:
        """Store every slot an update loaded and did not store, but the one holding ``but``: a step cut short by an
        exception left it so; its new values go to the files, the state partly updated as the parameters are."""
        for slot in self.slots:
            if slot.loaded and slot.holds != but:
                self.store(*slot.holds)

    def _read_next(self) -> None:
        """Start reading the first sub-groups of the last step's order (one per slot the step used) that no slot
        holds, into used slots holding none of them."""
        used = [s for s in self.slots if s.tensors]
        wanted = [(key, g, kinds) for key, g, kinds in self.last_order[: len(used)] if g < len(self.groups[key])]
        keep = {(key, g) for key, g, _ in wanted}
        for key, g, kinds in wanted:
            if self._held(key, g, kinds) is not None:
                continue
            slot = next((s for s in used if s.holds is None or s.holds not in keep), None)
            if slot is None:
                return
            self._drop(slot)
            self._start_read(key, g, kinds, slot)

    def forget(self, key: int) -> None:
        """Empty the slots holding sub-groups of buffer ``key`` (its files are about to be written elsewhere)."""
        self._write_back()
        for slot in self.slots:
            if slot.holds is not None and slot.holds[0] == key:
                self._drop(slot)

    @staticmethod
    def _drop(slot: _Slot) -> None:
        slot.wait_reads()
        slot.wait_writes()
        slot.holds, slot.stored, slot.loaded = None, False, False

    def _holding(self, key: int, g: int) -> Optional[_Slot]:
        return next((s for s in self.slots if s.holds == (key, g)), None)

    def _held(self, key: int, g: int, kinds: tuple[str, ...]) -> Optional[_Slot]:
        """The slot holding sub-group ``g`` of ``key`` with the state ``kinds``; one holding it with other kinds
        (AMSGrad's maximum switched on or off since) is emptied."""
        slot = self._holding(key, g)
        if slot is not None and slot.kinds != kinds:
            self._drop(slot)
            return None
        return slot

    def _free_slot(self, *, block: bool, keep: Optional[_Slot] = None) -> Optional[_Slot]:
        """A slot whose writes are done (emptied): one in use that holds nothing, else one never used while the
        slots in use stay within the pool (``_pool_slots``), else one holding a written-back sub-group, else one
        never used (the swapping needs it); ``block``: wait for the oldest writes (or drop a read ahead) when there
        is none."""
        room = sum(1 for s in self.slots if s.tensors) < self._pool_slots()
        passes = (lambda s: s.holds is None and s.tensors, lambda s: room and not s.tensors, lambda s: s.stored,
                  lambda s: s.holds is None)  # fmt: skip
        for evictable in passes:
            for s in self.slots:
                if s is not keep and evictable(s) and s.idle():
                    self._drop(s)
                    return s
        if not block:
            return None
        for s in self.slots:
            if s is not keep and (s.holds is None or s.stored):
                self._drop(s)
                return s
        victim = next(s for s in self.slots if s is not keep)
        self._drop(victim)
        return victim

    def _pool_slots(self) -> int:
        """How many slots may keep sub-groups: as many of the largest sub-group as ``buffer_count`` buffers of
        ``sub_group_size`` elements hold (DeepSpeed's swap pool; a bucket over ``sub_group_size`` is a sub-group of its
        own, so fewer), at least one."""
        largest = max((n for groups in self.groups.values() for n in groups), default=1)
        return max(1, min(len(self.slots), self.pool_numel // max(largest, 1)))

    def _start_read(self, key: int, g: int, kinds: tuple[str, ...], slot: Optional[_Slot] = None) -> _Slot:
        """Start reading sub-group ``g`` of ``key`` into ``slot`` (an emptied one: ``_drop``; default: a free one);
        the slot holds it once every read is submitted."""
        slot = slot or self._free_slot(block=True)
        numel = self.groups[key][g]
        size = max(n for groups in self.groups.values() for n in groups)
        for kind in kinds:
            if kind not in slot.tensors or slot.tensors[kind].numel() < size:
                slot.tensors[kind] = self.io.empty(size, torch.float32)
        reading: list[IOHandle] = []
        try:
            for k in kinds:
                reading.append(self.io.read(self.path(key, g, k), slot.tensors[k].narrow(0, 0, numel)))
        except BaseException:  # (an interrupt) the slot holds nothing: none of its bytes may pass for the sub-group's
            _wait_quietly(reading)
            raise
        slot.kinds, slot.holds, slot.reading = kinds, (key, g), reading
        self.bytes_read += numel * ELEMENT * len(kinds)
        return slot

    def host_tensors(self) -> list[torch.Tensor]:
        """The tier's host copies and its swap buffers."""
        return super().host_tensors() + [t for s in self.slots for t in s.tensors.values()]

    def traffic(self) -> dict[str, int]:
        """As the host tier's, with the state's bytes ``read`` from and ``written`` to the files."""
        return {**super().traffic(), "read": self.bytes_read, "written": self.bytes_written}

    def close(self) -> None:
        """Wait for the I/O in flight, stop the engine and remove this run's files."""
        try:
            self._settle()
        finally:
            self.io.close()
            self.directory.remove()


def _wait_quietly(handles: list[IOHandle]) -> None:
    """Wait for ``handles`` (their buffer is reused next), whatever they end with."""
    for h in handles:
        try:
            h.wait()
        except Exception:  # the error goes with the buffer's bytes, which nothing reads
            pass
