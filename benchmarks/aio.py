"""The disk I/O engine (``zero_kernels.offload.FileIO``) against the disk it writes to, in the same run.

The disk's bandwidth is measured as ``dd`` would (``dd bs=B oflag=direct`` then ``iflag=direct``): one
thread writes then reads a file of ``--size`` bytes (default 1 GiB) sequentially with ``O_DIRECT`` (no
page cache, so nothing has to be dropped), one ``B``-byte request at a time, for ``B`` = 1 MiB and
16 MiB (a large request lets the kernel split it and keep several in flight: the stronger peer). Then
each engine (the C++ one when the extension builds, and the pure-Python fallback) writes and reads the
same file from a block-aligned tensor with its default settings (1 MiB blocks, queue depth 8, one
thread). Cases: ``write new`` (the file removed before each write, so the write allocates it),
``write`` (overwriting the file in place) and ``read``; nothing is fsynced (the engine does not sync).
Every provider works on the same file in interleaved rounds; ``GB/s`` is ``--size`` over the
median round, and an engine's ``vs_disk`` its bandwidth over the better ``dd``'s in the same round
(median, with ``vs_disk_low``/``vs_disk_high`` over the rounds; the goal is at least 0.85). The
summary's ``speedup`` is that ratio for the faster engine. The file lives in the system temp directory or in
``--path`` and is removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import re
import statistics
import tempfile
from typing import Any, Callable, Iterator

import torch

from zero_kernels._build import ext as _ext
from zero_kernels.offload import FileIO, aio

from .common import expect, interleaved_rounds, progress, ratio_stats

DESCRIPTION = "disk I/O engine: write and read GB/s of each backend against dd-like O_DIRECT on the same disk"
NOTES = [
    "vs_disk = the engine's GB/s / the best dd-like GB/s of the same round, median over the rounds (low/high: "
    "its smallest and largest round); goal: >= 0.85. The summary's speedup is the same ratio for the faster "
    "engine. The disk is shared with whatever else runs on the machine",
]
DD_BLOCKS = {"dd bs=1M": 1 << 20, "dd bs=16M": 16 << 20}
CASES = ("write new", "write", "read")  # write new: into a file made by the write; write: overwriting one
_options: dict[str, Any] = {"size": 1 << 30, "path": None}
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", metavar="BYTES", help="aio: bytes per file, e.g. 256M or 2G (default 1G)")
    parser.add_argument("--path", metavar="DIR", help="aio: directory on the disk to measure (default: temp dir)")


def parse_size(text: str) -> int:
    """``"256M"``, ``"2G"``, ``"1GiB"``, ``"4096"`` -> bytes (a whole number of 16 MiB, at least one)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(i?b)?\s*", text.lower())
    if not match:
        raise ValueError(f"{text!r} is not a size: write e.g. 256M or 2G")
    size = int(match.group(1)) * _UNITS[match.group(2)]
    return max(1, -(-size // (16 << 20))) * (16 << 20)


def configure(args: argparse.Namespace) -> None:
    if args.size:
        try:
            _options["size"] = parse_size(args.size)
        except ValueError as exc:
            raise SystemExit(f"--size: {exc}") from None
    if args.path:
        if not os.path.isdir(args.path):
            raise SystemExit(f"--path: {args.path!r} is not a directory")
        _options["path"] = args.path


def _dd(path: str, size: int, block: int, write: bool) -> Callable[[], None]:
    """One ``dd``: ``size`` bytes in ``block``-byte O_DIRECT requests, one at a time (no fsync, as
    ``dd oflag=direct`` without ``conv=fsync``: the engine does not sync either)."""
    buffer = mmap.mmap(-1, block)  # page aligned, as O_DIRECT asks
    view = memoryview(buffer)

    def run() -> None:
        fd = os.open(path, (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | os.O_DIRECT, 0o644)
        try:
            for at in range(0, size, block):
                moved = os.pwritev(fd, [view], at) if write else os.preadv(fd, [view], at)
                if moved != block:
                    raise OSError(f"dd: short {'write' if write else 'read'} at byte {at} of {path}")
        finally:
            os.close(fd)

    return run


def _engine(io: FileIO, path: str, tensor: torch.Tensor, write: bool) -> Callable[[], None]:
    def run() -> None:
        (io.write if write else io.read)(path, tensor).wait()

    return run


def _new_file(path: str, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` on a file that does not exist yet (removed first: every provider pays the same unlink)."""

    def run() -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        fn()

    return run


def _refuse() -> None:
    raise _ext.ExtensionUnavailable("the benchmark measures the Python engine here")


@contextlib.contextmanager
def _engines() -> Iterator[dict[str, FileIO]]:
    """The C++ engine (when the extension builds) and the Python fallback, closed at the end."""
    made = {}
    try:
        cpp = FileIO()
        if cpp.backend.startswith("cpp"):
            made["cpp"] = cpp
        else:
            cpp.close()
        saved, aio._extension = aio._extension, _refuse
        try:
            made["python"] = FileIO()
        finally:
            aio._extension = saved
        yield made
    finally:
        for io in made.values():
            io.close()


def run(quick: bool) -> list[dict]:
    size, rounds = _options["size"], 3 if quick else 5
    directory = _options["path"] or tempfile.gettempdir()
    path = os.path.join(directory, f"zero_kernels_aio_bench_{os.getpid()}.dat")
    expect(len(CASES) * rounds)
    rows: list[dict] = []
    try:
        with _engines() as engines:
            tensor = next(iter(engines.values())).empty(size, torch.uint8)
            tensor.fill_(7)
            for case in CASES:  # "read" last: the writes leave the file it reads
                write = case != "read"
                fns = {name: _dd(path, size, block, write) for name, block in DD_BLOCKS.items()}
                fns.update({f"ours {io.backend}": _engine(io, path, tensor, write) for io in engines.values()})
                if case == "write new":
                    fns = {name: _new_file(path, fn) for name, fn in fns.items()}
                times, _ = interleaved_rounds(
                    fns, rounds, budget_s=0, max_repeat=1, on_round=lambda r: progress(case, f"round {r + 1}")
                )
                disk = [min(times[name][r] for name in DD_BLOCKS) for r in range(rounds)]  # the best dd, per round
                rows += [_row(case, provider, size, seconds, directory, disk) for provider, seconds in times.items()]
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    return rows


def _row(case: str, provider: str, size: int, seconds: list[float], directory: str, disk: list[float]) -> dict:
    """One provider's row; an engine's also carries ``vs_disk``: its GB/s over the best dd's, round by round."""
    median = statistics.median(seconds)
    versus = {}
    if provider.startswith("ours"):
        stats = ratio_stats(disk, seconds)
        versus = {"vs_disk": stats["speedup"], "vs_disk_low": stats["low"], "vs_disk_high": stats["high"]}
    return {
        "case": case,
        "provider": provider,
        "MiB": size >> 20,
        "GB/s": size / median / 1e9,
        "median_ms": median * 1e3,
        "rounds_ms": [s * 1e3 for s in seconds],
        **versus,
        "dir": directory,
    }
