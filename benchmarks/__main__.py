"""``python -m benchmarks [SUBJECT ...] [--full] [--json DIR] [--plot DIR]``: run subjects, print tables.

With no subject every available subject runs in its quick form (the embedded default, the main
job), except those that set ``IN_DEFAULT_RUN = False`` (they run when named); progress goes to
stderr, and a summary of ours against the best peer ends the output.

``python -m benchmarks compare A B [--metric COLUMN]``: the ratio per case between two runs saved
with ``--json`` (files or folders).
``python -m benchmarks plot JSON_DIR OUT_DIR``: the plots of a run saved with ``--json``.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time
from pathlib import Path

from . import compare, plots
from .common import (
    format_duration,
    load_average,
    load_warning,
    machine_info,
    print_table,
    read_runs,
    reporting,
    summary_rows,
    write_json,
)

_NOT_SUBJECTS = {"common", "compare", "plots", "e2e_deepspeed"}
_COMMANDS = ("compare", "plot")


def subjects() -> dict[str, str]:
    """name -> description of every module in this package that defines ``run``."""
    found = {}
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name.startswith("_") or info.name in _NOT_SUBJECTS:
            continue
        module = importlib.import_module(f"benchmarks.{info.name}")
        if hasattr(module, "run"):
            found[info.name] = getattr(module, "DESCRIPTION", "")
    return found


def _prebuild() -> None:
    """Build (or load) the C++ extensions once here, before subjects spawn ranks that would race to build them."""
    from zero_kernels import _ext

    for name in ("ops", "comm"):
        _ext.available(name)


def _command(argv: list[str]) -> int:
    if argv[0] == "compare":
        return compare.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m benchmarks plot", description="plots of a run saved with --json")
    parser.add_argument("json_dir", help="folder written by --json")
    parser.add_argument("out_dir", help="folder for the PNG files")
    args = parser.parse_args(argv[1:])
    try:
        results, machine = read_runs(args.json_dir)
        for path in plots.write_plots(results, args.out_dir, machine):
            print(path)
    except (plots.PlotUnavailable, OSError, ValueError) as exc:
        print(f"python -m benchmarks plot: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in _COMMANDS:
        return _command(argv)
    available = subjects()
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("subject", nargs="*", help=f"any of: {', '.join(sorted(available))} (default: all)")
    parser.add_argument("--full", action="store_true", help="full sweep instead of the quick default")
    parser.add_argument("--json", metavar="DIR", help="also write one JSON file of rows per subject")
    parser.add_argument("--plot", metavar="DIR", help="also write PNG plots (needs matplotlib)")
    hooks = {name: importlib.import_module(f"benchmarks.{name}") for name in sorted(available)}
    for module in hooks.values():  # a subject's own options: add_arguments(parser), then configure(args)
        getattr(module, "add_arguments", lambda _: None)(parser)
    args = parser.parse_args(argv)
    for module in hooks.values():
        getattr(module, "configure", lambda _: None)(args)
    unknown = [s for s in args.subject if s not in available]
    if unknown:
        parser.error(f"unknown subject(s) {', '.join(unknown)}; available: {', '.join(sorted(available))}")
    if args.plot:
        try:
            plots.require_matplotlib()
        except plots.PlotUnavailable as exc:
            parser.error(str(exc))
    started = time.time()
    machine = machine_info()
    print("machine:", ", ".join(f"{k}={v}" for k, v in machine.items()), flush=True)
    _warn_if_loaded("at the start")
    _prebuild()
    names = args.subject or [n for n in sorted(available) if getattr(hooks[n], "IN_DEFAULT_RUN", True)]
    results, summaries = {}, []
    for place, name in enumerate(names, 1):
        module = importlib.import_module(f"benchmarks.{name}")
        with reporting(name, (place, len(names))):
            rows = module.run(quick=not args.full)
        results[name] = rows
        print_table(f"{name}: {available[name]}", rows)
        for note in getattr(module, "NOTES", []):
            print(f"  {note}")
        summaries += [{"subject": name, **line} for line in summary_rows(module, rows)]
        if args.json:
            write_json(str(Path(args.json) / f"{name}.json"), name, rows)
        sys.stdout.flush()
    print_table("summary: ours vs the best peer (speedup = the peer's time / ours; above 1: ours is faster)", summaries)
    print(f"  {SUMMARY_NOTE}")
    if args.plot:
        for path in plots.write_plots(results, args.plot, machine):
            print("plot:", path)
    load = load_average()
    at_end = f", load average {'/'.join(f'{v:.2f}' for v in load)} at the end (1/5/15 min)" if load else ""
    print(f"\nwall time: {format_duration(time.time() - started)} ({len(names)} subjects){at_end}")
    _warn_if_loaded("at the end")
    return 0


SUMMARY_NOTE = (
    "speedup: the median over the interleaved rounds of the per-round ratio; low/high: its smallest and largest "
    "round; verdict: faster or slower only when every round agrees"
)


def _warn_if_loaded(when: str) -> None:
    warning = load_warning(when)
    if warning:
        print(warning, flush=True)


if __name__ == "__main__":
    sys.exit(main())
