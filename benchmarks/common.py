"""Shared benchmark plumbing: timing, machine facts, progress, summary, table and JSON output.

A subject is a module ``benchmarks/<name>.py`` that defines ``DESCRIPTION: str`` and
``run(quick: bool) -> list[dict]``. Each row names at least ``case`` and ``provider`` and holds
measured figures (``median_ms``, ``GB/s``, ``ratio`` ...). Ratios are always against a peer
measured in the same run. A subject may define ``summary(rows) -> list[dict]`` (ours against the
best peer, see ``best_vs_peer``); without it, providers named ``ours...`` are ours and the others
peers, compared on ``median_ms`` per case.

Progress: a subject calls ``expect(total)`` once it knows how many measurements it will make and
``progress(case, provider)`` before each; while the runner reports (``reporting``) a line goes to
stderr, elsewhere the calls do nothing. Processes spawned while the runner reports inherit its
state through the ``ZERO_KERNELS_BENCH_PROGRESS`` environment variable (internal), so that a rank
of a multi-process subject can report too.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, TextIO

import torch


def _on_cuda(device: torch.device | str | None) -> bool:
    return torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")


def synchronize(device: torch.device | str | None = None) -> None:
    if _on_cuda(device):
        torch.cuda.synchronize()


def timeit(fn: Callable[[], Any], *, warmup: int = 3, repeat: int = 20, device: str | None = None) -> float:
    """Median time of ``fn()`` in seconds over ``repeat`` runs, after ``warmup`` runs.

    On a CUDA device each run is timed with CUDA events recorded around it on the current stream
    (GPU time, no host synchronisation between runs); elsewhere with the wall clock.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    if _on_cuda(device):
        events = []
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def copy_bandwidth(numel: int, device: str = "cpu", *, repeat: int = 10) -> float:
    """Measured memory bandwidth in GB/s of a large fp32 copy (read + write), the roof for this run."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    seconds = timeit(lambda: dst.copy_(src), warmup=2, repeat=repeat, device=device)
    return 2 * src.numel() * src.element_size() / seconds / 1e9


def inplace_bandwidth(numel: int, device: str = "cpu", *, repeat: int = 10) -> float:
    """Measured memory bandwidth in GB/s of an in-place fp32 update (``x.add_(1.0)``: every element read
    and written back, 8 bytes), the roof of kernels that update their buffers in place, as Adam does.
    It can exceed ``copy_bandwidth``: a copy's writes to another buffer also read its lines first."""
    x = torch.randn(numel, device=device)
    seconds = timeit(lambda: x.add_(1.0), warmup=2, repeat=repeat, device=device)
    return 2 * x.numel() * x.element_size() / seconds / 1e9


def machine_info() -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_table(title: str, rows: Iterable[dict]) -> None:
    rows = list(rows)
    if not rows:
        print(f"\n{title}: no rows")
        return
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    cells = [[_fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def write_json(path: str, subject: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"subject": subject, "machine": machine_info(), "rows": rows}, f, indent=1)


def read_runs(path: str) -> tuple[dict[str, list[dict]], dict]:
    """(subject -> rows, machine facts) of a JSON file written by ``write_json`` or of every such file
    in a folder (the ``--json DIR`` of a run); ``ValueError`` naming the file for anything else."""
    files = sorted(Path(path).glob("*.json")) if Path(path).is_dir() else [Path(path)]
    if not files:
        raise ValueError(f"{path}: no JSON files of a benchmark run (written by --json DIR)")
    results, machine = {}, {}
    for f in files:
        data = json.loads(f.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError(f"{f}: not a benchmark run (expected the 'subject' and 'rows' that --json writes)")
        results[data.get("subject", f.stem)] = data["rows"]
        machine = data.get("machine", machine)
    return results, machine


def format_duration(seconds: float) -> str:
    """``seconds`` as ``m:ss`` (``h:mm:ss`` from an hour on)."""
    total = max(0, int(round(seconds)))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_progress(
    subject: str, position: tuple[int, int], case: str, provider: str, index: int, total: Optional[int], elapsed: float
) -> str:
    """One progress line: subject (its place in the run), case, provider, count and ETA where known.

    Args:
        subject: the subject's name.
        position: (place of the subject in this run, number of subjects), both from 1.
        case: the case about to be measured.
        provider: the provider about to be measured.
        index: the measurement about to start, from 1.
        total: measurements the subject will make, or None when not known.
        elapsed: seconds since the subject started.

    The ETA assumes that the measurements left take as long, on average, as those done so far; it is
    shown from the second measurement on, and only when ``total`` is known.
    """
    parts = [f"[{position[0]}/{position[1]} {subject}]", case, provider]
    if total:
        parts.append(f"{index}/{total}")
    parts.append(f"{format_duration(elapsed)} elapsed")
    if total and 1 < index <= total:
        parts.append(f"ETA {format_duration(elapsed / (index - 1) * (total - index + 1))}")
    return "  ".join(parts)


class Progress:
    """Progress lines of one subject on a stream (one line each; rewritten in place on a terminal).

    Args:
        subject: the subject's name.
        position: (place of the subject in this run, number of subjects).
        stream: where the lines go (stderr by default).
        start: wall-clock time (``time.time()``) the subject started; now by default.
        total: measurements expected, if known.
        index: measurements already started.
    """

    def __init__(
        self,
        subject: str,
        position: tuple[int, int] = (1, 1),
        stream: Optional[TextIO] = None,
        start: Optional[float] = None,
        total: Optional[int] = None,
        index: int = 0,
    ) -> None:
        self.subject, self.position = subject, tuple(position)
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.time() if start is None else start
        self.total, self.index = total, index
        self._inline = bool(getattr(self.stream, "isatty", lambda: False)())

    def _write(self, line: str, final: bool = False) -> None:
        if self._inline:
            self.stream.write("\r\x1b[K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def item(self, case: str, provider: str) -> None:
        self.index += 1
        elapsed = time.time() - self.start
        self._write(format_progress(self.subject, self.position, case, provider, self.index, self.total, elapsed))

    def done(self) -> None:
        took = format_duration(time.time() - self.start)
        self._write(f"[{self.position[0]}/{self.position[1]} {self.subject}] done in {took}", final=True)

    def snapshot(self) -> str:
        """This state as JSON, for a spawned process to go on from (``from_snapshot``)."""
        keys = ("subject", "position", "start", "total", "index")
        return json.dumps({k: getattr(self, k) for k in keys})

    @classmethod
    def from_snapshot(cls, text: str) -> "Progress":
        return cls(**json.loads(text))


_PROGRESS_ENV = "ZERO_KERNELS_BENCH_PROGRESS"
_active: Optional[Progress] = None


def _current() -> Optional[Progress]:
    global _active
    if _active is None and os.environ.get(_PROGRESS_ENV):
        _active = Progress.from_snapshot(os.environ[_PROGRESS_ENV])  # a spawned rank goes on from its parent
    return _active


def _publish() -> None:
    if _active is not None:
        os.environ[_PROGRESS_ENV] = _active.snapshot()


def expect(total: int) -> None:
    """Tell the progress reporter how many measurements the running subject will make."""
    progress_now = _current()
    if progress_now is not None:
        progress_now.total = total
        _publish()


def progress(case: str, provider: str) -> None:
    """Report that the measurement of ``provider`` on ``case`` starts (nothing when no runner reports)."""
    progress_now = _current()
    if progress_now is not None:
        progress_now.item(case, provider)
        _publish()


@contextlib.contextmanager
def reporting(subject: str, position: tuple[int, int], stream: Optional[TextIO] = None) -> Iterator[Progress]:
    """Report the progress of ``subject`` while the block runs, and how long it took at its end."""
    global _active
    _active = Progress(subject, position, stream)
    _publish()
    try:
        yield _active
        _active.done()
    finally:
        _active = None
        os.environ.pop(_PROGRESS_ENV, None)


def best_vs_peer(
    rows: list[dict],
    is_ours: Callable[[str], bool] = lambda provider: provider.startswith("ours"),
    metric: str = "median_ms",
    keys: tuple[str, ...] = ("case",),
) -> list[dict]:
    """Per group of rows (same values of ``keys``), our fastest provider against the fastest peer.

    Args:
        rows: a subject's rows; those without ``metric`` (unavailable, failed) are left out.
        is_ours: tells our providers from the peers by name.
        metric: a time, lower is better.
        keys: the columns that make a case.

    Returns rows of ``case``, ``ours``, ``ours_ms``, ``best_peer``, ``peer_ms`` and ``speedup`` (the
    peer's time over ours: above 1, ours is faster); a group without a timed peer or without a timed
    provider of ours has no speedup.
    """
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if isinstance(r.get(metric), (int, float)):
            groups.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    out = []
    for key, members in groups.items():
        ours = [r for r in members if is_ours(str(r["provider"]))]
        peers = [r for r in members if not is_ours(str(r["provider"]))]
        line: dict[str, Any] = {"case": " ".join(str(k) for k in key if k not in (None, ""))}
        if ours:
            best = min(ours, key=lambda r: r[metric])
            line.update(ours=best["provider"], ours_ms=best[metric])
        if peers:
            best = min(peers, key=lambda r: r[metric])
            line.update(best_peer=best["provider"], peer_ms=best[metric])
        if ours and peers:
            line["speedup"] = line["peer_ms"] / line["ours_ms"]
        out.append(line)
    return out


def summary_rows(module: Any, rows: list[dict]) -> list[dict]:
    """The summary of one subject's rows: its own ``summary(rows)`` if it has one, else ``best_vs_peer``."""
    own = getattr(module, "summary", None)
    return own(rows) if callable(own) else best_vs_peer(rows)


def geometric_mean(values: Iterable[float]) -> float:
    values = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")
