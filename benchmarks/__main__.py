"""``python -m benchmarks [SUBJECT ...] [--full] [--json DIR]``: run subjects, print tables.

With no subject every available subject runs in its quick form (the embedded default).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from pathlib import Path

from .common import machine_info, print_table, write_json

_NOT_SUBJECTS = {"common"}


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


def main(argv: list[str] | None = None) -> int:
    available = subjects()
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("subject", nargs="*", help=f"any of: {', '.join(sorted(available))} (default: all)")
    parser.add_argument("--full", action="store_true", help="full sweep instead of the quick default")
    parser.add_argument("--json", metavar="DIR", help="also write one JSON file of rows per subject")
    args = parser.parse_args(argv)
    unknown = [s for s in args.subject if s not in available]
    if unknown:
        parser.error(f"unknown subject(s) {', '.join(unknown)}; available: {', '.join(sorted(available))}")
    print("machine:", ", ".join(f"{k}={v}" for k, v in machine_info().items()))
    for name in args.subject or sorted(available):
        module = importlib.import_module(f"benchmarks.{name}")
        rows = module.run(quick=not args.full)
        print_table(f"{name}: {available[name]}", rows)
        if args.json:
            write_json(str(Path(args.json) / f"{name}.json"), name, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
