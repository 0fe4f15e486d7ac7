"""zero_kernels: ZeRO sharded data-parallel training as a drop-in fused Adam optimizer."""

from __future__ import annotations

import logging

from .env import settings

__version__ = "0.1.0"

logging.getLogger("zero_kernels").setLevel(settings().log_level)
