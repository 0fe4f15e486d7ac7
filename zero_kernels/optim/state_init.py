"""A ``step()`` that only makes the optimizer's state: ``torch.distributed.checkpoint``'s ``_init_optim_state``.

DCP's ``get_state_dict`` on an optimizer without state sets every trainable ``p.grad`` to zeros and every group's lr
to 0, calls ``step()`` once and ``zero_grad()``, so that ``dcp.load`` has a state to fill. With
``gradient_accumulation_steps`` above 1 that call would be an accumulation micro-step: no state made, so the load
brought none (the resumed run restarted Adam from zero moments without a word), and the window one micro-step short.
Such a call (the first micro-step, every lr 0, no update applied or skipped yet, no gradient delivered by a
backward since the optimizer was built, on every rank) is taken as a whole step, as ``torch.optim.AdamW`` takes
it: it makes the state (step 1, moments of the zero gradients) and changes no weight (lr 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..comm.control import ControlLink
from ..comm.objects import all_gather_objects

if TYPE_CHECKING:
    from .optimizer import ShardedFusedAdam


def only_makes_state(opt: "ShardedFusedAdam", micro_step: int) -> bool:
    """Whether a ``step()`` on micro-step ``micro_step`` (1 for a window's first call) is a state-making call, decided
    alike on every rank (one exchange, only when every lr is 0 on an optimizer that never stepped)."""
    if micro_step != 1 or opt.applied_steps or opt.skipped_steps:
        return False
    if any(float(torch.as_tensor(group["lr"])) != 0.0 for group in opt.param_groups):
        return False
    pipeline = opt.pipeline
    fresh = pipeline.grad_arrivals == 0
    if pipeline.world_size == 1:
        return fresh
    return all(all_gather_objects(ControlLink(pipeline.engine).get(), fresh, name="state_init"))
