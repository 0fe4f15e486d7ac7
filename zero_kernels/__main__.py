"""``python -m zero_kernels COMMAND ...``: the package's command line.

Each subcommand is a module that defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int`` (the exit status). ``SUBCOMMANDS`` maps a subcommand's name to its module, so adding
one is adding one entry. A ``ValueError`` or ``OSError`` (a file that cannot be written) escaping ``run`` is
printed as an error with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "plan": "zero_kernels.planner.cli",
    "consolidate": "zero_kernels.checkpoint.cli",
    "inspect": "zero_kernels.checkpoint.inspect_cli",
    "import-deepspeed": "zero_kernels.checkpoint.import_cli",
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per entry of ``SUBCOMMANDS``."""
    parser = argparse.ArgumentParser(
        prog="python -m zero_kernels", description="ZeRO sharded data-parallel training tools."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the process arguments), run the chosen subcommand, return its exit status.

    Args:
        argv: arguments after ``python -m zero_kernels``; None reads ``sys.argv[1:]``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
