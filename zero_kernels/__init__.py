"""zero_kernels: ZeRO sharded data-parallel training as a drop-in fused Adam optimizer."""

from __future__ import annotations

from . import _compat, checkpoint, log
from .config import FP16Config, OptimizerConfig, ZeroConfig, ZeroOptions
from .entry import initialize
from .env import settings
from .integrations import save_pretrained
from .optim import (
    ShardedFusedAdam,
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)
from .planner import estimate_comm, estimate_memory, recommend
from .stages.stage3 import register_external_parameter, set_leaf_modules

__version__ = "0.1.0"

log.setup(settings().log_level)
_compat.register()

__all__ = [
    "checkpoint",
    "FP16Config",
    "OptimizerConfig",
    "ShardedFusedAdam",
    "ZeroConfig",
    "ZeroOptions",
    "estimate_comm",
    "estimate_memory",
    "initialize",
    "recommend",
    "register_external_parameter",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
    "save_pretrained",
    "set_leaf_modules",
]
