"""On-disk format of sharded checkpoints: directory layout, crash-safe writes, checked reads.

A checkpoint *root* holds numbered versions and a pointer to the newest complete one::

    ROOT/
      latest                    the name of the newest complete version ("v000002"), written last
      v000001/                  a complete version (never modified once renamed into place)
      v000002/
        rank00000.bin           raw little-endian tensor pieces written by rank 0
        rank00001.bin           ... one file per rank of the world that saved
        objects.pt              param groups, scheduler and loss-scale state, accumulation window
        extra.pt                the ``extra`` object given to ``save`` (only if given)
        metadata.json           written after every other file of the version
      .tmp-v000003/             a save in progress or killed midway: ignored by ``load``, removed
                                by the next save that completes

Writes. Every file is written to ``NAME.tmp``, flushed, fsynced and renamed to ``NAME``. A save
fills ``.tmp-vNNNNNN/``; once every rank's file is in place, rank 0 writes ``metadata.json``,
renames the directory to ``vNNNNNN`` (atomic), fsyncs the root and replaces ``latest`` the same
way. A crash at any point leaves ``latest`` naming the previous complete version.

Metadata (JSON). ``format``/``version`` identify the format; ``world_size``/``stage`` describe the
run that saved; ``block_bytes`` and, per rank file, ``bytes`` and ``crc32`` (one CRC-32 per block
of ``block_bytes``) let a reader verify exactly the blocks it reads. ``tensors`` maps a tensor key
to ``{"shape", "dtype", "pieces": [[file, elem_offset, byte_offset, numel], ...]}``: element
``elem_offset + i`` of the flattened tensor is at ``byte_offset + i * itemsize`` of rank file
``file``. Model tensors are keyed ``model/NAME``, Adam state ``optim/INDEX/{exp_avg,exp_avg_sq,
master}``, the gradients of a rank's open accumulation window ``window/RANK/grad/INDEX`` and
``window/RANK/shard/BUFFER``. The rest (``model`` key aliases, ``params``, a JSON summary of the
``param_groups``, the optimizer's ``skipped_steps`` and ``dequantized`` (qwZ: the param groups whose whole
parameters' other-rank parts a step's int8 all-gather had written; true or false for all of them as first kept),
absent before they were kept) is bookkeeping read by ``checkpoint.load``, ``checkpoint.consolidate`` and
``inspect``; ``objects`` and ``extra`` give the size and CRC of ``objects.pt`` and ``extra.pt``, whose objects
keep their exact types (``checkpoint.objects``). Version 1 (before ``objects.pt``) kept the param groups, the loss scale
and the scheduler's state in the JSON itself; it still loads. A checkpoint directory is untrusted
input: ``metadata.read_metadata`` checks every field (shard file names are plain names inside the
version, pieces lie inside their files) before anything is opened or allocated.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import sys
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Optional, Union

import torch

from ..wording import plural

FORMAT = "zero_kernels.checkpoint"
VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: param groups, loss scale and scheduler state in metadata.json
BLOCK_BYTES = 1 << 20
METADATA = "metadata.json"
LATEST = "latest"
EXTRA = "extra.pt"
OBJECTS = "objects.pt"
TMP_PREFIX = ".tmp-"
_VERSION_DIR = re.compile(r"v(\d{6,})")
_CHUNK_BYTES = 16 << 20
log = logging.getLogger("zero_kernels")

DTYPES = {
    str(dt).removeprefix("torch."): dt
    for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16)
    + (torch.int8, torch.uint8, torch.bool)
}

PathLike = Union[str, os.PathLike]


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the model/optimizer it is loaded into."""


def rank_file(rank: int) -> str:
    """Name of the file rank ``rank`` writes in a version directory."""
    return f"rank{rank:05d}.bin"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``; a CheckpointError for dtypes the format does not store."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise CheckpointError(f"checkpoint: tensors of dtype {dtype} cannot be stored; allowed: {', '.join(DTYPES)}")
    return name


def check_byteorder() -> None:
    """The format is little-endian and written/read as raw memory: refuse big-endian hosts."""
    if sys.byteorder != "little":
        raise CheckpointError("checkpoint: raw little-endian tensor files need a little-endian host")


def tensor_bytes(t: torch.Tensor) -> bytearray:
    """The raw bytes of the elements of ``t`` (any device and layout), copied to host memory without numpy."""
    out = bytearray(t.numel() * t.element_size())
    if out:
        torch.frombuffer(out, dtype=t.dtype).copy_(t.reshape(-1))
    return out


# ---------------------------------------------------------------- crash-safe writes
def fsync_dir(path: Path) -> None:
    """Make a rename inside directory ``path`` durable (where the platform allows opening directories)."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Atomically put the fully written, fsynced file or directory ``tmp`` at ``final``."""
    os.replace(tmp, final)
    fsync_dir(final.parent)


def write_small(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` crash-safely (``path.tmp``, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    publish(tmp, path)


class BlockWriter:
    """Appends bytes to a file while computing one CRC-32 per ``block_bytes`` block."""

    def __init__(self, f: BinaryIO, block_bytes: int = BLOCK_BYTES):
        self.f, self.block_bytes = f, block_bytes
        self.size = 0
        self.crcs: list[int] = []
        self._crc = 0

    def write(self, data: memoryview) -> None:
        data = data.cast("B")
        while len(data):
            room = self.block_bytes - self.size % self.block_bytes
            part, data = data[:room], data[room:]
            self.f.write(part)
            self._crc = zlib.crc32(part, self._crc)
            self.size += len(part)
            if self.size % self.block_bytes == 0:
                self.crcs.append(self._crc)
                self._crc = 0

    def write_tensor(self, t: torch.Tensor) -> None:
        """Write the elements of 1-D ``t`` (any device) in chunks of bounded host memory."""
        step = max(1, _CHUNK_BYTES // t.element_size())
        for start in range(0, t.numel(), step):
            chunk = t.narrow(0, start, min(step, t.numel() - start)).detach()
            self.write(memoryview(tensor_bytes(chunk)))

    def finish(self) -> list[int]:
        """The CRCs of every block, the last partial one included."""
        if self.size % self.block_bytes:
            self.crcs.append(self._crc)
            self._crc = 0
        return self.crcs


# ---------------------------------------------------------------- finding a version
class SaveLock:
    """The root's save lock (an flock on the root directory itself, so no file is added to it), taken by rank 0 of
    the saving job before it numbers its version and released once ``latest`` names it (or the save failed). Two
    jobs, or two data-parallel groups of one job, saving into one root at the same time would otherwise pick
    version numbers, write ``latest`` through one temporary file and remove each other's unfinished versions
    concurrently: the second is refused. The kernel drops an flock when its process dies, so a killed save leaves
    no stale lock. A process forked while the lock is held (a DataLoader's worker started beside a save in a
    background thread) shares the lock through its copy of the descriptor: the release unlocks it explicitly
    (``LOCK_UN`` acts on every copy) before it closes, so such a child, which may live for the whole run, does not
    keep it and refuse every later save into the root. A file system that cannot lock the root (NFSv4 emulates flock
    with a lock that needs a descriptor open for writing, which a directory never is; Lustre mounted without
    ``flock``) saves without the lock, as before it, with a WARNING once per root."""

    def __init__(self, root: Path):
        import fcntl  # POSIX only: imported where a save needs it

        self._fd: Optional[int] = os.open(root, os.O_RDONLY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(self._fd)
            self._fd = None
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                _warn_unlocked(root, err)
                return
            raise CheckpointError(
                f"checkpoint: another process is saving into {root} now: two jobs (or two data-parallel groups) "
                "saving into one directory would replace each other's 'latest' and a later load would get the "
                "other's model; give each its own directory"
            ) from None

    def release(self) -> None:
        import fcntl

        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


_unlocked: set[Path] = set()  # roots whose file system cannot lock them, warned of


def _warn_unlocked(root: Path, err: OSError) -> None:
    if root.resolve() not in _unlocked:
        _unlocked.add(root.resolve())
        log.warning(
            "checkpoint: cannot lock %s (its file system answered: %s): this save and the later ones into it go "
            "unlocked, so a second job (or data-parallel group) saving into it at the same time is not detected; "
            "give each its own directory",
            root, err.strerror,
        )  # fmt: skip


def next_version(root: Path) -> str:
    """The name of the next version under ``root`` (after every complete and partial one)."""
    numbers = [0]
    if root.is_dir():
        for p in root.iterdir():
            name = p.name.removeprefix(TMP_PREFIX)
            if _VERSION_DIR.fullmatch(name):
                numbers.append(int(name[1:]))
    return f"v{max(numbers) + 1:06d}"


def remove_unfinished(root: Path, version: str) -> None:
    """Remove the ``.tmp-v*`` directories numbered below ``version``: saves that were killed midway.

    ``next_version`` numbers a save after every complete and partial one, so none of them is still
    being written (unless two jobs save into the same root, which is not supported). A directory
    that cannot be removed is logged and left.
    """
    number = int(version[1:])
    for path in root.iterdir():
        name = path.name.removeprefix(TMP_PREFIX)
        if path.name.startswith(TMP_PREFIX) and _VERSION_DIR.fullmatch(name) and int(name[1:]) < number:
            try:
                shutil.rmtree(path)
            except OSError as err:
                log.warning("checkpoint: could not remove %s, left by a save that did not finish: %s", path, err)


def resolve(directory: PathLike) -> Path:
    """The complete version directory that ``directory`` (a root or a version) designates.

    A root resolves to the version its ``latest`` file names; a newer complete version beside it (a save killed
    after renaming it into place, before it named it ``latest``, so that save never returned) is named in a
    warning. A CheckpointError explains what is wrong when there is none (nothing saved, or only a save that did
    not finish).
    """
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint: {path} does not exist or is not a directory")
    if path.name.startswith(TMP_PREFIX):
        raise CheckpointError(f"checkpoint: {path} is a save that did not finish; it cannot be loaded")
    if (path / METADATA).is_file():
        return path
    if (path / LATEST).is_file():
        name = (path / LATEST).read_text().strip()
        if not _VERSION_DIR.fullmatch(name) or not (path / name / METADATA).is_file():
            raise CheckpointError(f"checkpoint: {path / LATEST} names {name!r}, which is not a complete version")
        _warn_newer(path, name)
        return path / name
    partial = sorted(p.name for p in path.iterdir() if p.name.startswith(TMP_PREFIX))
    if partial or _VERSION_DIR.fullmatch(path.name):
        raise CheckpointError(
            f"checkpoint: {path} holds no complete checkpoint: a save did not finish "
            f"({', '.join(partial) or 'no ' + METADATA}); it cannot be loaded"
        )
    raise CheckpointError(f"checkpoint: {path} is not a checkpoint (no {LATEST} and no {METADATA}){_inner(path)}")


def _inner(path: Path) -> str:
    """Where a folder that is not a checkpoint holds one in a sub-folder (a Hugging Face Trainer ``checkpoint-N``
    folder written by ``ZeroTrainer`` keeps it in ``zero_kernels``; a root whose ``latest`` file is gone holds its
    versions, of which the newest is named): the sentence naming it, else ''."""
    inner = sorted(p for p in path.iterdir() if (p / LATEST).is_file() or (p / METADATA).is_file())
    versions = [p for p in inner if _VERSION_DIR.fullmatch(p.name)]
    if versions:
        newest = max(versions, key=lambda p: int(p.name[1:]))
        return f"; it holds versions without a {LATEST} file naming one: pass the newest, {newest}"
    return f"; it holds one in a sub-folder: pass {inner[0]}" if inner else ""


def _warn_newer(root: Path, latest: str) -> None:
    """Warn of complete versions under ``root`` newer than ``latest`` (see ``resolve``)."""
    newer = sorted(
        p.name for p in root.iterdir()
        if _VERSION_DIR.fullmatch(p.name) and int(p.name[1:]) > int(latest[1:]) and (p / METADATA).is_file()
    )  # fmt: skip
    if newer:
        log.warning(
            "checkpoint: loading %s, which %s names; %s beside it is complete but newer (a save killed before it "
            "named it latest: that save never returned); to resume from there, load %s",
            latest, root / LATEST, ", ".join(newer), root / newer[-1],
        )  # fmt: skip


# ---------------------------------------------------------------- checked reads
class ShardReader:
    """Ranged reads of one rank file; every block a read touches is checked against its CRC once."""

    def __init__(self, path: Path, entry: dict[str, Any], block_bytes: int):
        self.path, self.block_bytes = path, block_bytes
        self.crcs: list[int] = entry["crc32"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint: shard file {path} is missing") from None
        if size != entry["bytes"]:
            raise CheckpointError(
                f"checkpoint: shard file {path} has {size} bytes, the metadata says {entry['bytes']}: "
                "it is truncated or was replaced"
            )
        self.size = size
        self._f = open(path, "rb")
        self._verified: set[int] = set()

    def _pread(self, offset: int, n: int) -> bytes:
        self._f.seek(offset)
        data = self._f.read(n)
        if len(data) != n:
            raise CheckpointError(f"checkpoint: shard file {self.path} ends early (truncated while reading)")
        return data

    def _verify(self, block: int, data: bytes) -> None:
        start = block * self.block_bytes
        if block >= len(self.crcs) or zlib.crc32(data) != self.crcs[block]:
            raise CheckpointError(
                f"checkpoint: shard file {self.path} is corrupted (checksum mismatch in bytes "
                f"{start}..{start + len(data)})"
            )
        self._verified.add(block)

    def read(self, offset: int, n: int) -> bytes:
        """Bytes ``offset .. offset + n`` of the file, after checking the blocks holding them.

        Blocks not checked yet are read whole (one read covering the request) and checked; the
        bytes of a request inside checked blocks are read alone.
        """
        try:
            return self._checked(offset, n)
        except OSError as err:  # an I/O error, a network file system's: named with the file
            raise CheckpointError(f"checkpoint: reading shard file {self.path} failed: {err}") from err

    def _checked(self, offset: int, n: int) -> bytes:
        if n == 0:
            return b""
        first, last = offset // self.block_bytes, (offset + n - 1) // self.block_bytes
        if all(b in self._verified for b in range(first, last + 1)):
            return self._pread(offset, n)
        start = first * self.block_bytes
        end = min((last + 1) * self.block_bytes, self.size)
        data = self._pread(start, end - start)
        for block in range(first, last + 1):
            if block not in self._verified:
                lo = block * self.block_bytes - start
                self._verify(block, data[lo : lo + self.block_bytes])
        return data[offset - start : offset - start + n]

    def close(self) -> None:
        self._f.close()


class TensorSource:
    """Element ranges of the tensors of one checkpoint version, read piece by piece from the rank files."""

    def __init__(self, version: Path, meta: dict[str, Any]):
        self.version, self.meta = version, meta
        self._readers: dict[int, ShardReader] = {}

    def __enter__(self) -> "TensorSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers = {}

    def _reader(self, file: int) -> ShardReader:
        if file not in self._readers:
            files = self.meta["files"]
            if not 0 <= file < len(files):
                raise CheckpointError(
                    f"checkpoint: the metadata of {self.version} names shard file {file}: no such file"
                )
            self._readers[file] = ShardReader(self.version / files[file]["name"], files[file], self.meta["block_bytes"])
        return self._readers[file]

    def entry(self, key: str) -> dict[str, Any]:
        if key not in self.meta["tensors"]:
            raise CheckpointError(f"checkpoint: {self.version} has no tensor {key!r}")
        return self.meta["tensors"][key]

    def read(self, key: str, start: int = 0, numel: Optional[int] = None) -> torch.Tensor:
        """Elements ``start .. start + numel`` of flattened tensor ``key`` (all when ``numel`` is None)."""
        return self.read_summed(key, start, numel)[0]

    def read_summed(self, key: str, start: int = 0, numel: Optional[int] = None) -> tuple[torch.Tensor, int]:
        """``read``'s elements and the CRC-32 of their bytes: the same range read again later gives the same sum
        unless its file was written to meanwhile (a read inside blocks already checked is not checked again)."""
        entry = self.entry(key)
        total = _numel(entry["shape"])
        numel = total - start if numel is None else numel
        dtype = DTYPES[entry["dtype"]]
        size = dtype.itemsize
        parts = []
        for file, lo, byte_offset, n in entry["pieces"]:
            a, b = max(lo, start), min(lo + n, start + numel)
            if a < b:
                parts.append((self._reader(file), a, b, byte_offset + (a - lo) * size))
        # Every reader has checked its file's real size: the pieces, and so ``out``, fit in the files.
        out = torch.empty(numel, dtype=dtype)
        covered, crc = 0, 0
        for reader, a, b, offset in parts:
            data = reader.read(offset, (b - a) * size)
            crc = zlib.crc32(data, crc)
            out.narrow(0, a - start, b - a).copy_(torch.frombuffer(bytearray(data), dtype=dtype))
            covered += b - a
        if covered != numel:
            raise CheckpointError(f"checkpoint: the pieces of {key!r} in {self.version} do not cover the tensor")
        return out, crc

    def full(self, key: str) -> torch.Tensor:
        """Tensor ``key`` with its saved shape."""
        return self.read(key).view(self.entry(key)["shape"])


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def describe(version: Path, meta: dict[str, Any]) -> list[str]:
    """Human-readable lines: what the checkpoint holds, its sizes, world size and stage."""
    files = meta["files"]
    total = sum(f["bytes"] for f in files)
    lines = [
        f"checkpoint {version}",
        f"format {meta['format']} v{meta['version']}, saved by stage {meta['stage']} on "
        f"{plural(meta['world_size'], 'rank')}",
        f"{plural(len(files), 'shard file')}, {total} bytes; {plural(len(meta['tensors']), 'tensor')}; "
        f"{plural(len(meta['params']), 'optimizer parameter')}; extra: {'yes' if meta.get('extra') else 'no'}",
        "model tensors (name, shape, dtype, Adam step):",
    ]
    steps = {p["name"]: p["step"] for p in meta["params"] if p["trainable"]}
    for name, key in meta["model"].items():
        entry = meta["tensors"][key]
        step = steps.get(name)
        lines.append(f"  {name}  {tuple(entry['shape'])}  {entry['dtype']}  {'-' if step is None else step}")
    return lines
