"""Which ZeRO stage to use, and what it costs: memory per GPU, communication per step, a DeepSpeed config.

The choice lives in :mod:`zero_kernels.planner.choose`, the memory and communication models in
:mod:`zero_kernels.planner.models`, the link model in :mod:`zero_kernels.planner.links`.
"""

from __future__ import annotations

from .choose import (
    NoFitError,
    Recommendation,
    StagePlan,
    deepspeed_config,
    default_bucket_elements,
    format_bytes,
    plan_stages,
    recommend,
)
from .models import LINKS, CommEstimate, LinkPreset, MemoryEstimate, estimate_comm, estimate_memory

__all__ = [
    "LINKS",
    "CommEstimate",
    "LinkPreset",
    "MemoryEstimate",
    "NoFitError",
    "Recommendation",
    "StagePlan",
    "default_bucket_elements",
    "deepspeed_config",
    "estimate_comm",
    "estimate_memory",
    "format_bytes",
    "plan_stages",
    "recommend",
]
