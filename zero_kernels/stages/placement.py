"""Where each bucket's optimizer state lives when it is offloaded: ``offload_optimizer.ratio``.

A share ``ratio`` of this rank's optimizer state (by elements) lives in the state tier (host memory or
files) and is updated by the host Adam; the rest stays on the parameters' device and is updated there by the
same path as without offload (``update.update_bucket``). The unit is the whole bucket, as DeepSpeed's unit
is the whole sub-group: buffers are placed as they are built, in order, and each keeps on the device the
longest run of its first buckets for which the elements kept on the device so far stay within
``(1 - ratio)`` of the elements placed so far (``device_buckets``). So at least ``ratio`` of the state is in
the tier, short of it by less than one bucket; a buffer may end up wholly on the device, or wholly in the tier.

Forms of a buffer's state tensors (``FlatBuffer.exp_avg``, ...; ``tier_from``: its first bucket in the tier):

- on the device (``tier_from`` = every bucket): device tensors, as without offload; the tier knows nothing of it;
- resident: host tensors of the whole shard. A buffer wholly in the host tier stays so; a split one (some
  buckets on each side) and one in the disk tier are so only between a read of the state door
  (``FlatBuffer.ready``, ``merge``) and the next step;
- split (``FlatBuffer.swap_in`` set): the state attributes hold only the device part, the shard's first
  ``cut`` elements, on the device (empty when every bucket is in the tier); the tier keeps the rest
  (``tier.spill``/``fill``: a host tensor per kind, or the disk tier's files). ``split`` makes it so at the
  step (after ``master.push_written``); ``merge`` undoes it for the door.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from . import master
from .buffers import FlatBuffer
from .layout import Bucket

if TYPE_CHECKING:
    from .base import Pipeline

KINDS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")
log = logging.getLogger("zero_kernels")


def device_buckets(pipeline: "Pipeline", buf: FlatBuffer) -> int:
    """How many of ``buf``'s first buckets keep their state on the device (see the module docstring); the
    buffers placed before it are ``pipeline.buffers``."""
    ratio = pipeline.tier.config.ratio
    kept = sum(cut(b) for b in pipeline.buffers)
    placed = sum(b.layout.shard_numel for b in pipeline.buffers) + buf.layout.shard_numel
    budget = (1.0 - ratio) * placed - kept
    count = 0
    for bucket in buf.layout.buckets:
        if bucket.shard_offset + bucket.shard_numel > budget:
            break
        count += 1
    return count


def cut(buf: FlatBuffer) -> int:
    """Elements of ``buf``'s shard whose state is on the device (its first ``tier_from`` buckets)."""
    buckets = buf.layout.buckets
    return buckets[buf.tier_from].shard_offset if buf.tier_from < len(buckets) else buf.layout.shard_numel


def on_device(buf: FlatBuffer) -> bool:
    """Whether every bucket of ``buf`` keeps its state on the device (the tier has no part of it)."""
    return buf.tier_from >= len(buf.layout.buckets)


def in_tier(buf: FlatBuffer, bucket: Bucket) -> bool:
    return bucket.index >= buf.tier_from


def tier_numel(buf: FlatBuffer) -> int:
    """Elements of ``buf``'s shard whose state is in the tier."""
    return buf.layout.shard_numel - cut(buf)


def part(buf: FlatBuffer, t: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """``bucket``'s part of ``t``, a tensor over the tier's part of the shard (from element ``cut``)."""
    return t.narrow(0, bucket.shard_offset - cut(buf), bucket.shard_numel)


def splits(tier: Any, buf: FlatBuffer) -> bool:
    """Whether ``buf``'s state is split between steps (else it stays resident: wholly in the host tier)."""
    return not on_device(buf) and (tier.kind == "disk" or buf.tier_from > 0)


def resident(buf: FlatBuffer) -> bool:
    return buf.swap_in is None


def tensors(buf: FlatBuffer) -> dict[str, torch.Tensor]:
    """``{kind: tensor}`` of the state tensors ``buf`` has, in whatever form."""
    return {kind: getattr(buf, kind) for kind in KINDS if getattr(buf, kind) is not None}


def split(tier: Any, buf: FlatBuffer) -> None:
    """Resident -> split: the device part goes up, the tier keeps the rest (see the module docstring)."""
    c, rest = cut(buf), tier_numel(buf)
    tier.spill(id(buf), {kind: t.narrow(0, c, rest) for kind, t in tensors(buf).items()})
    _keep_device_part(tier, buf)


@contextlib.contextmanager
def read_only(pipeline: "Pipeline", buf: FlatBuffer) -> Iterator[None]:
    """``buf``'s state whole in host memory while the block reads it (``FlatBuffer.ready``), its masters given the
    parameters' edits (``master.settle``), and where it was split before, split again after. The disk tier's files
    still hold every value unless the masters took edits: then they are written back (``split``), else nothing is.
    The host tier let its part go when it was read in (``HostTier.fill``): it takes it back, a copy in host memory.
    An edit taken later than now would not be the same: a write that puts a parameter back to what its master held
    before would hide it."""
    tier, was_split = pipeline.tier, not resident(buf)
    buf.edits_owed = None  # the settle below gives the masters the same edits
    buf.ready()
    took = master.settle(pipeline, buf)
    try:
        yield
    finally:
        if was_split and tier.kind == "disk" and not took:
            _keep_device_part(tier, buf)
        elif was_split:
            split(tier, buf)


@contextlib.contextmanager
def loading(tier: Any, buf: FlatBuffer) -> Iterator[None]:
    """The split ``buf``'s state whole in host memory while the block writes every element of it (a checkpoint
    load), without a read (``_blank``), then written back and split again (``split``). A write that fails leaves it
    whole, to be written by the next step (which raises if it fails again), as after a state read."""
    _blank(tier, buf)
    yield
    try:
        split(tier, buf)
    except OSError as err:
        log.warning("zero_kernels: the loaded optimizer state stays in host memory until the next step: %s", err)


def _blank(tier: Any, buf: FlatBuffer) -> None:
    """Split -> resident without a read: zeros for the whole state of ``buf``, for a load to write. The layout's
    padding elements keep the zeros they hold between steps (their gradients are zero), and the edits the masters
    owe are dropped: the load gives the masters and the parameters their values."""
    n = buf.layout.shard_numel
    for kind in tensors(buf):
        setattr(buf, kind, tier.zeros(n))
    buf.edits_owed = None
    master.record(buf)
    buf.swap_in = None


def adopt_when_read(pipeline: "Pipeline", buf: FlatBuffer) -> None:
    """The masters of ``buf``, whose state is split, take the parameters' edits when the state is next read in whole
    (``FlatBuffer.ready``), not now (``master.settle`` would read it in for that alone): until then the update
    adopts them where it updates (``adam_step(adopt_out=True)``), which gives what adopting them first gives."""
    owner, ref = weakref.ref(pipeline), weakref.ref(buf)  # the buffer holds this: no reference cycle

    def adopt() -> None:
        pipeline, buf = owner(), ref()
        if pipeline is not None and buf is not None:
            master.adopt_edits(pipeline, buf)

    buf.edits_owed = adopt


def _keep_device_part(tier: Any, buf: FlatBuffer) -> None:
    """Keep only the device part of ``buf``'s whole state (the tier holds the rest) and read the rest in again when
    it is next needed whole."""
    c = cut(buf)
    for kind, t in tensors(buf).items():
        setattr(buf, kind, t.narrow(0, 0, c).to(buf.device, copy=True))
    master.record(buf)
    buf.swap_in = _swap_in(tier, buf)


def start_split(pipeline: "Pipeline", buf: FlatBuffer, group_numels: list[int]) -> None:
    """A new buffer of the disk tier straight to split, its state never whole in host memory: the device part made
    on the device, the tier's part in new files for its sub-groups of ``group_numels`` elements (``add_buffer``:
    the moments read zeros there; ``tier.write_masters`` writes the master widened from the parameters where they
    are bf16/fp16)."""
    tier, c = pipeline.tier, cut(buf)
    buf.exp_avg = torch.zeros(c, dtype=torch.float32, device=buf.device)
    buf.exp_avg_sq = torch.zeros(c, dtype=torch.float32, device=buf.device)
    low = buf.dtype != torch.float32
    buf.master = torch.zeros(c, dtype=torch.float32, device=buf.device) if low else None
    tier.add_buffer(id(buf), group_numels, tuple(tensors(buf)))
    masters = []
    for bucket in buf.layout.buckets if low else ():
        value = pipeline.param_shard(buf, bucket)
        if in_tier(buf, bucket):
            masters.append((bucket.shard_offset - c, value))
        else:
            buf.shard_slice(buf.master, bucket).copy_(value)
    tier.write_masters(id(buf), masters)
    master.record(buf)
    buf.swap_in = _swap_in(tier, buf)


def _swap_in(tier: Any, buf: FlatBuffer) -> Callable[[], None]:
    """``merge(tier, buf)`` holding ``buf`` weakly: the buffer keeps it, and a reference cycle would keep the buffer,
    and with it the tier's files, until Python's collector ran (``del opt`` frees the optimizer at once)."""
    ref = weakref.ref(buf)
    return lambda: merge(tier, ref())


def add_zeros(tier: Any, buf: FlatBuffer, kind: str) -> None:
    """A new state ``kind`` of zeros for a buffer of the disk tier (AMSGrad's maximum): new files that read zeros
    (``tier.add_zeros``), and its device part on the device, or where the buffer is read in whole now (resident
    until the next step splits it), the whole shard's zeros in host memory."""
    tier.add_zeros(id(buf), kind)
    if resident(buf):
        setattr(buf, kind, tier.zeros(buf.layout.shard_numel))
    else:
        setattr(buf, kind, torch.zeros(cut(buf), dtype=torch.float32, device=buf.device))


def drop_zeros(tier: Any, buf: FlatBuffer, kind: str) -> None:
    """Undo ``add_zeros``: the buffer has no state ``kind`` again, its files removed."""
    tier.drop(id(buf), kind)
    setattr(buf, kind, None)


def merge(tier: Any, buf: FlatBuffer) -> None:
    """Split -> resident: the whole shard of each state tensor in host memory (``FlatBuffer.ready``)."""
    if resident(buf):
        return
    n, c = buf.layout.shard_numel, cut(buf)
    whole = {kind: tier.empty(n, torch.float32) for kind in tensors(buf)}
    for kind, t in whole.items():
        t.narrow(0, 0, c).copy_(getattr(buf, kind))
    tier.fill(id(buf), {kind: t.narrow(0, c, n - c) for kind, t in whole.items()})
    for kind, t in whole.items():
        setattr(buf, kind, t)
    master.record(buf)
    buf.swap_in = None


def memory(pipeline: "Pipeline") -> dict[str, list[torch.Tensor]]:
    """The state tensors by tier: ``optimizer`` (on the device: buffers wholly there, split buffers' device
    parts) and ``host`` (resident state, the host tier's parts of split buffers, the tier's host copies)."""
    device: list[torch.Tensor] = []
    host: list[torch.Tensor] = []
    for buf in pipeline.buffers:
        state = list(tensors(buf).values())
        (device if on_device(buf) or not resident(buf) else host).extend(state)
    return {"optimizer": device, "host": host + pipeline.tier.host_tensors()}
