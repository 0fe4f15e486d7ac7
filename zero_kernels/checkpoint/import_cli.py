"""The ``import-deepspeed`` subcommand: a DeepSpeed ZeRO checkpoint -> a zero_kernels checkpoint.

Example::

    python -m zero_kernels import-deepspeed ds_ckpt/ ckpt/ --tag global_step1000
"""

from __future__ import annotations

import argparse

from .deepspeed import from_deepspeed
from .format import describe
from .metadata import read_metadata

HELP = "import a DeepSpeed ZeRO stage 1/2/3 checkpoint (weights, Adam state, steps) as a zero_kernels checkpoint"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """DS_DIR, OUT_DIR and --tag.

    Args:
        parser: the subcommand's parser.
    """
    parser.add_argument("ds_dir", metavar="DS_DIR", help="the directory DeepSpeed's save_checkpoint wrote")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the zero_kernels checkpoint root to write a version into")
    parser.add_argument("--tag", default=None, help="DeepSpeed checkpoint tag (default: the one DS_DIR/latest names)")


def run(args: argparse.Namespace) -> int:
    """Import ``args.ds_dir`` into ``args.out_dir`` and describe the result; a bad checkpoint raises a ValueError.

    Args:
        args: parsed arguments (``ds_dir``, ``out_dir``, ``tag``).
    """
    version = from_deepspeed(args.ds_dir, args.out_dir, tag=args.tag)
    print("\n".join(describe(version, read_metadata(version))))
    return 0
