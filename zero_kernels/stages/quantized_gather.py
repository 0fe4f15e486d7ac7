"""ZeRO++'s quantized weights (qwZ): parameter all-gathers that send int8 blocks and dequantize on arrival.

What crosses the wire for one bucket is each rank's *payload*: its shard of the bucket quantized to
int8 in blocks of at most ``WEIGHT_BLOCK`` elements, as even as a multiple of 4 allows (``Payload``; one
float32 scale per block, ``kernels.quant``), the integers followed by the
scales in one byte buffer. Every rank's shard of a bucket has the same size, so every payload does too:
one all-gather of payloads, then each chunk is dequantized into its place in the full buffer. The
rank's own chunk is never quantized: it is copied from the shard (or is the shard already), so each
rank's own parameters stay exact and what it holds of the OTHER ranks' parameters is the dequantized
value, within half a block scale of the exact one.

The payload is made once per version of the shard (``WeightQuantizer``): after the step updates the
shard, the first gather quantizes it, and every later gather of that step (the backward's, activation
checkpointing's recomputation, ``gathered_params``) reuses it. The fp32 master, state dicts,
checkpoints and ``full_state_dict()`` never see the quantized values.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ..comm.handles import Handle, Works
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

    def quantize(self, shard: torch.Tensor) -> torch.Tensor:
        payload = torch.empty(self.nbytes, dtype=torch.uint8, device=shard.device)
        quantize(shard.reshape(-1), WEIGHT_BITS, self.block, out=self.view(payload))
        return payload


class WeightQuantizer:
    """This rank's quantized shards, one per (buffer, bucket), remade only when the shard changed.

    A copy is reused while the shard's version (every in-place write of torch bumps it) and the
    quantizer's generation (``changed``, called by the step, whose kernels may write the shard directly)
    are those it was made at.
    """

    def __init__(self) -> None:
        self.generation = 0
        self._copies: dict[tuple, tuple[tuple[int, int], torch.Tensor]] = {}

    def changed(self) -> None:
        """The shards were written (the step): every copy is stale."""
        self.generation += 1
        self._copies.clear()

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

    return Handle(Works([inner]), (gathered, payload, full, shard), unpack, name), gathered


def publish(engine: Any, full: torch.Tensor, shard: torch.Tensor, name: str, traffic: Traffic) -> Handle:
    """Stages 1-2 (and stage 3's persistent units) after the step: the quantized all-gather of the updated
    ``shard`` into ``full``, whose chunk of this rank is ``shard`` itself (exact)."""
    layout = Payload(shard.numel())
    traffic.quantized += layout.nbytes
    traffic.unquantized_equivalent += shard.numel() * shard.element_size()
    return all_gather_quantized(engine, full, shard, layout.quantize(shard), layout, own_exact=False, name=name)[0]
