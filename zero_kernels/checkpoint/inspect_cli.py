"""The ``inspect`` subcommand: what a sharded checkpoint holds, its sizes, world size and stage.

Example::

    python -m zero_kernels inspect ckpt/ --verify
"""

from __future__ import annotations

import argparse

from . import accumulation
from .format import TensorSource, describe, resolve
from .metadata import read_book, read_metadata

HELP = "show what a sharded checkpoint holds (world size, stage, files, tensors); --verify checks every checksum"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """CKPT_DIR and --verify.

    Args:
        parser: the subcommand's parser.
    """
    parser.add_argument("ckpt_dir", metavar="CKPT_DIR", help="checkpoint root (its newest version) or a version")
    parser.add_argument("--verify", action="store_true", help="read every tensor and check every block's CRC-32")


def run(args: argparse.Namespace) -> int:
    """Print the description of ``args.ckpt_dir``; a bad checkpoint raises a ValueError.

    Args:
        args: parsed arguments (``ckpt_dir``, ``verify``).
    """
    version = resolve(args.ckpt_dir)
    meta = read_metadata(version)
    print("\n".join(describe(version, meta)))
    window = accumulation.describe(read_book(version, meta)["window"])
    print(f"accumulation window: {window or 'none (saved at a step boundary)'}")
    if window is not None:
        print("  load resumes it only at the same world size, stage, bucket size and model; consolidate drops it")
    if args.verify:
        with TensorSource(version, meta) as src:
            for key in meta["tensors"]:
                src.read(key)
        print(f"verified: {len(meta['tensors'])} tensors, every checksum matches")
    return 0
