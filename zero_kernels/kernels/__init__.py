"""Fused kernels behind one signature: ``adam_step``, ``flatten``, ``unflatten``.

Each public function takes the arguments of its ``*_ref`` twin in ``reference.py`` plus
``impl=None`` (None reads ``ZERO_KERNELS_IMPL``). The dispatcher picks the backend.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .reference import Scale, adam_step_ref, flatten_ref, unflatten_ref


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    impl: Optional[str] = None,
    **hyper,
) -> None:
    """One Adam/AdamW step on a flat shard; see ``reference.adam_step_ref`` for the arguments."""
    adam_step_ref(param, grad, exp_avg, exp_avg_sq, **hyper)


def flatten(
    tensors: Sequence[torch.Tensor],
    flat: torch.Tensor,
    offsets: Sequence[int],
    *,
    scale: Scale = None,
    impl: Optional[str] = None,
) -> torch.Tensor:
    """Copy tensors into ``flat`` at ``offsets``; see ``reference.flatten_ref``."""
    return flatten_ref(tensors, flat, offsets, scale=scale)


def unflatten(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    offsets: Sequence[int],
    *,
    scale: Scale = None,
    impl: Optional[str] = None,
) -> None:
    """Copy ``flat`` back into tensors at ``offsets``; see ``reference.unflatten_ref``."""
    unflatten_ref(flat, tensors, offsets, scale=scale)


__all__ = ["adam_step", "flatten", "unflatten", "adam_step_ref", "flatten_ref", "unflatten_ref"]
