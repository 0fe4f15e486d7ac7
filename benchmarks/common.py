"""Shared benchmark plumbing: timing, machine facts, table and JSON output.

A subject is a module ``benchmarks/<name>.py`` that defines ``DESCRIPTION: str`` and
``run(quick: bool) -> list[dict]``. Each row names at least ``case`` and ``provider`` and holds
measured figures (``median_ms``, ``GB/s``, ``ratio`` ...). Ratios are always against a peer
measured in the same run.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Any, Callable, Iterable

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


def run_named_checks(checks: dict[str, Callable[[], list[str]]]) -> list[dict]:
    """Run each check (it returns its problems; none: pass), print PASS/FAIL lines, return the results.

    An unattended run reports every check, whatever breaks: an exception counts as that check's problem.
    """
    import traceback

    results = []
    for name, check in checks.items():
        start = time.perf_counter()
        try:
            problems = check()
        except Exception:
            problems = ["raised:\n" + traceback.format_exc()]
        seconds = time.perf_counter() - start
        status = "PASS" if not problems else "FAIL"
        results.append({"check": name, "status": status, "seconds": round(seconds, 1), "problems": problems[:20]})
        print(f"{status}  {name}  ({seconds:.1f} s)")
        for p in problems[:20]:
            print(f"      {p}")
    return results
