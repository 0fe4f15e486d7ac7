"""Saving full weights from a sharded optimizer (``save``); the Hugging Face Trainer (``integrations.hf``)
and Accelerate (``integrations.accelerate``).

``integrations.hf`` needs ``transformers``, ``integrations.accelerate`` needs ``accelerate`` (both in
``pip install 'zero_kernels[hf]'``); this package needs neither.
"""

from __future__ import annotations

from .save import agree, save_pretrained

__all__ = ["agree", "save_pretrained"]
