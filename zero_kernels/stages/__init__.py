"""Stage pipelines, the registry that maps a ZeRO stage to its pipeline class, the flat-buffer
layout and buckets. Stage 3 lives in ``stages.stage3`` and registers on first use."""

from __future__ import annotations

from .base import Pipeline
from .buffers import FlatBuffer, GroupHyper, storage_bytes
from .outcome import StepResult
from .registry import PIPELINES, Stage, pipeline_class, requires_module

__all__ = [
    "FlatBuffer",
    "GroupHyper",
    "PIPELINES",
    "Pipeline",
    "Stage",
    "StepResult",
    "pipeline_class",
    "requires_module",
    "storage_bytes",
]
