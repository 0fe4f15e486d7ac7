"""What the GPU scripts report, and the summary of a run of ``gpu_check.sh``.

Each GPU script keeps a ``Report``: its JSON file (``DIR/<script>.json``) is rewritten after every
check and every timing, so a script stopped by its time limit keeps what it finished; every check
runs guarded (an exception is that check's failure, and the next check still runs); without a CUDA
device every check is written as skipped, with the reason. A file holds::

    {"script": "gpu_check", "checks": [{"check": ..., "status": "PASS" | "FAIL" | "SKIP",
     "seconds": ..., "problems": [...]}, ...], ...}   (and what the script adds: rows, timings)

``summary(DIR)`` prints every check of every file, the stage rows and timings, and ends with one
line: how many checks passed, failed and were skipped, and the run's worst-case time;
``python benchmarks/gpu_report.py DIR [--worst-case S] [--elapsed S]`` prints it (``gpu_check.sh``'s last
step). Nothing here imports torch, so that step takes well under a second even on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

NO_CUDA = "skipped: no CUDA device"
SCRIPTS = ("gpu_check", "gpu_streams", "gpu_stages", "gpu_offload", "gpu_timing")


class Report:
    """The JSON file of one GPU script, rewritten after each change.

    Args:
        json_dir: where the file goes (None: nothing is written, results are only printed).
        script: the script's name (the file is ``<script>.json``).
    """

    def __init__(self, json_dir: Optional[str], script: str):
        self.path = None if json_dir is None else Path(json_dir) / f"{script}.json"
        self.data: dict[str, Any] = {"script": script, "checks": []}
        self.save()

    @property
    def checks(self) -> list[dict]:
        return self.data["checks"]

    def save(self) -> None:
        """Write the file now (whole: a reader never sees half of it)."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".json.partial")
        partial.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(partial, self.path)

    def set(self, key: str, value: Any) -> None:
        """Add (or replace) ``key`` in the file and write it."""
        self.data[key] = value
        self.save()

    def record(self, name: str, status: str, problems: list[str], seconds: float = 0.0) -> dict:
        """Add one check's result, print it and write the file."""
        result = {"check": name, "status": status, "seconds": round(seconds, 1), "problems": problems[:20]}
        self.checks.append(result)
        print(f"{status}  {name}  ({seconds:.1f} s)")
        for p in problems[:20]:
            print(f"      {p}")
        self.save()
        return result

    def run(self, name: str, check: Callable[[], list[str]]) -> dict:
        """Run ``check`` (it returns its problems; none: pass), guarded, and record it."""
        start = time.perf_counter()
        try:
            problems = list(check())
        except Exception:
            problems = ["raised:\n" + traceback.format_exc()]
        return self.record(name, "FAIL" if problems else "PASS", problems, time.perf_counter() - start)

    def run_all(self, checks: dict[str, Callable[[], list[str]]]) -> None:
        for name, check in checks.items():
            self.run(name, check)

    def skip_all(self, names: list[str], reason: str = NO_CUDA) -> None:
        """Record every check of ``names`` as skipped, with ``reason``."""
        for name in names:
            self.record(name, "SKIP", [reason])

    def exit_status(self) -> int:
        """1 when a check failed, 2 when every check was skipped (or none ran), else 0."""
        statuses = {r["status"] for r in self.checks}
        if "FAIL" in statuses:
            return 1
        return 0 if "PASS" in statuses else 2


def _read(root: Path, name: str) -> Optional[dict]:
    path = root / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _print_checks(root: Path) -> dict[str, int]:
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    for script in SCRIPTS:
        found = _read(root, script)
        if found is None:
            print(f"{script}: no results (not run, or stopped before its first check)")
            continue
        for r in found["checks"]:
            counts[r["status"]] += 1
            detail = f": {r['problems'][0][:150]}" if r["problems"] and r["status"] != "PASS" else ""
            print(f"{r['status']}  {script}: {r['check']}{detail}")
        for r in found.get("rows", []):
            if r.get("provider") not in (None, "torch.AdamW fused"):
                ratio = f"x{r['fused_vs_this']:.2f} vs fused AdamW" if "fused_vs_this" in r else "no timing"
                print(f"        stage path {r['provider']} {r['dtype']} ({found.get('comm_engine')} comm): {ratio}")
        for r in found.get("offload", []):
            print(
                f"        offload stage {r['stage']}: {r['plain_ms']:.1f} ms without, {r['offload_ms']:.1f} ms with "
                f"(bus {r['bus_ms']:.1f} ms, host Adam {r['host_adam_ms']:.1f} ms alone; hidden {r['hidden']:.2f})"
            )
        for section in ("adam", "flatten"):
            for r in found.get(section, []):
                print(f"        {r['case']:26s} {r['provider']:26s} {r['ms']:.3f} ms {r['GBps']:.0f} GB/s")
    return counts


def _print_benchmarks(root: Path) -> None:
    for subject in ("adam", "flatten"):
        found = _read(root, subject)
        if found is None:
            print(f"benchmark {subject}: no results")
            continue
        rows = [r for r in found.get("rows", []) if "median_ms" in r]
        largest = max((r["n"] for r in rows), default=None)
        for r in rows:
            if r["n"] == largest and r["provider"].startswith("ours"):
                ratio = r.get("vs_best_peer", math.nan)
                roof = "inplace" if "of_inplace_bw" in r else "copy"
                print(
                    f"benchmark {subject:8s} {r['case']:24s} n={largest} {r['provider']:12s} {r['median_ms']:.3f} ms "
                    f"{r['GB/s']:.0f} GB/s ({r[f'of_{roof}_bw']:.0%} of {roof}) x{ratio:.2f} vs best peer"
                )


def summary(json_dir: str, worst_case_s: Optional[int] = None, elapsed_s: Optional[float] = None) -> int:
    """Print the summary of a run; its last line counts the checks. Returns 0."""
    root = Path(json_dir)
    print("\n== summary ==")
    for name in ("ops", "comm"):
        status = root / f"{name}_build.status"
        print(f"build {name}: {status.read_text().strip() if status.exists() else 'unknown'}")
    counts = _print_checks(root)
    _print_benchmarks(root)
    timing = "" if elapsed_s is None else f" in {elapsed_s:.0f} s"
    bound = "" if worst_case_s is None else f" (worst case {worst_case_s} s)"
    print(
        f"gpu_check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped{timing}{bound}; "
        f"results in {json_dir}"
    )
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="the summary of a finished gpu_check.sh run")
    parser.add_argument("json_dir", metavar="DIR", help="the run's results (every JSON file its scripts wrote)")
    parser.add_argument("--worst-case", type=int, help="the run's worst-case time, in seconds")
    parser.add_argument("--elapsed", type=float, help="how long the run took, in seconds")
    args = parser.parse_args(argv)
    return summary(args.json_dir, args.worst_case, args.elapsed)


if __name__ == "__main__":
    raise SystemExit(main())
