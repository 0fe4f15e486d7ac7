"""What the next ``step()`` is expected to be, for the updates stage 3's SuperOffload runs during backward
(``stages.speculation``): the param groups' hyper-parameters as they are now, the gradient scale, the clipping norm
and whether inf/NaN are checked for; nothing where that step will not update (an accumulation micro-step) or where
a group's values would be refused. The step checks the guess against what it then has, so a wrong one costs time
only."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Callable, Optional

from ..stages.speculation import Prediction

if TYPE_CHECKING:
    from .optimizer import ShardedFusedAdam


def predictor(opt: "ShardedFusedAdam") -> Callable[[], Optional[Prediction]]:
    """``predict`` for ``opt``, held weakly (the pipeline holds this, and the optimizer the pipeline)."""
    ref = weakref.ref(opt)

    def predicted() -> Optional[Prediction]:
        owner = ref()
        return None if owner is None else predict(owner)

    return predicted


def predict(opt: "ShardedFusedAdam") -> Optional[Prediction]:
    """The next step as ``opt`` would take it now (None: it will not update, or cannot be foreseen)."""
    if not opt._updates_at_next_step(False) or opt._no_sync_depth:
        return None
    try:
        hyper = [opt._hyper(g, f"param group {i}") for i, g in enumerate(opt.param_groups)]
    except (ValueError, TypeError, KeyError):
        return None  # the step refuses it
    check_finite = opt.loss_scaler is not None or opt.skip_nonfinite_steps
    return Prediction(hyper, opt._grad_factor / opt._grad_divisor, opt.max_grad_norm, check_finite)
