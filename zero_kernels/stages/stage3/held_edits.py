"""``gathered_params()`` without ``modifier_rank``: edits that differ between the ranks are reported.

At the block's end each rank writes its own part of every parameter back into its shard (and stage 3 keeps the
persistent parameters whole on every rank). Edits that differ between ranks (``if rank == 0:
model.load_state_dict(sd)`` without ``modifier_rank=0``) leave each shard with its own rank's values: a model that
none of the ranks holds, which used to go unsaid.

So each rank takes an exact sum of the bits of each full buffer and of the model's other parameters when the block
begins and when it ends (``word_sums``: 16-bit words, or bytes for 1-byte dtypes, added in int64, which wraps and so
is exact whatever the order; a NaN equals itself), and before writing back the ranks compare them in one small
all-reduce (``edited_differently``). A buffer that some rank edited and whose values now differ between ranks is
reported: every rank logs a WARNING naming the first parameter that differs (``differing``, over that buffer's
parameters), saying that each shard now holds its own rank's part and to pass ``modifier_rank`` when one rank made
the change. Values that differed before the block and that no rank touched are not this block's doing (a master
written through ``opt.state`` reaches the other ranks' copies only at the next step).

The write-back itself is unchanged: a rank-dependent edit made from each rank's own state (a state dict taken while
the copies of the other ranks' parts were stale) means each rank's own part. A ``p.data = ...`` inside the block is
taken as before and not compared (only what the buffers hold is).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

log = logging.getLogger("zero_kernels")

_CHUNK = 1 << 24  # words per int64 temporary (128 MiB)


def word_sums(tensors: Sequence[Optional[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """An int64 vector on ``device``: the wrapping sum of each tensor's bits (0 for None or empty)."""
    zero = torch.zeros((), dtype=torch.int64, device=device)
    sums = [_word_sum(t).to(device) if t is not None and t.numel() else zero for t in tensors]
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64, device=device)


def _word_sum(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().view(-1)  # a strided view (every other column) flattens to stride 2: no word view
    words = flat.view(torch.uint8 if flat.element_size() == 1 else torch.int16)
    return torch.stack([chunk.to(torch.int64).sum() for chunk in words.split(_CHUNK)]).sum()


def differing(engine: Any, sums: torch.Tensor) -> list[int]:
    """The positions of ``sums`` (every rank's, in the same order) that are not the same on every rank."""
    return marked_differing(engine, sums, torch.ones_like(sums))


def edited_differently(engine: Any, before: torch.Tensor, after: torch.Tensor) -> list[int]:
    """The positions of ``after`` that some rank changed from its ``before`` and that are not the same on every
    rank now (values that already differed and that no rank edited are left alone: not this block's doing)."""
    return marked_differing(engine, after, (before != after).to(torch.int64))


def marked_differing(engine: Any, values: torch.Tensor, marked: torch.Tensor) -> list[int]:
    """The positions that some rank ``marked`` (non-zero) and where ``values`` differ between ranks (one all-reduce
    of the maxima of ``marked``, ``values`` and ``-values``)."""
    if engine.world_size == 1 or values.numel() == 0:
        return []
    n = values.numel()
    packed = torch.cat([marked, values, -values])
    engine.all_reduce(packed, op="max", name="held.edits").wait()
    some, differ = packed[:n] > 0, packed[n : 2 * n] != -packed[2 * n :]
    return (some & differ).nonzero().flatten().tolist()


def warn(name: str) -> None:
    """Say that the ranks wrote different values of ``name`` back (a WARNING, every rank)."""
    log.warning(
        "zero_kernels: gathered_params(): the ranks hold different values of %s after an edit inside the block (made "
        "on some ranks only, or with different values); each rank wrote its own part back, so the model now holds "
        "each rank's values in that rank's part. If one rank made the change (if rank == 0: load...), pass "
        "modifier_rank=k (gathered_params(modifier_rank=k)): its values then reach every rank",
        name,
    )
