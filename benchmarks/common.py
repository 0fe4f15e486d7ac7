"""Shared benchmark plumbing: timing, machine facts, progress, summary, table and JSON output, ranks.

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
import gc
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, TextIO

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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
    """Measured memory bandwidth in GB/s of a large fp32 copy (read + write)."""
    fn, moved = copy_roof(numel, device)
    return moved / timeit(fn, warmup=2, repeat=repeat, device=device) / 1e9


def copy_roof(numel: int, device: str = "cpu") -> tuple[Callable[[], Any], int]:
    """(an fp32 ``copy_`` of ``numel`` elements, the bytes it moves): time it in the rounds for a copy roof."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * numel * 4


def inplace_roof(numel: int, device: str = "cpu") -> tuple[Callable[[], Any], int]:
    """(an in-place fp32 ``add_`` of ``numel`` elements, the bytes it moves): for an in-place roof."""
    x = torch.randn(numel, device=device)
    return (lambda: x.add_(1.0)), 2 * numel * 4


def load_average() -> Optional[tuple[float, float, float]]:
    """The 1, 5 and 15 minute load averages (runnable processes), or None where the OS does not say."""
    try:
        return os.getloadavg()
    except (AttributeError, OSError):
        return None


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else the machine's count."""
    getter = getattr(os, "sched_getaffinity", None)
    return len(getter(0)) if getter is not None else (os.cpu_count() or 1)


def machine_info() -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "cores": usable_cores(),
    }
    load = load_average()
    if load is not None:
        info["load_avg"] = "/".join(f"{v:.2f}" for v in load)  # over 1/5/15 minutes
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def load_warning(when: str = "now") -> Optional[str]:
    """A warning when the machine runs more processes than it has cores (timings then measure the contention
    as much as the code), else None."""
    load, cores = load_average(), usable_cores()
    if load is None or load[0] <= cores:
        return None
    return (
        f"WARNING: load average {load[0]:.2f} {when} exceeds the {cores} cores: other processes compete for the CPU, "
        "so times are slower and noisier than on an idle machine; read the spreads, and trust only verdicts"
    )


# ---------------------------------------------------------------- interleaved rounds, ratios and verdicts
def interleaved_rounds(
    fns: dict[Any, Callable[[], Any]],
    rounds: int,
    *,
    budget_s: float,
    max_repeat: int = 50,
    device: Optional[str] = None,
    on_round: Callable[[int], None] = lambda r: None,
) -> tuple[dict[Any, list[float]], dict[Any, int]]:
    """Seconds per call of each function, one median per round; and the calls timed per round.

    Each round times every function in turn (alternating the order between rounds), so that in each
    round all of them run under the same machine load: ratios are then taken round by round
    (``ratio_stats``), and their spread over the rounds says how far the load moved them. Each
    function is called twice first (compilation and allocation; then once timed, to size its
    rounds: as many calls as fit in ``budget_s`` over all rounds, 1 to ``max_repeat`` per round).

    Args:
        fns: what to time, by key.
        rounds: how many rounds.
        budget_s: the time each function may take over all its rounds.
        max_repeat: the most calls per function and round.
        device: where they run (CUDA: timed with events).
        on_round: called with the round's index (from 0) as it starts (progress).
    """
    repeat = {}
    for key, fn in fns.items():
        fn()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        one = max(time.perf_counter() - start, 1e-9)
        repeat[key] = max(1, min(max_repeat, int(budget_s / rounds / one)))
    out: dict[Any, list[float]] = {key: [] for key in fns}
    for r in range(rounds):
        on_round(r)
        for key in list(fns) if r % 2 == 0 else list(reversed(fns)):
            out[key].append(timeit(fns[key], warmup=0, repeat=repeat[key], device=device))
    return out, repeat


def ratio_stats(peer: list[float], ours: list[float]) -> dict:
    """Round by round ``peer / ours`` (two lists of times of the same rounds): the median ratio and its spread.

    Returns ``speedup`` (the median ratio; above 1: ours is faster), ``low`` and ``high`` (its smallest
    and largest over the rounds) and ``verdict``.
    """
    ratios = sorted(p / o for p, o in zip(peer, ours) if o > 0)
    if not ratios:
        return {}
    low, high = ratios[0], ratios[-1]
    return {"speedup": statistics.median(ratios), "low": low, "high": high, "verdict": verdict(low, high, len(ratios))}


def verdict(low: float, high: float, rounds: int) -> str:
    """``faster`` or ``slower`` only when every round agrees (the spread stays on one side of 1)."""
    if rounds < 3:
        return f"no verdict: {rounds} round(s)"
    if low > 1:
        return "ours faster"
    if high < 1:
        return "ours slower"
    return "no verdict: the rounds disagree"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_table(title: str, rows: Iterable[dict]) -> None:
    """Rows as a text table; list-valued columns (each round's times) are left to the JSON output."""
    rows = list(rows)
    if not rows:
        print(f"\n{title}: no rows")
        return
    columns: list[str] = []
    for row in rows:
        columns += [k for k, v in row.items() if k not in columns and not isinstance(v, list)]
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
    peer's time over ours: above 1, ours is faster); where both rows carry the times of the same
    interleaved rounds (``rounds_ms``), the speedup is the median of the per-round ratios, with its
    ``low`` and ``high`` over the rounds and a ``verdict`` (``ratio_stats``). A group without a timed
    peer or without a timed provider of ours has no speedup.
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
            mine = min(ours, key=lambda r: r[metric])
            line.update(ours=mine["provider"], ours_ms=mine[metric])
        if peers:
            best = min(peers, key=lambda r: r[metric])
            line.update(best_peer=best["provider"], peer_ms=best[metric])
        if ours and peers:
            line["speedup"] = line["peer_ms"] / line["ours_ms"]
            if mine.get("rounds_ms") and best.get("rounds_ms"):
                line.update(ratio_stats(best["rounds_ms"], mine["rounds_ms"]))
        out.append(line)
    return out


def summary_rows(module: Any, rows: list[dict]) -> list[dict]:
    """The summary of one subject's rows: its own ``summary(rows)`` if it has one, else ``best_vs_peer``."""
    own = getattr(module, "summary", None)
    return own(rows) if callable(own) else best_vs_peer(rows)


def geometric_mean(values: Iterable[float]) -> float:
    values = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


# ---------------------------------------------------------------- subjects in several processes (gloo, loopback)
def error_text(err: BaseException) -> str:
    """A failure as a row reports it: its type and the start of its message."""
    return f"{type(err).__name__}: {err}"[:160]


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank: int, world: int, port: int, *, timeout_s: float) -> None:
    """Join the gloo group of ``world`` ranks at ``port`` (one thread per rank; DeepSpeed reads MASTER_*)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def provider_rounds(rank: int, providers: list[str], rounds: int, measure: Callable[[str], Any]) -> dict[str, list]:
    """provider -> ``measure(provider)`` per round, or the error it raised (the others go on); the order of the
    providers alternates between rounds, and rank 0 reports progress."""
    results: dict[str, list] = {p: [] for p in providers}
    for r in range(rounds):
        for provider in providers if r % 2 == 0 else providers[::-1]:
            if rank == 0:
                progress(f"round {r + 1}/{rounds}", provider)
            try:
                results[provider].append(measure(provider))
            except Exception as err:  # reported in the provider's rows
                results[provider].append(error_text(err))
            gc.collect()
    return results


def finish_rank(out: str, rank: int, result: Any) -> None:
    """Write this rank's ``result`` to ``out.<rank>`` for ``spawn_ranks``, leave the process group and end the rank."""
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    end_rank()


def end_rank() -> None:
    """End a rank whose results are written and whose process group is destroyed, without the interpreter's shutdown.

    After a synchronous gloo collective returns, a gloo worker thread can still hold the collective's work, and
    through it the caller's tensors (4 loaded ranks, 2000 all-reduces each: held after the return 55-71 times per
    rank, for up to 15 ms). Dropping the last reference to a tensor Python made takes the GIL; if that happens while
    the interpreter finalizes, the thread cannot have it and the process aborts ("terminate called without an
    active exception"), after its work is done. So the rank collects its garbage, flushes and exits at once.
    """
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(target: Callable, args: tuple, out: str, world: int) -> list[Any]:
    """What each rank of ``target(rank, *args, out)`` wrote to ``out.<rank>``; an ``error`` per rank if they died."""
    try:
        mp.spawn(target, args=(*args, out), nprocs=world, join=True)
    except Exception as err:  # e.g. a rank killed by a signal: the other providers still run
        return [{"error": error_text(err)} for _ in range(world)]
    found = []
    for rank in range(world):
        with open(f"{out}.{rank}") as f:
            found.append(json.load(f))
    return found


def rounds_by_provider(rows: list[dict]) -> dict[str, list[float]]:
    """provider -> its step time per round (``rounds_ms``), the mean over the ranks (rows without it are left out)."""
    per_rank: dict[str, list[list[float]]] = {}
    for r in rows:
        if "rounds_ms" in r:
            per_rank.setdefault(r["provider"], []).append(r["rounds_ms"])
    return {p: [statistics.fmean(ts) for ts in zip(*ranks)] for p, ranks in per_rank.items()}
