"""How stage 3 gathers one bucket of a unit: plain, quantized (qwZ), or from the secondary partition (hpZ).

Plain: one all-gather of every rank's shard over the data-parallel group.

qwZ (``zero_quantized_weights``): the same all-gather of int8 payloads (``stages.quantized_gather``),
made once per version of the shard (by the step's Adam kernel, in its epilogue, for the buckets it updates
whole) and reused by every gather until the next step.

hpZ (``zero_hpz_partition_size`` = H, usually the ranks per node): the first gather of a unit after
the step goes over the whole group as above; the unit then keeps a *secondary partition* of what it
received: the H ranks of one hpZ group (consecutive ranks of one node, ``comm.groups.node_subgroup``) split the gathered
bucket into H parts, and the rank of place j in its group keeps part j (the W/H world chunks from
j·W/H; int8 payloads as received when qwZ is on, so half the bytes of DeepSpeed's bf16 copy). Every later
gather of the unit until the step (the backward's, a recomputation under activation checkpointing,
``gathered_params``) is an all-gather of those parts inside the hpZ group, which never crosses a node
boundary. The parts hold exactly the values the first gather produced, so the backward sees the
forward's parameters bit for bit (and, without qwZ, exactly the shards). The secondary partition is
dropped when the shard changes: at the step, and at any write into the shard (``gathered_params``,
a loaded state dict or checkpoint, a parameter assigned between steps).

A shard in host memory (``offload_param``) is copied to the gathered buffer's device first (``on_device``:
the shard; with qwZ its int8 payload, quantized on the host, and the shard as well, for this rank's chunk of the
gathered values, which stays exact); ``uploaded`` counts those bytes; the host writers of the shard wait for
those copies (``uploads``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from ...comm import Handle, make_engine
from ...comm.groups import node_subgroup
from ...comm.handles import Works, used_here
from ...config.zero_config import check_hpz
from ..layout import Bucket
from ..quantized_gather import Payload, Traffic, WeightQuantizer, all_gather_quantized, dequantize_chunks
from ..uploads import Uploads

if TYPE_CHECKING:
    from .pipeline import Stage3Buffer


class UnitGathers:
    """The gathers of stage 3's units with the ZeRO++ options of ``options``; one per pipeline."""

    def __init__(self, engine: Any, options: Any, traffic: Traffic, quantizer: WeightQuantizer, uploads: Uploads):
        self.engine = engine
        self.uploads = uploads  # the pipeline's: its host writers wait for the copies up recorded there
        world = engine.world_size
        self.quantized = bool(options.quantized_weights) and world > 1
        self.hpz_size = int(options.hpz_partition_size) if world > 1 else 1
        self.quantizer = quantizer  # the pipeline's: the step leaves its payloads there
        self.traffic = traffic
        self.secondary_engine: Optional[Any] = None
        check_hpz(int(options.hpz_partition_size), world)
        if self.hpz_size > 1:
            if world != dist.get_world_size():
                raise ValueError(
                    "zero_optimization.zero_hpz_partition_size needs the optimizer on the default process group "
                    f"(its groups follow the nodes); this one has {world} of {dist.get_world_size()} ranks"
                )
            self.secondary_engine = make_engine(
                node_subgroup(self.hpz_size, "zero_optimization.zero_hpz_partition_size")
            )
        self.uploaded = 0  # bytes of host shards copied to the device for a gather (``offload_param``)
        self._layouts: dict[int, Payload] = {}
        self._received: dict[int, list[tuple[Bucket, torch.Tensor]]] = {}  # id(buf) -> what to keep, until finish

    def layout(self, numel: int) -> Payload:
        if numel not in self._layouts:
            self._layouts[numel] = Payload(numel)
        return self._layouts[numel]

    def changed(self) -> None:
        """The step wrote the shards: quantized copies and secondary partitions are stale."""
        self.quantizer.changed()

    def on_device(self, t: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """``t`` on the device of ``full``: a copy up when ``t`` is in host memory (``offload_param``)."""
        if t.device == full.device:
            return t
        self.uploaded += t.numel() * t.element_size()
        return self.uploads.copy_up(t, full.device)

    # ------------------------------------------------------------------ one bucket
    def start(
        self,
        buf: "Stage3Buffer",
        bucket: Bucket,
        shard: torch.Tensor,
        name: str,
        *,
        keep: bool = True,
        exact: bool = False,
    ) -> Handle:
        """Issue the gather of ``bucket`` of ``buf`` into ``buf.full``; ``shard`` is this rank's part. ``keep``:
        hand what was received to ``finish`` for the secondary partition (hpZ); ``exact``: a plain all-gather
        over the whole group, kept for nothing (``gathered_params()``: full values to save or edit)."""
        full = buf.bucket_slice(buf.full, bucket)
        if exact:
            return self.engine.all_gather(full, self.on_device(shard, full), name=name)
        if self._secondary_valid(buf, shard):
            return self._from_secondary(buf, bucket, full, shard, name)
        if not self.quantized:
            self.traffic.plain += shard.numel() * shard.element_size()
            handle = self.engine.all_gather(full, self.on_device(shard, full), name=name)
            received = full
        else:
            layout = self.layout(shard.numel())
            key = self.quantizer.key(buf, bucket)
            payload = self.on_device(self.quantizer.payload(key, shard, layout), full)
            self.traffic.quantized += layout.nbytes
            self.traffic.unquantized_equivalent += shard.numel() * shard.element_size()
            exact = self.on_device(shard, full)  # this rank's chunk stays exact: the shard itself, on the device
            handle, received = all_gather_quantized(
                self.engine, full, exact, payload, layout, own_exact=True, name=name
            )
        if keep and self.secondary_engine is not None:
            self._received.setdefault(id(buf), []).append((bucket, received))
        return handle

    def finish(self, buf: "Stage3Buffer", shard: torch.Tensor) -> None:
        """After the gathers of ``buf`` completed: keep this rank's part of them as the secondary partition."""
        received = self._received.pop(id(buf), None)
        if not received:
            return
        size, place = self.hpz_size, self.secondary_engine.rank
        parts = []
        for bucket, whole in received:
            n = whole.numel() // size
            parts.append(whole.narrow(0, place * n, n).clone())
        buf.secondary = parts
        buf.secondary_stamp = self.quantizer.stamp(shard)

    def tensors(self) -> list[torch.Tensor]:
        """The quantized copies of this rank's shards (memory)."""
        return self.quantizer.tensors()

    def _secondary_valid(self, buf: "Stage3Buffer", shard: torch.Tensor) -> bool:
        if buf.secondary is None:
            return False
        if buf.secondary_stamp != self.quantizer.stamp(shard):
            buf.secondary = None
            return False
        return True

    def _from_secondary(
        self, buf: "Stage3Buffer", bucket: Bucket, full: torch.Tensor, shard: torch.Tensor, name: str
    ) -> Handle:
        part = buf.secondary[bucket.index]
        engine = self.secondary_engine
        self.traffic.intra_node += part.numel() * part.element_size()
        if not self.quantized:
            return engine.all_gather(full, part, name=f"{name}.hpz")
        layout = self.layout(shard.numel())
        gathered = torch.empty(part.numel() * self.hpz_size, dtype=torch.uint8, device=part.device)
        inner = engine.all_gather(gathered.view(torch.float32), part.view(torch.float32), name=f"{name}.hpz")
        own, exact = self.engine.rank, self.on_device(shard, full)

        def unpack() -> None:
            dequantize_chunks(gathered, layout, full, own, exact)
            used_here(gathered, exact)

        return Handle(Works([inner]), (gathered, part, full, exact), unpack, name)
