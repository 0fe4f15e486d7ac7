"""``python -m benchmarks compare A B``: the ratio per case between two runs saved with ``--json``.

A and B are JSON files written by ``--json`` or folders of them (matched by subject). Rows are
matched on their descriptive columns (text and whole numbers: ``case``, ``provider``, ``n``,
``rank``, ``primitive`` ...); the compared column is a time (``median_ms``, else ``step_ms``) unless
``--metric`` names another. ``speedup`` is A's value over B's: for a time, above 1 means B is faster
(for A/B work on a noisy machine: A the baseline, B the change; rerun both before trusting a ratio
near 1).
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from .common import geometric_mean, print_table, read_runs

TIME_METRICS = ("median_ms", "step_ms")
_NOT_KEYS = {"runs", "chosen", "note", "error", "verdict"}  # text or counts that vary between runs of a case


def row_key(row: dict) -> tuple:
    """The descriptive columns of a row (text and whole numbers), which name its case and provider."""
    return tuple(
        (k, v)
        for k, v in row.items()
        if k not in _NOT_KEYS and isinstance(v, (str, int)) and not isinstance(v, bool) and v != ""
    )


def _keyed(rows: list[dict]) -> dict[tuple, dict]:
    out: dict[tuple, dict] = {}
    for row in rows:
        key = row_key(row)
        n = sum(1 for k in out if k[:-1] == key)  # rows that share every descriptive column: by order
        out[key + (("#", n),)] = row
    return out


def _metric(row: dict, metric: Optional[str]) -> Optional[str]:
    names = (metric,) if metric else TIME_METRICS
    return next((m for m in names if isinstance(row.get(m), (int, float))), None)


def compare(a: dict[str, list[dict]], b: dict[str, list[dict]], metric: Optional[str] = None) -> list[dict]:
    """One row per case and provider found in both runs: the values in A and B and A / B.

    Args:
        a: subject -> rows of the baseline run.
        b: subject -> rows of the other run.
        metric: the column to compare (default: ``median_ms``, else ``step_ms``).
    """
    out = []
    for subject in [s for s in a if s in b]:
        rows_a, rows_b = _keyed(a[subject]), _keyed(b[subject])
        for key, ra in rows_a.items():
            rb = rows_b.get(key)
            m = _metric(ra, metric)
            line: dict[str, Any] = {"subject": subject}
            line.update((k, v) for k, v in key if k != "#")
            if rb is None:
                out.append({**line, "note": "only in A"})
                continue
            if m is None or _metric(rb, m) is None:
                out.append({**line, "note": rb.get("error") or rb.get("note") or ra.get("note") or "no value"})
                continue
            line.update(metric=m, A=ra[m], B=rb[m])
            if rb[m]:
                line["speedup"] = ra[m] / rb[m]
            out.append(line)
        out += [{"subject": subject, **dict(k for k in key if k[0] != "#"), "note": "only in B"}
                for key in rows_b if key not in rows_a]  # fmt: skip
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks compare", description=__doc__)
    parser.add_argument("a", help="baseline run: a JSON file or folder written by --json")
    parser.add_argument("b", help="other run: a JSON file or folder written by --json")
    parser.add_argument("--metric", help="column to compare (default: median_ms, else step_ms)")
    args = parser.parse_args(argv)
    try:
        (a, _), (b, _) = read_runs(args.a), read_runs(args.b)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    lines = compare(a, b, args.metric)
    if not lines:
        parser.error(f"no subject in both runs (A: {', '.join(a)}; B: {', '.join(b)})")
    print_table(f"compare: speedup = A / B (A = {args.a}, B = {args.b}; for a time, above 1: B is faster)", lines)
    for subject in dict.fromkeys(line["subject"] for line in lines):
        ratios = [line["speedup"] for line in lines if line["subject"] == subject and "speedup" in line]
        if ratios:
            print(f"{subject}: geometric mean of A / B over {len(ratios)} rows: {geometric_mean(ratios):.3f}")
    return 0
