"""ZeRO stage 3: parameters gathered per module just before use and freed after.

``pipeline`` (the stage-3 pipeline and its buffers), ``units`` (a unit of trainable parameters: gathered, freed,
its gradients handed on), ``plan`` (which parameters a module gathers),
``hooks`` (the forward/backward hooks that gather and free), ``storage`` (a gathered buffer a free
empties, whatever autograd saved of it), ``uses`` and ``guard`` (reads of a freed
parameter caught), ``check`` (ranks gather the same thing), ``save`` (full weights out), and
``model_hints`` (leaf modules and external parameters the module tree does not say), ``generation`` (Hugging Face's
``generate`` kept in step across ranks).
"""

from __future__ import annotations

from .generation import generates_synced
from .model_hints import register_external_parameter, set_leaf_modules
from .pipeline import Stage3Buffer, Stage3Pipeline

__all__ = ["Stage3Buffer", "Stage3Pipeline", "generates_synced", "register_external_parameter", "set_leaf_modules"]
