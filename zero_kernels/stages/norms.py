"""Global gradient norms of any order but 2 over the ranks' reduced gradient shards (``clip_grad_norm_``'s
``norm_type``), as ``torch.nn.utils.get_total_norm`` takes them over whole gradients.

The shards split every gradient element between the ranks exactly once (``Pipeline.norm_views``), so:

- ``inf``: each rank's largest ``|g|``, then a max all-reduce. That max need not carry a NaN (gloo's keeps one
  from rank 0 and drops one from rank 1), so a second entry, the max of "this rank saw a NaN" (0 or 1), makes
  the result NaN, as torch's is;
- a finite ``p``: each rank's sum of ``|g|^p`` (per piece ``vector_norm(g, p) ** p``, in float64 from
  the piece's float32 norm, as torch stacks per-tensor norms), a sum all-reduce, then ``** (1 / p)``.

Both stay on the gradients' device: the host does not read them here. With the gradients in files (stage 3,
``offload_optimizer`` on nvme) the pieces are read back from the files, as for an L2 norm the backward did
not take. The L2 norm keeps its own path (``grad_state.grad_norm``), the one the step shares.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch


def norm_order(norm_type: Any, what: str) -> float:
    """``norm_type`` as a float, as torch reads it (``2``, ``3.0``, ``"inf"``, ``math.inf``): a positive number or
    ``inf`` (0, negative orders and NaN measure no size a clip could use)."""
    try:
        order = float(norm_type)
    except (TypeError, ValueError):
        order = math.nan
    if not order > 0:
        raise ValueError(f"{what}: norm_type must be a positive number or inf (float('inf')), got {norm_type!r}")
    return order


def local_column(views: Iterable[torch.Tensor], device: torch.device, order: float) -> torch.Tensor:
    """This rank's part of the norm of order ``order`` (not 2) over its gradient pieces ``views``, float64 on
    ``device``: ``[max |g|, saw a NaN]`` for ``inf``, else ``[sum |g|^order]``."""
    column = torch.zeros(2 if math.isinf(order) else 1, dtype=torch.float64, device=device)
    for v in views:
        if v.numel() == 0:
            continue
        term = torch.linalg.vector_norm(v, order, dtype=torch.float32).double()
        if math.isinf(order):
            column[1] = torch.maximum(column[1], term.isnan().double())
            column[0] = torch.maximum(column[0], torch.nan_to_num(term, nan=0.0, posinf=math.inf))
        else:
            column += term.pow(order)
    return column


def reduce(engine: Any, column: torch.Tensor, order: float) -> None:
    """Combine the ranks' ``local_column`` in place (a collective: every rank calls it)."""
    if engine.world_size > 1:
        engine.all_reduce(column, op="max" if math.isinf(order) else "sum", name="clip.norm").wait()


def value(column: torch.Tensor, order: float) -> torch.Tensor:
    """The global norm, a float64 0-d tensor, from the combined column."""
    if math.isinf(order):
        return torch.where(column[1] > 0, math.nan, column[0])
    return column[0].pow(1.0 / order)
