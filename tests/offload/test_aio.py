"""The disk I/O engine (``zero_kernels.offload.aio``): both backends, checked against the file's bytes read
back with plain Python file I/O (not only round trips), at awkward sizes, offsets and alignments, many
requests in flight, and the errors a user meets (missing or unwritable directory, full disk, short file).

File systems for the error paths are mounted for the test (tmpfs, ramfs, read-only bind mounts) where
the process may mount, and skipped with the reason otherwise; they are unmounted on every exit path.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import logging
import mmap
import os
import shutil
import subprocess
import tempfile
import weakref
from pathlib import Path
from typing import Iterator

import pytest
import torch

from tests.helpers.resident import resident_pages as memory_pages
from zero_kernels._build import ext as _ext
from zero_kernels.offload import FileIO, aio

SMALL_BLOCK = 8192  # two pages: block ± 1 and several blocks stay small

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
]


@pytest.fixture(params=["python", pytest.param("cpp", marks=pytest.mark.ext)])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which engine ``FileIO`` builds: the C++ extension (built here) or the pure-Python fallback."""
    if request.param == "python":

        def unavailable() -> None:
            raise _ext.ExtensionUnavailable("the test asks for the Python engine")

        monkeypatch.setattr(aio, "_extension", unavailable)
    return request.param


@pytest.fixture
def make_io(backend: str) -> Iterator:
    made: list[FileIO] = []

    def make(**kwargs) -> FileIO:
        io = FileIO(**kwargs)
        assert io.backend.startswith(f"{backend}-"), io.backend
        made.append(io)
        return io

    yield make
    for io in made:
        io.close()


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    """A directory on a disk file system (O_DIRECT works there), not on a tmpfs ``/tmp``."""
    with tempfile.TemporaryDirectory(dir="/var/tmp" if os.path.isdir("/var/tmp") else None) as d:
        yield Path(d)


def random_tensor(numel: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8).view(dtype)


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def file_bytes(path: Path, offset: int, nbytes: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def unaligned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor whose address is one element past a page boundary."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty((numel + 1) * itemsize + aio.PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % aio.PAGE + itemsize
    out = raw[start : start + numel * itemsize].view(dtype)
    assert numel == 0 or out.data_ptr() % aio.PAGE == itemsize
    return out


def test_a_waited_handle_holds_the_tensor_no_more(make_io, disk_dir: Path) -> None:
    """A write's handle kept after its wait (as ``ParamFiles`` keeps a file's writes until its next read) leaves
    the tensor to its owner: once the owner drops it, it is gone, though the handle lives on."""
    io = make_io(block_size=SMALL_BLOCK)
    t = random_tensor(3 * SMALL_BLOCK, torch.float32)
    written, alive = as_bytes(t), weakref.ref(t)
    handle = io.write(disk_dir / "f", t, 0)
    del t
    handle.wait()
    gc.collect()
    assert handle.done() and alive() is None
    back = torch.empty(3 * SMALL_BLOCK, dtype=torch.float32)
    io.read(disk_dir / "f", back, 0).wait()
    assert as_bytes(back) == written


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_lands_in_the_file_and_comes_back(make_io, disk_dir: Path, dtype: torch.dtype) -> None:
    io = make_io(block_size=SMALL_BLOCK)
    tensor = random_tensor(3001, dtype)
    offset = 3 * aio.PAGE + 5
    io.write(disk_dir / "f", tensor, offset).wait()
    assert file_bytes(disk_dir / "f", offset, len(as_bytes(tensor))) == as_bytes(tensor)
    back = torch.zeros_like(tensor)
    io.read(disk_dir / "f", back, offset).wait()
    assert as_bytes(back) == as_bytes(tensor)


SIZES = [0, 1, SMALL_BLOCK - 1, SMALL_BLOCK, SMALL_BLOCK + 1, 5 * SMALL_BLOCK + 3]
OFFSETS = [0, 1, aio.PAGE - 1, aio.PAGE, 3 * aio.PAGE + 7]


@pytest.mark.parametrize("memory", ["aligned", "unaligned"])
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("nbytes", SIZES)
def test_sizes_offsets_and_alignment(make_io, disk_dir: Path, nbytes: int, offset: int, memory: str) -> None:
    """Bytes land exactly at ``offset`` and nothing around them changes (the file is not truncated, no page is
    rounded up over its neighbours)."""
    io = make_io(block_size=SMALL_BLOCK)
    path = disk_dir / "f"
    around = os.urandom(offset + nbytes + 2 * aio.PAGE)
    path.write_bytes(around)
    tensor = io.empty(nbytes, torch.uint8) if memory == "aligned" else unaligned(nbytes, torch.uint8)
    tensor.copy_(random_tensor(nbytes, torch.uint8))
    io.write(path, tensor, offset).wait()
    expected = around[:offset] + as_bytes(tensor) + around[offset + nbytes :]
    assert path.read_bytes() == expected
    back = io.empty(nbytes, torch.uint8) if memory == "aligned" else unaligned(nbytes, torch.uint8)
    back.fill_(0)
    io.read(path, back, offset).wait()
    assert as_bytes(back) == as_bytes(tensor)


def test_several_mib_with_the_default_block(make_io, disk_dir: Path) -> None:
    io = make_io()
    tensor = random_tensor((3 << 20) // 4 + 3, torch.float32)
    offset = (1 << 20) + 12
    io.write(disk_dir / "f", tensor, offset).wait()
    assert file_bytes(disk_dir / "f", offset, tensor.numel() * 4) == as_bytes(tensor)
    back = io.empty(tensor.numel(), torch.float32)
    io.read(disk_dir / "f", back, offset).wait()
    assert as_bytes(back) == as_bytes(tensor)


def test_many_handles_in_flight(make_io, disk_dir: Path) -> None:
    io = make_io(block_size=SMALL_BLOCK, queue_depth=4, threads=2)
    size = 3 * SMALL_BLOCK + 100
    tensors = [random_tensor(size, torch.uint8) for _ in range(24)]
    places = [(disk_dir / f"f{i % 3}", (i // 3) * size) for i in range(len(tensors))]
    handles = [io.write(path, t, offset) for t, (path, offset) in zip(tensors, places)]
    for handle in handles:
        handle.wait()
        assert handle.done()
    for t, (path, offset) in zip(tensors, places):
        assert file_bytes(path, offset, size) == as_bytes(t)
    backs = [torch.zeros(size, dtype=torch.uint8) for _ in tensors]
    handles = [io.read(path, b, offset) for b, (path, offset) in zip(backs, places)]
    for handle, back, t in zip(handles, backs, tensors):
        handle.wait()
        assert torch.equal(back, t)


def test_read_after_write_of_the_same_file(make_io, disk_dir: Path) -> None:
    io = make_io(block_size=SMALL_BLOCK)
    path = disk_dir / "f"
    first = random_tensor(4 * SMALL_BLOCK, torch.uint8)
    io.write(path, first).wait()
    patch = random_tensor(SMALL_BLOCK + 3, torch.uint8)
    io.write(path, patch, 5).wait()
    back = torch.zeros_like(first)
    io.read(path, back).wait()
    expected = first.clone()
    expected[5 : 5 + patch.numel()] = patch
    assert torch.equal(back, expected)


def test_done_turns_true_without_wait(make_io, disk_dir: Path) -> None:
    io = make_io(block_size=SMALL_BLOCK)
    handle = io.write(disk_dir / "f", random_tensor(10 * SMALL_BLOCK, torch.uint8))
    io.close()  # finishes what was submitted
    assert handle.done()
    handle.wait()
    assert (disk_dir / "f").stat().st_size == 10 * SMALL_BLOCK


def test_empty_is_page_aligned_and_small(make_io) -> None:
    io = make_io(block_size=SMALL_BLOCK)
    for numel, dtype in [(0, torch.float32), (1, torch.bfloat16), (SMALL_BLOCK + 1, torch.int64)]:
        t = io.empty(numel, dtype)
        assert (t.numel(), t.dtype, t.is_contiguous()) == (numel, dtype, True)
        assert t.data_ptr() % 4096 == 0
        nbytes = t.numel() * t.element_size()
        assert t.untyped_storage().nbytes() <= -(-max(nbytes, 1) // 4096) * 4096 + 4096  # a page of slack, no more


def test_released_pages_leave_memory_and_read_zeros(make_io, disk_dir: Path) -> None:
    io = make_io(block_size=SMALL_BLOCK)
    tensor = io.empty(64 * 4096 // 4, torch.float32)
    tensor.fill_(3.0)
    assert memory_pages(tensor) == 64
    assert aio.release_pages(tensor)
    assert memory_pages(tensor) == 0
    assert torch.count_nonzero(tensor) == 0  # the next touch maps zero-filled pages
    values = random_tensor(tensor.numel(), torch.float32)
    io.write(disk_dir / "f", values).wait()
    io.read(disk_dir / "f", tensor).wait()
    assert as_bytes(tensor) == as_bytes(values) and memory_pages(tensor) == 64  # usable again, as any buffer


def test_release_keeps_what_is_not_a_whole_page_of_the_tensor() -> None:
    raw = torch.ones(3 * 4096, dtype=torch.uint8)
    start = -raw.data_ptr() % 4096
    inside = raw[start + 1 : start + 4096 + 10]  # no whole page of its own: neighbours' bytes share its pages
    assert not aio.release_pages(inside)
    assert torch.equal(raw, torch.ones_like(raw))


def test_buffered_when_direct_is_off(make_io, disk_dir: Path) -> None:
    io = make_io(direct=False)
    assert io.backend.endswith("-buffered")
    tensor = random_tensor(5000, torch.float32)
    io.write(disk_dir / "f", tensor, 9).wait()
    assert file_bytes(disk_dir / "f", 9, 20000) == as_bytes(tensor)


def resident_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (``mincore`` of a private mapping)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    pages = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapping:
        start = ctypes.c_char.from_buffer(mapping)
        ok = libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), pages) == 0
        del start
    assert ok, os.strerror(ctypes.get_errno())
    return sum(p & 1 for p in pages)


def file_system(path: Path) -> str:
    """The type of the file system ``path`` is on (the longest mount point above it)."""
    best, kind = "", "?"
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, point, fstype, *_ = line.split()
        if str(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
            best, kind = point, fstype
    return kind


@pytest.mark.parametrize("direct", [True, False])
def test_o_direct_goes_past_the_page_cache(make_io, disk_dir: Path, direct: bool) -> None:
    """With ``direct`` the file's pages never enter the page cache, written or read; without, they do (which
    shows that the count sees them)."""
    if not Path("/proc/self/mounts").exists() or file_system(disk_dir) in ("tmpfs", "ramfs", "?"):
        pytest.skip(f"{disk_dir} is not on a disk file system: its pages live in memory")
    io = make_io(direct=direct)
    tensor = io.empty(1 << 20, torch.uint8)
    tensor.fill_(5)
    io.write(disk_dir / "f", tensor).wait()
    if direct and io.backend.endswith("+buffered"):
        pytest.skip(f"the file system of {disk_dir} refuses O_DIRECT")
    assert resident_pages(disk_dir / "f") == (0 if direct else 256)
    fd = os.open(disk_dir / "f", os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert resident_pages(disk_dir / "f") == 0
    io.read(disk_dir / "f", tensor).wait()
    assert resident_pages(disk_dir / "f") == (0 if direct else 256)


@contextlib.contextmanager
def mounted(*args: str) -> Iterator[Path]:
    """A fresh directory with ``mount *args DIR`` on it, unmounted and removed on every exit path; skips the
    test with the reason where the process may not mount."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command here")
    target = Path(tempfile.mkdtemp())
    done = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True)
    if done.returncode:
        target.rmdir()
        pytest.skip(f"cannot mount ({' '.join(args)}): {done.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)
        target.rmdir()


def test_buffered_fallback_where_o_direct_is_refused(make_io) -> None:
    with mounted("-t", "ramfs", "ramfs") as where:  # ramfs has no O_DIRECT
        io = make_io()
        assert not io.backend.endswith("+buffered")
        tensor = random_tensor(3 * aio.PAGE + 1, torch.uint8)
        io.write(where / "f", tensor, aio.PAGE).wait()
        assert io.backend.endswith("-odirect+buffered")
        assert file_bytes(where / "f", aio.PAGE, tensor.numel()) == as_bytes(tensor)
        back = torch.zeros_like(tensor)
        io.read(where / "f", back, aio.PAGE).wait()
        assert torch.equal(back, tensor)


def assert_names(exc: pytest.ExceptionInfo, path: Path, code: int) -> None:
    assert exc.value.errno == code, exc.value
    assert exc.value.filename == str(path)
    assert str(path) in str(exc.value)


def test_missing_directory(make_io, disk_dir: Path) -> None:
    io = make_io()
    path = disk_dir / "missing" / "f"
    handle = io.write(path, torch.ones(10))
    with pytest.raises(OSError) as exc:
        handle.wait()
    assert_names(exc, path, errno.ENOENT)
    assert handle.done()
    with pytest.raises(OSError):  # the same error every time
        handle.wait()
    with pytest.raises(OSError) as exc:
        io.read(path, torch.ones(10)).wait()
    assert_names(exc, path, errno.ENOENT)


def test_path_under_a_regular_file(make_io, disk_dir: Path) -> None:
    io = make_io()
    (disk_dir / "file").write_bytes(b"x")
    path = disk_dir / "file" / "f"
    with pytest.raises(OSError) as exc:
        io.write(path, torch.ones(10)).wait()
    assert_names(exc, path, errno.ENOTDIR)


def test_read_only_directory(make_io, disk_dir: Path) -> None:
    with mounted("--bind", str(disk_dir)) as where:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(where)], capture_output=True).returncode:
            pytest.skip("cannot remount the bind mount read-only")
        io = make_io()
        with pytest.raises(OSError) as exc:
            io.write(where / "f", torch.ones(10)).wait()
        assert_names(exc, where / "f", errno.EROFS)


def test_full_disk(make_io) -> None:
    with mounted("-t", "tmpfs", "-o", "size=1m", "tmpfs") as where:
        io = make_io(block_size=SMALL_BLOCK)
        ok = io.write(where / "small", torch.ones(100))
        full = io.write(where / "big", torch.ones(1 << 19))  # 2 MiB
        ok.wait()
        with pytest.raises(OSError) as exc:
            full.wait()
        assert_names(exc, where / "big", errno.ENOSPC)
        assert "disk full" in str(exc.value)
        if not io.backend.endswith("+buffered"):  # reserved before writing: the failed write took no space
            assert (where / "big").stat().st_size == 0
            io.write(where / "after", torch.ones(1 << 17)).wait()  # 512 KiB of the 1 MiB still fit


def test_read_past_the_end(make_io, disk_dir: Path) -> None:
    io = make_io()
    (disk_dir / "f").write_bytes(b"\0" * 100)
    with pytest.raises(OSError) as exc:
        io.read(disk_dir / "f", torch.empty(100, dtype=torch.uint8), offset=1).wait()
    assert_names(exc, disk_dir / "f", errno.ENODATA)
    assert "ends at byte 100" in str(exc.value)


def test_bad_arguments_are_refused_at_once(make_io, disk_dir: Path) -> None:
    with pytest.raises(ValueError, match="block_size"):
        FileIO(block_size=1000)
    with pytest.raises(ValueError, match="queue_depth"):
        FileIO(queue_depth=0)
    io = make_io()
    with pytest.raises(ValueError, match="contiguous"):
        io.write(disk_dir / "f", torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="dense"):
        io.write(disk_dir / "f", torch.ones(4).to_sparse())
    with pytest.raises(ValueError, match="offset"):
        io.read(disk_dir / "f", torch.ones(4), offset=-1)
    io.close()
    with pytest.raises(RuntimeError, match="closed"):
        io.write(disk_dir / "f", torch.ones(4))


@pytest.mark.parametrize(
    "reason, foreign",
    [
        ("no C++ compiler found (c++, g++ or clang++): install one, e.g. `apt-get install g++`", "ZERO_KERNELS_NO_JIT"),
        ("ninja is not installed: `pip install ninja`", "ZERO_KERNELS_NO_JIT"),
        ("zero_kernels extension 'io' is not prebuilt and ZERO_KERNELS_NO_JIT=1 forbids building it; unset it", "g++"),
    ],
)
def test_the_fallback_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, reason: str, foreign: str
) -> None:
    """Once, with the build's own reason, which says what to do; no advice for a cause that is not the one here (it
    told a machine without a compiler to unset ZERO_KERNELS_NO_JIT, and one with ZERO_KERNELS_NO_JIT=1 to install
    a compiler)."""

    def unavailable() -> None:
        raise _ext.ExtensionUnavailable(reason)

    monkeypatch.setattr(aio, "_extension", unavailable)
    _ext.warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        FileIO().close()
        FileIO().close()
    lines = [r.getMessage() for r in caplog.records if "pure-Python engine" in r.getMessage()]
    assert len(lines) == 1 and reason in lines[0] and foreign not in lines[0], lines


def test_a_pinned_buffer_is_allocated_without_an_extra_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where CUDA is there the buffers are pinned, and a pinned block is page-aligned: it is asked for at its size,
    not a page more (torch's pinned allocator rounds each block up to a power of two, so 4 MiB and a page would pin
    8 MiB). Run on the CPU with the pinned allocation stood in by a page-aligned one."""
    asked = []
    real_empty = torch.empty

    def empty(*size, dtype=None, pin_memory=False, **kwargs):
        if not pin_memory:
            return real_empty(*size, dtype=dtype, **kwargs)
        asked.append(size[0])
        raw = real_empty(size[0] + aio.PAGE, dtype=dtype)
        shift = -raw.data_ptr() % aio.PAGE
        return raw[shift : shift + size[0]]  # page-aligned, as cudaHostAlloc's blocks are

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", empty)
    io = FileIO.__new__(FileIO)  # the allocation alone: no engine
    t = FileIO.empty(io, 1 << 20, torch.float32)
    assert asked == [4 << 20] and t.data_ptr() % aio.PAGE == 0 and t.numel() == 1 << 20
