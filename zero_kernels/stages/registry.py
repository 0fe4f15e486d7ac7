"""Stage pipelines and the registry that maps a ZeRO stage to its pipeline class.

This registry is the only place where a stage number decides anything. Stage 3 registers itself
when its module is importable.
"""

from __future__ import annotations

import importlib
from enum import IntEnum
from typing import Type

from .base import Pipeline
from .stage0 import Stage0Pipeline
from .stage1 import Stage1Pipeline
from .stage2 import Stage2Pipeline


class Stage(IntEnum):
    REPLICATED = 0
    OPTIMIZER_STATE = 1
    GRADIENTS = 2
    PARAMETERS = 3


PIPELINES: dict[Stage, Type[Pipeline]] = {
    Stage.REPLICATED: Stage0Pipeline,
    Stage.OPTIMIZER_STATE: Stage1Pipeline,
    Stage.GRADIENTS: Stage2Pipeline,
}

_LAZY = {Stage.PARAMETERS: ("zero_kernels.stages.stage3.pipeline", "Stage3Pipeline")}


def pipeline_class(stage: int) -> Type[Pipeline]:
    """The pipeline class of ZeRO stage ``stage``; ValueError lists the available stages.

    Args:
        stage: 0, 1, 2 or 3.
    """
    try:
        key = Stage(stage)
    except ValueError:
        raise ValueError(f"stage {stage!r} is not a ZeRO stage; allowed: {', '.join(str(int(s)) for s in Stage)}")
    if key not in PIPELINES and key in _LAZY:
        module, name = _LAZY[key]
        try:
            PIPELINES[key] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"stage {int(key)} is not available in this build ({err})") from err
    return PIPELINES[key]


def requires_module(stage: int) -> bool:
    """True when the pipeline of ``stage`` needs the model (not just its parameters)."""
    return pipeline_class(stage).requires_module
