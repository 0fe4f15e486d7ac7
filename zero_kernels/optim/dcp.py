"""``torch.distributed.checkpoint`` (DCP) asking for the state: it gets the full layout.

DCP's state-dict helpers (``get_state_dict``, ``get_optimizer_state_dict``, and ``set_state_dict``, which asks for
the state it loads into) key the entries of ``state_dict()`` by parameter FQN, and ``dcp.save`` writes each key
once, taking the ranks' entries of one key for replicas. This rank's shard of stages 1-3 on several ranks is no
replica: saved so, the checkpoint held one rank's shard and its load failed. So where DCP's helpers ask (found
from the caller's frames) and the state is sharded, ``state_dict()`` is the full layout (``full_state_dict()``: a
collective, and DCP calls its helpers on every rank), the same on every rank, which ``load_state_dict`` takes at any
world size and stage. The whole state is then held on every rank until DCP lets it go: where it does not fit a
rank's memory, ``zero_kernels.checkpoint`` is the sharded checkpoint.
"""

from __future__ import annotations

import sys

_DCP = "torch.distributed.checkpoint"
OUTSIDE_GATHERED = (
    "torch.distributed.checkpoint's state-dict helpers were called outside opt.gathered_params() with "
    "zero_quantized_weights on several ranks: there each rank holds the other ranks' parameters dequantized (the "
    "quantized all-gather's values), and so does the model's state_dict, which get_state_dict saves and "
    "set_state_dict loads into the weights. Call get_state_dict, dcp.save, dcp.load and set_state_dict inside "
    "`with opt.gathered_params():`, where every parameter is exact, as at stage 3"
)
_FRAMES = 3  # the caller of ``state_dict`` and the frames above it that are looked at


def asked_by_dcp() -> bool:
    """Whether the ``state_dict()`` calling this was called from DCP's state-dict helpers."""
    frame = sys._getframe(2)  # 0: here, 1: state_dict, 2: its caller
    for _ in range(_FRAMES):
        if frame is None:
            return False
        if str(frame.f_globals.get("__name__", "")).startswith(_DCP):
            return True
        frame = frame.f_back
    return False
