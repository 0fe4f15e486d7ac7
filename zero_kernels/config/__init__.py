"""DeepSpeed JSON config -> one validated, frozen ``ZeroConfig`` (:mod:`zero_kernels.config.zero_config`).

The key rules live in ``rules`` and ``schema``, the scheduler section in ``scheduler``, the Hugging
Face Trainer's ``"auto"`` values in ``hf``.
"""

from __future__ import annotations

from .scheduler import SchedulerConfig
from .zero_config import FP16Config, OptimizerConfig, ZeroConfig, ZeroOptions

__all__ = ["FP16Config", "OptimizerConfig", "SchedulerConfig", "ZeroConfig", "ZeroOptions"]
