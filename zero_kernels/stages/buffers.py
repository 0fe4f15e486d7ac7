"""The records a pipeline keeps: its flat buffers, the collectives in flight, a step's inputs and result.

``FlatBuffer``: the tensors of one (param group, dtype) buffer, laid out by ``layout.BufferLayout``
(params reversed, buckets of ``Pipeline.bucket_numel()`` elements, every bucket split into
``num_shards`` equal parts; parameters straddle bucket and shard boundaries): ``param_flat`` (full
parameters, each ``p.data`` a view of it; stage 3 replaces it), ``grad_flat`` (full gradients; stages
0 and 1) or ``grad_shard`` (this rank's reduced gradients; stages 2 and 3), ``exp_avg``/``exp_avg_sq``
(fp32, this rank's shard), ``max_exp_avg_sq`` (fp32 shard, allocated when the param group first uses
AMSGrad) and ``master`` (fp32 shard, only when the parameters are bf16/fp16; fp32 parameters are their
own master).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from ..comm.handles import Handle
from .layout import Bucket, BufferLayout, Slot


@dataclass
class FlatBuffer:
    """Tensors of one (param group, dtype) buffer; ``layout`` says where everything is."""

    group: int
    layout: BufferLayout
    params: list[torch.nn.Parameter]  # the group's trainable parameters of this dtype, group order
    indices: list[int]  # each parameter's index in the optimizer (AdamW state_dict numbering)
    dtype: torch.dtype
    device: torch.device
    param_flat: Optional[torch.Tensor] = None
    grad_flat: Optional[torch.Tensor] = None
    grad_shard: Optional[torch.Tensor] = None
    master: Optional[torch.Tensor] = None
    exp_avg: Optional[torch.Tensor] = None
    exp_avg_sq: Optional[torch.Tensor] = None
    max_exp_avg_sq: Optional[torch.Tensor] = None  # AMSGrad's running maximum of exp_avg_sq (when used)
    master_version: int = -1  # master._version after the optimizer's own last write into it (``stages.master``)
    dequantized: bool = False  # qwZ: a step's int8 all-gather wrote the other ranks' parts of param_flat
    pending: list[int] = field(default_factory=list)  # per bucket: parameters still to report
    scratch: dict[int, torch.Tensor] = field(default_factory=dict)  # per bucket: gradients still being filled
    filled: dict[int, set[int]] = field(default_factory=dict)  # per bucket: slots copied into its scratch
    written: set[int] = field(default_factory=set)  # buckets whose part of grad_shard holds this step's gradients
    # Offload (``stages.placement``): the first bucket whose state is in the tier (every bucket's count: none),
    # the disk tier's sub-groups of the state's files, as (first bucket, end bucket, shard offset, elements), and,
    # while the state attributes hold only the device part, the call that makes them whole host tensors again.
    tier_from: int = 0
    groups: list[tuple[int, int, int, int]] = field(default_factory=list)
    swap_in: Optional[Callable[[], None]] = None
    edits_owed: Optional[Callable[[], None]] = None  # the masters take the parameters' edits at the next read-in
    guessed: Optional[Callable[[], None]] = None  # rolls back the updates run during backward (``speculation``)

    def ready(self) -> None:
        """Roll back what backward updated ahead of the step (``speculation``), make the state tensors whole (a tier
        may keep part of them elsewhere between uses: ``placement``), then give the masters the edits owed to them
        (``placement.adopt_when_read``)."""
        if self.guessed is not None:
            self.guessed()
        if self.swap_in is not None:
            self.swap_in()
        if self.edits_owed is not None:
            owed, self.edits_owed = self.edits_owed, None
            owed()

    def index_of(self, slot: Union[Slot, int]) -> int:
        """The optimizer index (AdamW ``state_dict`` numbering) of the parameter in ``slot`` (a slot or its number)."""
        if isinstance(slot, int):
            slot = self.layout.slots[slot]
        return self.indices[slot.param]

    def param_of(self, slot: Union[Slot, int]) -> torch.Tensor:
        """The parameter in ``slot`` (a slot or its number)."""
        if isinstance(slot, int):
            slot = self.layout.slots[slot]
        return self.params[slot.param]

    def indexed_slots(self) -> Iterator[tuple[int, Slot]]:
        """(optimizer index, slot) of every parameter of the buffer, in layout order."""
        for slot in self.layout.slots:
            yield self.index_of(slot), slot

    def shard_slice(self, t: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        """The part of a shard-sized tensor ``t`` that belongs to ``bucket``."""
        return t.narrow(0, bucket.shard_offset, bucket.shard_numel)

    def rank_slice(self, t: torch.Tensor, bucket: Bucket, rank: int) -> torch.Tensor:
        """``rank``'s part of ``bucket`` in a full-buffer-sized tensor ``t``."""
        return t.narrow(0, bucket.rank_start(rank), bucket.shard_numel)

    def bucket_slice(self, t: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        """All of ``bucket`` in a full-buffer-sized tensor ``t``."""
        return t.narrow(0, bucket.start, bucket.numel)


@dataclass(frozen=True)
class Inflight:
    """A collective the pipeline started: completed in issue order (``handle.wait()``, then ``epilogue``)."""

    handle: Handle
    epilogue: Optional[Callable[[], None]] = None
    held: tuple[torch.Tensor, ...] = ()  # buffers only this operation keeps (counted by ``memory_tensors``)


@dataclass(frozen=True)
class GroupHyper:
    """Hyper-parameters of one param group for this step (read from ``param_groups`` each step)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw: bool
    amsgrad: bool = False
    maximize: bool = False


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (contiguous, one dtype) hold the same bytes: -0.0 is not 0.0, a NaN equals itself.
    Compared as the widest integers that tile them (8 bytes where they can: a few times faster than bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nbytes = a.numel() * a.element_size()
    words = next(d for d in (torch.int64, torch.int32, torch.int16, torch.uint8) if nbytes % d.itemsize == 0)
    return torch.equal(a.reshape(-1).view(torch.uint8).view(words), b.reshape(-1).view(torch.uint8).view(words))


def storage_bytes(tensors: Sequence[Optional[torch.Tensor]]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once). A ``meta`` tensor (a
    stand-in for a shard kept in a file) holds no memory and counts nothing: its storage's address is 0, as is that
    of every other meta tensor and of an empty one, so keyed by address it counted the size of whichever came last."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
