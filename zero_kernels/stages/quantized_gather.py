"""ZeRO++'s quantized weights (qwZ): parameter all-gathers that send int8 blocks and dequantize on arrival.

What crosses the wire for one bucket is each rank's *payload*: its shard of the bucket quantized to
int8 in blocks of at most ``WEIGHT_BLOCK`` elements, as even as a multiple of 4 allows (``Payload``; one
float32 scale per block, ``kernels.quant``), the integers followed by the
scales in one byte buffer. Every rank's shard of a bucket has the same size, so every payload does too:
one all-gather of payloads, then each chunk is dequantized into its place in the full buffer. The
rank's own chunk is never quantized: it is copied from the shard (or is the shard already), so each
rank's own parameters stay exact and what it holds of the OTHER ranks' parameters is the dequantized
value, within half a block scale of the exact one.

The payload is made once per version of the shard (``WeightQuantizer``). The step makes it: the Adam kernel
that updates a bucket's shard quantizes, in its epilogue, the values it just wrote (``adam_step``'s
``quantized``: one Triton program per block of the payload's layout, or per-thread blocks in C++), so no
gather quantizes after a step, unlike DeepSpeed's, which quantizes at every gather. Every gather of that
step (the post-step all-gather of stages 1-2, stage 3's forward and backward, activation checkpointing's
recomputation) sends that payload. Where the step does not update the whole shard in one launch (parameters
with different step counts or without a gradient), or the state is offloaded (the host Adam updates a copy),
the first gather after the step quantizes the shard in a pass of its own, and later ones reuse it; a write
into the shard between steps (a new version) makes the next gather quantize again. The fp32 master, state dicts,
checkpoints and ``full_state_dict()`` never see the quantized values.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ..comm.agreement import note_dequantized_weights
from ..comm.handles import Handle, Works, used_here
from ..kernels.quant import QuantizedBlocks, dequantize, quantize

logger = logging.getLogger("zero_kernels")

WEIGHT_BITS = 8
# Elements per scale: 4 bytes of scale per 2048 int8 values cost 0.2 % of the payload.
WEIGHT_BLOCK = 2048


class Payload:
    """The byte layout of one rank's quantized shard of ``numel`` elements: integers, then float32 scales."""

    def __init__(self, numel: int):
        self.numel = int(numel)
        # At most WEIGHT_BLOCK elements, split evenly so that the last block is nearly full (little padding);
        # a multiple of 4 keeps the scales 4-byte aligned after the integers.
        blocks = max(1, -(-self.numel // WEIGHT_BLOCK))
        per_block = -(-self.numel // blocks)
        self.block = max(4, (per_block + 3) // 4 * 4)
        self.blocks = -(-self.numel // self.block)
        self.data_bytes = self.blocks * self.block
        self.nbytes = self.data_bytes + 4 * self.blocks

    def view(self, payload: torch.Tensor) -> QuantizedBlocks:
        """``payload`` (``nbytes`` uint8) seen as ``QuantizedBlocks``."""
        scales = payload.narrow(0, self.data_bytes, 4 * self.blocks).view(torch.float32)
        return QuantizedBlocks(payload.narrow(0, 0, self.data_bytes), scales, self.numel, WEIGHT_BITS, self.block)

    def empty(self, device: torch.device) -> torch.Tensor:
        """An uninitialised payload (``nbytes`` uint8) on ``device``."""
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def quantize(self, shard: torch.Tensor) -> torch.Tensor:
        """The payload of ``shard``, by a pass of the quantize kernel."""
        payload = self.empty(shard.device)
        quantize(shard.reshape(-1), WEIGHT_BITS, self.block, out=self.view(payload))
        return payload


class WeightQuantizer:
    """This rank's quantized shards, one per (buffer, bucket), remade only when the shard changed.

    A copy is reused while the shard's version (every in-place write of torch bumps it) and the
    quantizer's generation (``changed``, called by the step, whose kernels may write the shard directly)
    are those it was made at. The step's Adam kernel makes the copies of the buckets it updates whole in its
    epilogue (``hold``), so the first gather after the step finds them made.
    """

    def __init__(self) -> None:
        self.generation = 0
        self._copies: dict[tuple, tuple[tuple[int, int], torch.Tensor]] = {}
        self._held: list[tuple[tuple, torch.Tensor]] = []  # (key, shard) held by the step running now

    @staticmethod
    def key(buf: Any, bucket: Any) -> tuple[int, int]:
        """The copy's key: the buffer and the bucket."""
        return id(buf), bucket.index

    def changed(self) -> None:
        """The shards were written (the step): every copy is stale."""
        self.generation += 1
        self._copies.clear()
        self._held.clear()

    def stamp(self, shard: torch.Tensor) -> tuple[int, int]:
        """What a copy of ``shard`` made now is valid for."""
        return self.generation, shard._version

    def payload(self, key: tuple, shard: torch.Tensor, layout: Payload) -> torch.Tensor:
        stamp = self.stamp(shard)
        held = self._copies.get(key)
        if held is None or held[0] != stamp:
            held = (stamp, layout.quantize(shard))
            self._copies[key] = held
        return held[1]

    def take(self, key: tuple, shard: torch.Tensor, layout: Payload) -> torch.Tensor:
        """``payload``, forgotten here (a gather that happens once per version: the post-step all-gather)."""
        payload = self.payload(key, shard, layout)
        del self._copies[key]
        return payload

    def hold(self, key: tuple, shard: torch.Tensor, payload: torch.Tensor) -> None:
        """``payload``, made by the step's kernel from ``shard`` as it just wrote it, is the copy of ``shard``."""
        self._copies[key] = (self.stamp(shard), payload)
        self._held.append((key, shard))

    def seal(self) -> None:
        """The step's updates are over: what it held is the copy of the shards as the step leaves them.

        Only the step's kernels wrote the shards since ``hold``, each into its own bucket; a kernel that writes
        through torch (the reference backend) bumps the version of the whole buffer, which would otherwise
        make the copies of the buckets updated before it look stale.
        """
        for key, shard in self._held:
            if key in self._copies:
                self._copies[key] = (self.stamp(shard), self._copies[key][1])
        self._held.clear()

    def tensors(self) -> list[torch.Tensor]:
        return [t for _, t in self._copies.values()]


class Traffic:
    """Bytes this rank sent in parameter all-gathers: as int8 payloads, and what they stand for; logged once."""

    def __init__(self) -> None:
        self.quantized = 0
        self.unquantized_equivalent = 0
        self.plain = 0
        self.intra_node = 0
        self._logged = False

    def log_once(self) -> None:
        total = self.quantized + self.plain + self.intra_node
        if self._logged or not total:
            return
        self._logged = True
        full = self.unquantized_equivalent + self.plain + self.intra_node
        logger.info(
            "ZeRO++ parameter all-gathers of the first step: %d of %d bytes sent by this rank as int8 blocks "
            "(standing for %d bytes, %.0f %% of the gathered volume quantized), %d bytes inside the node (hpZ)",
            self.quantized,
            total,
            self.unquantized_equivalent,
            100.0 * self.unquantized_equivalent / full if full else 0.0,
            self.intra_node,
        )


def dequantize_chunks(
    gathered: torch.Tensor, layout: Payload, full: torch.Tensor, own: int, own_shard: Optional[torch.Tensor]
) -> None:
    """Every rank's payload in ``gathered`` dequantized into its chunk of ``full``, except chunk ``own``: a
    copy of ``own_shard`` (None: that chunk is the shard already)."""
    n = layout.numel
    note_dequantized_weights()
    for r in range(full.numel() // n):
        target = full.narrow(0, r * n, n)
        if r == own:
            if own_shard is not None:
                target.copy_(own_shard.reshape(-1))
            continue
        dequantize(layout.view(gathered.narrow(0, r * layout.nbytes, layout.nbytes)), full.dtype, out=target)


def all_gather_quantized(
    engine: Any,
    full: torch.Tensor,
    shard: torch.Tensor,
    payload: torch.Tensor,
    layout: Payload,
    *,
    own_exact: bool,
    name: str,
) -> tuple[Handle, torch.Tensor]:
    """All-gather every rank's ``payload`` and dequantize it into ``full``; returns the handle and the gathered
    payloads (to keep as hpZ's secondary partition). ``own_exact``: copy ``shard`` into this rank's chunk
    (False: that chunk of ``full`` is ``shard`` itself)."""
    gathered = torch.empty(engine.world_size * layout.nbytes, dtype=torch.uint8, device=payload.device)
    # Sent as float32 words (the payload is a multiple of 4 bytes): every engine moves float32 as is.
    inner = engine.all_gather(gathered.view(torch.float32), payload.view(torch.float32), name=name)
    own = engine.rank

    def unpack() -> None:
        dequantize_chunks(gathered, layout, full, own, shard if own_exact else None)
        used_here(gathered, shard if own_exact else None)

    return Handle(Works([inner]), (gathered, payload, full, shard), unpack, name), gathered


def publish(
    engine: Any, full: torch.Tensor, shard: torch.Tensor, payload: torch.Tensor, name: str, traffic: Traffic
) -> Handle:
    """Stages 1-2 (and stage 3's persistent units) after the step: the quantized all-gather of the updated
    ``shard`` (``payload``: its int8 copy) into ``full``, whose chunk of this rank is ``shard`` itself (exact)."""
    layout = Payload(shard.numel())
    traffic.quantized += layout.nbytes
    traffic.unquantized_equivalent += shard.numel() * shard.element_size()
    return all_gather_quantized(engine, full, shard, payload, layout, own_exact=False, name=name)[0]
