"""A unit of stage 3's trainable parameters as the scheduler sees it (``hooks.Unit``): one ``Stage3Buffer``.

Gather. ``start_gather`` all-gathers each bucket of this rank's parameter shard into ``full`` (a ``GatherStorage``
buffer; how each bucket is gathered is ``stage3.gathers``'s business), first taking values given to the parameters
while freed (``adopt``) and, for a shard kept in a file (``disk_params``), reading it through the pool (``read_ahead``
starts that early); ``finish_gather`` waits and points every ``p.data`` at its view of ``full``.

Free. ``free`` records the parameters written in place since the gather (``forward_writes``: lost now), sets every
``p.data`` to an empty tensor (the ``Parameter`` objects stay valid) and releases the storage (what autograd saved
of it is emptied too: ``stage3.storage``). ``reduce_grads`` hands each trainable parameter's gradient, or its
absence, to the pipeline's stage-2 path.

The unit holds its pipeline weakly: used after the optimizer is gone it raises ``RuntimeError``. The units of
frozen parameters are ``frozen.FrozenUnit``; which parameters form a unit is the pipeline's choice
(``pipeline``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from .. import adopt
from . import full_shape, guard
from .storage import GatherStorage, freed

if TYPE_CHECKING:
    from .pipeline import Stage3Buffer, Stage3Pipeline


class TrainableUnit:
    """A ``Stage3Buffer`` seen by the scheduler (``hooks.Unit``): all-gather into ``full``, free, hand grads on."""

    def __init__(self, pipeline: "Stage3Pipeline", buf: Stage3Buffer, uid: int, holder: nn.Module, name: str):
        self._pipeline, self.buf = weakref.ref(pipeline), buf
        self.params = buf.params
        self.numel = buf.layout.numel
        self.param_numel = sum(slot.numel for slot in buf.layout.slots)
        self.persistent = buf.persistent
        self.uid, self.name, self.kind = uid, name, type(holder).__name__
        self.storage = GatherStorage(buf.layout.numel, buf.dtype, buf.device)
        for slot in buf.layout.slots:
            full_shape.label(self.params[slot.param], slot.shape)
        self._handles: list = []
        self._versions: list[int] = []  # the parameters' version counters when gathered (``forward_writes``)

    @property
    def pipeline(self) -> "Stage3Pipeline":
        """The pipeline; ``RuntimeError`` once it is gone while the scheduler lives on (held by a kept error's
        traceback, as IPython's ``sys.last_traceback``): the model's parameters went with it."""
        pipeline = self._pipeline()
        if pipeline is None:
            raise RuntimeError(f"ZeRO stage 3: the model is used after its optimizer was deleted: {guard.ORPHANED}")
        return pipeline

    def read_ahead(self) -> None:
        """Start reading a shard kept in a file (``disk_params``) for the gather that follows."""
        if self.pipeline.disk_params is not None:
            self.pipeline.disk_params.read_ahead(self.buf)

    def start_gather(self) -> None:
        buf, disk = self.buf, self.pipeline.disk_params
        if disk is not None and adopt.given_values(self.params):
            disk.resident(buf)  # values given to the parameters go into the shard: read in from its file first
        adopt.adopt_assigned_shard(self.pipeline, buf, buf.param_shard, self.pipeline.name_of)
        buf.full = self.storage.take()
        shard = buf.param_shard if disk is None else disk.source(buf, self._settle)
        gathers, exact = self.pipeline.unit_gathers, self.pipeline.holding
        self._handles = [
            gathers.start(buf, b, buf.shard_slice(shard, b), f"gather.{b.index}", exact=exact)
            for b in buf.layout.buckets
        ]
        if disk is not None and buf.device.type == "cpu" and all(h.is_completed() for h in self._handles):
            self._settle()  # the gathers are over (one rank): a pool buffer goes back now, not at the unit's use

    def _settle(self) -> None:
        """The gathers waited for; a shard read from a file gives its pool buffer back."""
        for handle in self._handles:
            handle.wait()
        self._handles = []
        if self.pipeline.disk_params is not None:
            self.pipeline.disk_params.done(self.buf)

    def finish_gather(self) -> None:
        self._settle()
        self.storage.used()
        self.pipeline.unit_gathers.finish(self.buf, self.buf.param_shard)
        for slot in self.buf.layout.slots:
            self.params[slot.param].data = self.buf.full.narrow(0, slot.offset, slot.numel).view(slot.shape)
        self.record_versions()

    def record_versions(self) -> None:
        """What a write in place into the gathered parameters is measured from (``forward_writes``); read past the
        ``__torch_function__`` of parameters still marked freed (``stage3.guard``): 0.4 us a parameter instead of 6."""
        with torch._C.DisableTorchFunctionSubclass():
            self._versions = [p._version for p in self.params]

    def free(self, hand_over: bool = False) -> None:
        for k, (p, version) in enumerate(zip(self.params, self._versions)):
            if p._version != version:  # written in place since the gather: lost now (``forward_writes``)
                self.pipeline.forward_writes.record(self.buf.indices[k])
        for p in self.params:
            p.data = freed(self.buf.dtype, self.buf.device)
        self.buf.full = None
        self.storage.release(hand_over)  # what autograd saved from the forward views it too (``stage3.storage``)

    def reduce_grads(self) -> None:
        for p in self.params:
            if p.requires_grad:
                if p.grad is not None:
                    self.pipeline._on_grad_ready(p)
                else:
                    self.pipeline._on_no_grad(p)
