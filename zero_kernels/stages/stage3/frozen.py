"""Stage 3's frozen parameters: partitioned like the trainable ones, exactly, or in int8 (ZeRO++).

As in DeepSpeed, stage 3 shards the frozen parameters of the model too (a large frozen base under
small trainable adapters, a frozen reference model): each module's frozen floating-point parameters
of one dtype form a ``FrozenUnit``, gathered before the module's forward and its backward (the input
gradient of a frozen ``Linear`` needs its weight) and freed after, like a trainable unit. Between uses
each rank keeps only its chunk of the unit (``1/N`` of it, flattened and padded to the world size):

- ``ExactChunk`` (the default): the chunk as it is; a gather all-gathers the chunks into the full buffer
  the parameters view, so every rank sees the original values bit for bit;
- ``Int8Chunk`` (``zero_quantized_nontrainable_weights``): the chunk as int8 in blocks with one float32
  scale each (``Payload``), about a quarter of fp32's bytes and half of bf16's. A gather all-gathers the
  payloads and dequantizes every chunk, this rank's own included: every rank sees the same values, each
  within half a block scale of the original. The quantization is lossy by design and done once; the
  original is not kept anywhere.

With ``offload_param`` (``cpu`` or ``nvme``) the chunks live in host memory (``InHost``), as DeepSpeed offloads
frozen parameters with the others, and each gather copies this rank's chunk up first.

No gradient buffer, master or optimizer state exists for them; they are never reduced nor stepped.
Parameters under ``stage3_param_persistence_threshold`` elements stay whole on every rank, as trainable
ones do; so do frozen parameters that are not floating point (int8 only: other than fp32, bf16 and fp16).
A frozen parameter given to the optimizer later (``add_param_group`` after ``requires_grad_(True)``)
leaves its unit: the unit is gathered once and rebuilt without it (``Stage3Pipeline``); one unfrozen
and given no param group is refused at the step (``adopt.check_unfrozen``), as at every stage.

Writes. New values reach the chunk (re-quantized in int8; every rank must make the same change): values
assigned while the unit is freed (``p.data = ...``) are taken at its next gather (or by ``adopt_pending``);
values written inside ``gathered_params()`` are taken when the block ends; a checkpoint load sets them
(``assign``). A chunk none of whose values changed is left as it is. In int8, a block whose values are
already the dequantization of some int8 block (a checkpoint's saved values, the untouched blocks of a
written chunk) keeps them exactly (``quantize_keeping``); the other blocks are within half of their new scale.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from ...comm.handles import Handle, Works, used_here
from ...kernels.quant import dequantize
from ..adopt import check_compatible, check_freed
from ..casts import cast_through, take_casts, was_cast
from ..quantized_gather import Payload, Traffic, dequantize_chunks
from . import full_shape
from .storage import GatherStorage, freed

QUANTIZABLE = (torch.float32, torch.bfloat16, torch.float16)

NameOf = Callable[[torch.Tensor], str]


class OnDevice:
    """Where chunks live without ``offload_param``: where they were made, beside the parameters."""

    def keep(self, chunk: torch.Tensor) -> torch.Tensor:
        """``chunk`` as this home holds it."""
        return chunk

    def up(self, chunk: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``chunk`` on the device of ``like``, for a gather."""
        return chunk

    def moves(self, device: torch.device) -> bool:
        """Whether chunks of parameters on ``device`` live elsewhere (in host memory)."""
        return False


class InHost(OnDevice):
    """``offload_param``: chunks in host memory (page-locked with ``pin_memory`` where CUDA is there), copied up for
    each gather by ``up`` (the pipeline's ``gathers.on_device``: counted, its host memory read until copied). Where
    the device is host memory (``shares``: a CPU-only machine) a chunk stays where it is.

    Args:
        pin: page-locked host tensors.
        up: ``(chunk, like) ->`` the chunk on ``like``'s device.
        shares: whether a device is host memory that chunks stay in.
    """

    def __init__(
        self,
        pin: bool,
        up: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        shares: Callable[[torch.device], bool],
    ):
        self.pin, self._up, self._shares = pin, up, shares

    def keep(self, chunk: torch.Tensor) -> torch.Tensor:
        if not self.moves(chunk.device):
            return chunk
        host = torch.empty(chunk.shape, dtype=chunk.dtype, pin_memory=self.pin)
        host.copy_(chunk)
        return host

    def up(self, chunk: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return self._up(chunk, like)

    def moves(self, device: torch.device) -> bool:
        return not self._shares(device)


class ExactChunk:
    """This rank's chunk of a frozen unit as it is: gathers give the original values."""

    def __init__(self, values: torch.Tensor, home: OnDevice):
        self.home = home
        self.tensor = home.keep(values)

    def gather(self, engine: Any, full: torch.Tensor, traffic: Traffic) -> Handle:
        """Issue the all-gather of every rank's chunk into ``full``."""
        traffic.plain += self.tensor.numel() * self.tensor.element_size()
        return engine.all_gather(full, self.home.up(self.tensor, full), name="frozen")

    def read(self, out: torch.Tensor) -> None:
        """The chunk's values into ``out``."""
        out.copy_(self.tensor)

    def write(self, values: torch.Tensor) -> None:
        """Hold ``values`` (the caller's own tensor) from now on."""
        self.tensor = self.home.keep(values)


class Int8Chunk:
    """This rank's chunk of a frozen unit as an int8 payload (``zero_quantized_nontrainable_weights``)."""

    def __init__(self, values: torch.Tensor, home: OnDevice):
        self.home = home
        self.layout = Payload(values.numel())
        self.tensor = home.keep(self.layout.quantize(values))

    def gather(self, engine: Any, full: torch.Tensor, traffic: Traffic) -> Handle:
        """Issue the all-gather of every rank's payload; the handle's wait dequantizes them all into ``full``."""
        layout = self.layout
        gathered = torch.empty(engine.world_size * layout.nbytes, dtype=torch.uint8, device=full.device)
        traffic.quantized += layout.nbytes
        traffic.unquantized_equivalent += layout.numel * full.element_size()
        sent = self.home.up(self.tensor, gathered)
        # Sent as float32 words (the payload is a multiple of 4 bytes): every engine moves float32 as is.
        inner = engine.all_gather(gathered.view(torch.float32), sent.view(torch.float32), name="frozen")

        def unpack() -> None:
            dequantize_chunks(gathered, layout, full, -1, None)  # every chunk, this rank's too
            used_here(gathered)

        return Handle(Works([inner]), (gathered, sent, full), unpack, "frozen gather")

    def read(self, out: torch.Tensor) -> None:
        """The chunk dequantized into ``out``."""
        dequantize_chunks(self.tensor.to(out.device), self.layout, out, -1, None)

    def write(self, values: torch.Tensor) -> None:
        """Quantize ``values``, keeping the blocks that are already dequantized int8 exactly."""
        self.tensor = self.home.keep(quantize_keeping(self.layout, values))


class FrozenUnit:
    """Frozen parameters of one module: this rank's chunk of them, gathered whole around uses.

    Args:
        engine: the data-parallel comm engine.
        params: the unit's parameters (frozen, one dtype and device), holding their full values.
        name: qualified name of the holding module ('' for the root).
        kind: its class name.
        traffic: where the bytes sent are counted (``Traffic``).
        name_of: names a parameter in error messages.
        quantized: keep the chunk in int8 (``Int8Chunk``) rather than as it is (``ExactChunk``).
        home: where the chunk lives (``InHost`` with ``offload_param``; default: beside the parameters).
    """

    persistent = False

    def __init__(
        self,
        engine: Any,
        params: Sequence[nn.Parameter],
        name: str,
        kind: str,
        traffic: Traffic,
        name_of: NameOf,
        quantized: bool = False,
        home: Optional[OnDevice] = None,
    ):
        self.engine, self.traffic, self.name_of = engine, traffic, name_of
        self.home = home or OnDevice()
        self.params = list(params)
        self.shapes = [p.shape for p in self.params]
        for p, shape in zip(self.params, self.shapes):
            full_shape.label(p, shape)
        self.offsets = [0]
        for p in self.params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.param_numel = self.offsets[-1]
        world, rank = engine.world_size, engine.rank
        self.chunk = -(-self.param_numel // world)
        self.numel = self.chunk * world
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        self.uid, self.name, self.kind = -1, name, kind
        self.full: Optional[torch.Tensor] = None
        self.storage = GatherStorage(self.numel, self.dtype, self.device)
        self._handle: Optional[Handle] = None
        self._lo, self._hi = rank * self.chunk, min((rank + 1) * self.chunk, self.param_numel)
        own = torch.zeros(self.chunk, dtype=self.dtype, device=self.device)
        self._fill(own, {id(p): p.detach() for p in self.params})
        self.held = (Int8Chunk if quantized else ExactChunk)(own, self.home)
        self._free_params()

    # ------------------------------------------------------------------ scheduler face (``hooks.Unit``)
    def read_ahead(self) -> None:
        """Nothing to prepare (the chunks stay in memory)."""

    def start_gather(self) -> None:
        self.adopt_pending()
        self.full = self.storage.take()
        self._handle = self.held.gather(self.engine, self.full, self.traffic)

    def finish_gather(self) -> None:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        self.storage.used()
        for p, shape, offset in zip(self.params, self.shapes, self.offsets):
            p.data = self.full.narrow(0, offset, shape.numel()).view(shape)

    def free(self, hand_over: bool = False) -> None:
        self._free_params()
        self.full = None
        self.storage.release(hand_over)  # saved for backward views it too (``stage3.storage``)

    def reduce_grads(self) -> None:
        """Frozen: nothing to reduce."""

    # ------------------------------------------------------------------ writes
    def write_back(self) -> bool:
        """Inside ``gathered_params()`` (gathered): values written or assigned since the gather go into this rank's
        chunk; returns whether it changed (a chunk whose values did not is left as it is)."""
        if self.full is None:
            return False
        for p, shape in zip(self.params, self.shapes):
            check_compatible(self, p, shape, self.name_of)
        changed = self.assign({id(p): p.detach() for p in self.params})
        for p, shape, offset in zip(self.params, self.shapes, self.offsets):
            p.data = self.full.narrow(0, offset, shape.numel()).view(shape)
        return changed

    def adopt_pending(self) -> int:
        """Freed parameters given values (``p.data = ...``): this rank's parts go into its chunk and the parameters
        are freed again; returns how many."""
        if self.full is not None:
            return 0
        check_freed(self, self.params, self.name_of)
        given = {id(p): p.detach() for p in self.params if p.numel() != 0}
        # casts noted before a value was assigned are superseded by it (taken all the same, or a later gather rounds it)
        taken = {id(p): (p.numel() == 0, take_casts(p)) for p in self.params if was_cast(p)}
        casts = {i: dtypes for i, (freed, dtypes) in taken.items() if freed}
        if not given and not casts:
            return 0
        for p, shape in zip(self.params, self.shapes):
            if id(p) in given:
                check_compatible(self, p, shape, self.name_of)
        self.assign(given, casts)
        self._free_params()
        return len(given)

    def assign(
        self, values: Mapping[int, torch.Tensor], casts: Optional[Mapping[int, list[torch.dtype]]] = None
    ) -> bool:
        """Set the parameters ``values`` holds (id(parameter) -> full value), and round those ``casts`` names through
        the dtypes it gives (``model.half(); model.float()`` while freed): this rank's chunk is rebuilt from its
        current values and those, and stored again unless no value of it changed; returns whether it was."""
        own = torch.empty(self.chunk, dtype=self.dtype, device=self.device)
        self.held.read(own)
        held = own.clone()
        self._fill(own, values)
        for p, offset, end in zip(self.params, self.offsets, self.offsets[1:]):
            lo, hi = max(offset, self._lo), min(end, self._hi)
            if casts and id(p) in casts and hi > lo:
                piece = own.narrow(0, lo - self._lo, hi - lo)
                piece.copy_(cast_through(piece, casts[id(p)]))
        if torch.equal(own, held):
            return False
        self.held.write(own)
        return True

    def tensors(self) -> list[Optional[torch.Tensor]]:
        """What this unit holds beside its parameters now (memory): the chunk unless in host memory
        (``host_tensors``), and the full buffer while gathered."""
        return [self.full] if self.home.moves(self.device) else [self.held.tensor, self.full]

    def host_tensors(self) -> list[torch.Tensor]:
        """The chunk where it lives in host memory (``InHost``), else nothing."""
        return [self.held.tensor] if self.home.moves(self.device) else []

    # ------------------------------------------------------------------ helpers
    def _fill(self, own: torch.Tensor, values: Mapping[int, torch.Tensor]) -> None:
        """Copy the parts of ``values`` (id(parameter) -> full value) that fall in this rank's chunk into ``own``."""
        for p, offset, end in zip(self.params, self.offsets, self.offsets[1:]):
            value = values.get(id(p))
            lo, hi = max(offset, self._lo), min(end, self._hi)
            if value is None or hi <= lo:
                continue
            piece = value.reshape(-1).narrow(0, lo - offset, hi - lo)
            own.narrow(0, lo - self._lo, hi - lo).copy_(piece)

    def _free_params(self) -> None:
        for p in self.params:
            p.data = freed(self.dtype, self.device)


def frozen_members(
    module: nn.Module, holder: Mapping[int, int], threshold: int, quantized: bool
) -> dict[tuple, list[nn.Parameter]]:
    """The frozen parameters of ``module`` to partition, by unit key (-holder index, dtype, device), sorted.

    Args:
        module: the model.
        holder: id(parameter) -> index of the module whose unit it joins (``plan.holders``).
        threshold: ``stage3_param_persistence_threshold``: smaller parameters stay whole.
        quantized: int8 chunks (only fp32, bf16 and fp16 parameters are partitioned), else exact ones (every
            floating-point dtype).
    """
    units: dict[tuple, list[nn.Parameter]] = {}
    seen: set[int] = set()
    for p in module.parameters():
        kept = p.dtype in QUANTIZABLE if quantized else p.is_floating_point()
        if id(p) in seen or p.requires_grad or not kept or p.numel() < max(threshold, 1):
            continue
        seen.add(id(p))
        units.setdefault((-holder[id(p)], str(p.dtype), str(p.device)), []).append(p)
    return {key: units[key] for key in sorted(units)}


def quantize_keeping(layout: Payload, values: torch.Tensor) -> torch.Tensor:
    """``values`` (``layout.numel``) as a payload; each block whose values are the dequantization of some int8
    block gets a scale that gives them back exactly (quantizing a dequantized block again may move its scale by
    the rounding of its largest value), the other blocks the plain quantization.

    Per block, every element ``v = q * s`` (``q`` the integer quantization found) pins ``s`` to an interval: the
    products that round to ``v`` in the dtype, divided by ``q``. A scale inside every interval is tried, and kept
    for the blocks it reproduces.
    """
    payload = layout.quantize(values)
    blocks = layout.view(payload)
    back = dequantize(blocks, values.dtype)
    if torch.equal(back, values):
        return payload
    padded = torch.zeros(layout.data_bytes, dtype=values.dtype, device=values.device)
    padded[: layout.numel] = values
    inf = torch.full_like(padded, float("inf"))
    v = padded.double().view(layout.blocks, layout.block)
    below = torch.nextafter(padded, -inf).double().view_as(v)
    above = torch.nextafter(padded, inf).double().view_as(v)
    q = blocks.data.view(torch.int8).double().view_as(v)
    ends = torch.stack(((v + below) / 2 / q, (v + above) / 2 / q))
    used = q != 0
    low = torch.where(used, ends.amin(0), -torch.inf).amax(1)
    high = torch.where(used, ends.amax(0), torch.inf).amin(1)
    fitted = torch.where(low <= high, (low + high) / 2, blocks.scales.double()).float()
    found = blocks.scales.clone()
    blocks.scales.copy_(fitted)
    again = torch.zeros_like(padded)
    again[: layout.numel] = dequantize(blocks, values.dtype)
    kept = (again.view_as(v) == padded.view_as(v)).all(1)
    blocks.scales.copy_(torch.where(kept, fitted, found))
    return payload
