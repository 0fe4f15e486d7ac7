"""Which ZeRO stage to use, and what it costs: memory per GPU, communication per step, a DeepSpeed config.

The choice lives in :mod:`zero_kernels.planner.choose`, the memory and communication models in
:mod:`zero_kernels.planner.models`, the link model in :mod:`zero_kernels.planner.links`, the offload
model (host memory, disk, the host link) in :mod:`zero_kernels.planner.offload`.
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
from .offload import DEVICE_KINDS, OffloadEstimate, OffloadSetup, estimate_offload

__all__ = [
    "DEVICE_KINDS",
    "LINKS",
    "CommEstimate",
    "LinkPreset",
    "MemoryEstimate",
    "NoFitError",
    "OffloadEstimate",
    "OffloadSetup",
    "Recommendation",
    "StagePlan",
    "default_bucket_elements",
    "deepspeed_config",
    "estimate_comm",
    "estimate_memory",
    "estimate_offload",
    "format_bytes",
    "plan_stages",
    "recommend",
]
