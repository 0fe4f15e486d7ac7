"""The optimizer's wing: ``ShardedFusedAdam`` and the helpers that take it (arguments, state dicts,
copies, ``opt.state`` views, loss scale, guards, GradScaler and torch's clipping)."""

from __future__ import annotations

from .optimizer import ShardedFusedAdam, check_hyper

__all__ = ["ShardedFusedAdam", "check_hyper"]
