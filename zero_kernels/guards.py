"""Set-ups that would reduce gradients twice: a model wrapped in ``DistributedDataParallel``.

``ShardedFusedAdam`` reduces gradients across ranks itself (every stage). Under DDP they are
all-reduced a second time, and DDP's buckets hold on to the shapes of stage 3's emptied
parameters: results are silently wrong, or fail deep inside autograd. So DDP is refused where it
can be seen:

- at construction, when the optimizer is given a DDP module (as the model or as ``module=``) or a
  model containing one;
- at the first forward run inside a DDP wrapper built later (the Hugging Face Trainer wraps the
  model after the optimizer exists; ``zero_kernels.integrations.hf.ZeroTrainer`` avoids the wrap).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

_FIX = (
    "ShardedFusedAdam reduces gradients across ranks itself: pass the bare model and do not wrap it in "
    "DistributedDataParallel (with the Hugging Face Trainer, use zero_kernels.integrations.hf.ZeroTrainer)"
)


def refuse_ddp(module: Optional[nn.Module]) -> None:
    """ValueError when ``module`` is, or contains, a ``DistributedDataParallel`` wrapper.

    Args:
        module: the model given to the optimizer (None: nothing to check).
    """
    if module is None:
        return
    for name, m in module.named_modules():
        if isinstance(m, DistributedDataParallel):
            where = "the model" if not name else f"sub-module {name!r} of the model"
            raise ValueError(f"{where} is wrapped in DistributedDataParallel: {_FIX}")


class _RefuseDDPForward:
    """The forward pre-hook of ``refuse_ddp_forward``: a class, so that a model carrying it can still be
    copied or pickled (a copy's hook is inert; the copied optimizer installs its own)."""

    def __init__(self, owner: Any) -> None:
        self._owner = weakref.ref(owner)

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._owner = lambda: None

    def __call__(self, mod: nn.Module, args: Any) -> None:
        active = getattr(DistributedDataParallel, "_active_ddp_module", None)
        if active is None or self._owner() is None:
            return
        if any(m is mod for m in active.module.modules()):
            raise RuntimeError(f"the model runs inside DistributedDataParallel, which was wrapped around it: {_FIX}")


def refuse_ddp_forward(module: nn.Module, owner: Any) -> RemovableHandle:
    """A forward pre-hook on ``module`` that raises when it runs inside a DDP forward while ``owner`` lives.

    Args:
        module: the model the optimizer trains.
        owner: the optimizer; once it is garbage collected the hook does nothing.
    """
    return module.register_forward_pre_hook(_RefuseDDPForward(owner))
