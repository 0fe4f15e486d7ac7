"""The ``consolidate`` subcommand: a sharded checkpoint -> one model + AdamW ``.pt`` file.

Example::

    python -m zero_kernels consolidate ckpt/ model_and_adamw.pt
"""

from __future__ import annotations

import argparse

from .consolidate import consolidate

HELP = "write a sharded checkpoint as one file: model state_dict + torch.optim.AdamW state"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """CKPT_DIR and OUT arguments.

    Args:
        parser: the subcommand's parser.
    """
    parser.add_argument("ckpt_dir", metavar="CKPT_DIR", help="checkpoint root (its newest version) or a version")
    parser.add_argument("out", metavar="OUT", help="the .pt file to write ({'model': ..., 'optimizer': ...})")


def run(args: argparse.Namespace) -> int:
    """Consolidate ``args.ckpt_dir`` into ``args.out``; a bad checkpoint raises a ValueError.

    Args:
        args: parsed arguments (``ckpt_dir``, ``out``).
    """
    out = consolidate(args.ckpt_dir, args.out)
    print(f"wrote {out}")
    return 0
