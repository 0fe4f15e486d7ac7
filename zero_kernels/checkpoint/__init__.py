"""Sharded checkpoints: every rank saves only its part; load at any world size and any stage.

Usage (on every rank)::

    zk.checkpoint.save("ckpt", model, optimizer, extra={"epoch": 3}, scheduler=lr_scheduler)
    extra = zk.checkpoint.load("ckpt", model, optimizer, scheduler=lr_scheduler)
    zk.checkpoint.consolidate("ckpt", "model_and_adamw.pt")      # one process, streaming
    zk.checkpoint.from_deepspeed("ds_ckpt", "ckpt")               # a DeepSpeed ZeRO checkpoint, imported

The format and what each rank writes: ``checkpoint.sharded``.
"""

from __future__ import annotations

from .consolidate import consolidate
from .deepspeed import from_deepspeed
from .format import CheckpointError
from .sharded import load, save

__all__ = ["CheckpointError", "consolidate", "from_deepspeed", "load", "save"]
