"""qgZ: a reduce-scatter whose traffic is int4 blocks, in two hops along the node boundary (ZeRO++).

``QuantizedReduceScatter.reduce_scatter(out, inp)`` has the engine's contract: ``inp`` holds
``world_size`` chunks of ``out.numel()`` elements, chunk ``r`` for global rank ``r``; every rank gets
the sum over ranks of its chunk in ``out`` (any averaging is the caller's, as with the engine). On
``nodes`` nodes of ``L`` ranks each (``comm.groups.node_groups()``):

1. each rank quantizes, for every rank of its node, the ``nodes`` chunks bound for that rank's column
   (the ranks with its local rank on every node), and sends them in one all-to-all inside the node;
2. each rank dequantizes the ``L`` pieces it got, sums them in fp32 (the node's partial sums of its
   column's chunks), requantizes the partial for each node, and sends them in one all-to-all across
   nodes (the ranks of its column);
3. each rank dequantizes the ``nodes`` partials of its own chunk and sums them into ``out``.

Each piece sent is quantized on its own (padded to whole blocks), so any size, any world size and any
node count (odd too) work, and nothing ever falls back to the unquantized path. On one node the second
hop has nothing to do (one quantized hop); with one rank per node the first has nothing to send (one
quantized hop, across nodes). Error per element: each hop adds at most half a block's scale per source
(``kernels.quant_reference``). Cross-node bytes per rank: ``nodes - 1`` int4 pieces of ``out.numel()``
values each: a quarter of the bytes of a bf16 reduce-scatter, an eighth of an fp32 one (plus one fp32
scale per block).

Error feedback (``zeropp_loco_param``, after LoCo): with ``err_beta = b`` each hop keeps, per bucket, the
moving average ``e <- b * e + (1 - b) * (c - Q(c))`` of its quantization error, where ``c = x + e`` is
what it quantizes in place of ``x``; over many reductions of a bucket the errors cancel instead of
adding up. The buffers (fp32, one bucket's hop inputs) are zeroed every ``reset_T`` reductions; where a
reduction held inf or NaN (an fp16 overflow step) they are zeroed at once, so the next step starts clean.
A non-finite input reaches ``out``: its block dequantizes to NaN at every hop, so the step's non-finite
check sees it (values that shared the block, possibly bound for other ranks, become NaN too; that check
is over every rank, so the step is skipped either way).

The kernels come in as ``codec`` (``zero_kernels.kernels``: ``quantize``, ``dequantize``,
``QuantizedBlocks``): ``comm`` and ``kernels`` are wings of the same layer and do not import each other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist

from .control import ControlLink
from .engine_base import check_pair
from .groups import node_groups
from .handles import Handle
from .objects import all_gather_objects

log = logging.getLogger("zero_kernels")

LOCO_KEYS = ("err_beta", "reset_T")


class Codec(Protocol):
    """What the collective needs of the kernels: ``zero_kernels.kernels`` is one."""

    QuantizedBlocks: type

    def quantize(self, x: torch.Tensor, bits: int, block: int) -> Any: ...

    def dequantize(self, qb: Any, dtype: torch.dtype) -> torch.Tensor: ...


@dataclass(frozen=True)
class ErrorFeedback:
    """LoCo's error feedback: ``beta`` (``err_beta``) and ``reset_every`` (``reset_T``) reductions."""

    beta: float = 0.8
    reset_every: int = 1024

    def __post_init__(self) -> None:
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or not 0.0 <= self.beta < 1.0:
            raise ValueError(f"zeropp_loco_param.err_beta must be a number in [0, 1), got {self.beta!r}")
        if isinstance(self.reset_every, bool) or not isinstance(self.reset_every, int) or self.reset_every < 1:
            raise ValueError(f"zeropp_loco_param.reset_T must be a positive int, got {self.reset_every!r}")

    @classmethod
    def from_loco(cls, param: Optional[dict]) -> Optional["ErrorFeedback"]:
        """The ``zeropp_loco_param`` dict (``err_beta``, ``reset_T``) as an ``ErrorFeedback``; None stays None."""
        if param is None:
            return None
        if not isinstance(param, dict) or set(param) - set(LOCO_KEYS):
            unknown = sorted(set(param) - set(LOCO_KEYS)) if isinstance(param, dict) else param
            raise ValueError(f"zeropp_loco_param: unknown {unknown!r}; allowed keys: {', '.join(LOCO_KEYS)}")
        defaults = cls()
        return cls(param.get("err_beta", defaults.beta), param.get("reset_T", defaults.reset_every))


@dataclass
class _Sent:
    """One hop in flight: its work, the bytes sent and the buffer they are received into."""

    work: Any
    send: torch.Tensor
    recv: torch.Tensor
    numel: int  # values per row (padded to whole blocks)


class QuantizedReduceScatter:
    """The engine's ``reduce_scatter`` with int4 (or int8) traffic in two hops; see the module docstring.

    Args:
        engine: the data-parallel comm engine; its group must be the default group (the node groups
            are made over it). Built once per optimizer: the first call of ``node_groups()`` is collective.
        codec: the quantization kernels (``zero_kernels.kernels``).
        bits: 4 (qgZ) or 8.
        block: elements per quantization block (one fp32 scale each).
        error_feedback: LoCo's error feedback, or None.
    """

    def __init__(
        self,
        engine: Any,
        codec: Codec,
        *,
        bits: int = 4,
        block: int = 2048,
        error_feedback: Optional[ErrorFeedback] = None,
    ):
        self.engine, self.codec, self.bits, self.block = engine, codec, bits, block
        self.feedback = error_feedback
        self._errors: dict[tuple[Any, int], torch.Tensor] = {}
        self._reductions: dict[Any, int] = {}
        self.bytes = {"input": 0, "intra": 0, "inter": 0}  # bytes of gradients reduced, int4 bytes sent per hop
        self._logged = False
        self._on_device: dict[tuple[str, torch.device], torch.Tensor] = {}  # (index name, device) -> its copy
        self.world_size = engine.world_size
        if self.world_size > 1:
            self._make_routes()

    def _make_routes(self) -> None:
        group = self.engine.group
        world = dist.get_world_size()
        if self.world_size != world or any(dist.get_global_rank(group, r) != r for r in range(world)):
            raise ValueError(
                "zero_quantized_gradients needs the data-parallel group to be the default process group "
                f"(its ranks in order); this one has {self.world_size} of the {world} ranks"
            )
        groups = node_groups()
        places = all_gather_objects(ControlLink(self.engine).get(), (groups.node, groups.local_rank), name="qgZ.grid")
        at = {place: rank for rank, place in enumerate(places)}
        self.nodes, self.local = groups.nodes, groups.local_world_size
        self.intra, self.inter = groups.intra, groups.inter
        intra_locals = [places[dist.get_global_rank(groups.intra, i)][1] for i in range(self.local)]
        # hop 1: row i holds the chunks of the ranks in the column of intra rank i, in node order
        self._intra_order = torch.tensor([at[(node, lr)] for lr in intra_locals for node in range(self.nodes)])
        # hop 2: row j holds the partial bound for inter rank j's node
        self._inter_rows = torch.tensor([places[dist.get_global_rank(groups.inter, j)][0] for j in range(self.nodes)])

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, *, name: str = "", key: Any = None) -> Handle:
        """Sum ``inp`` (world_size chunks of ``out.numel()``) over ranks into ``out``; ``key`` (default
        ``name``) names the bucket's error-feedback state. ``inp`` is read before this returns."""
        what = f"zero_kernels qgZ: reduce_scatter of bucket '{name}' on rank {self.engine.rank} of {self.world_size}"
        check_pair(what, out, inp, self.world_size)
        if inp.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{what}: gradients of {inp.dtype}; allowed: float32, bfloat16, float16")
        if self.world_size == 1 or out.numel() == 0:
            out.copy_(inp[: out.numel()])
            return Handle(None, ())
        key = name if key is None else key
        n = out.numel()
        self._count(key, inp, n)
        rows = self._arrange(inp, n)
        if self.local > 1:
            first = self._send(rows, self.intra, key, 0)
            finish: Callable[[], None] = lambda: self._after_intra(first, out, n, key)  # noqa: E731
        else:
            first = self._send(self._by_node(rows[0, : self.nodes * n].float(), n), self.inter, key, 1)
            finish = lambda: out.copy_(self._received(first)[:n])  # noqa: E731
        return Handle(first.work, (inp, out, first.send, first.recv), finish, what)

    def _arrange(self, inp: torch.Tensor, n: int) -> torch.Tensor:
        """``inp``'s chunks as hop 1 sends them: one row per intra rank, each padded to whole blocks."""
        width = self.nodes * n
        rows = torch.zeros(self.local, self._padded(width), dtype=inp.dtype, device=inp.device)
        order = self._index("_intra_order", inp.device)
        chunks = inp.view(-1, n).index_select(0, order)
        rows[:, :width].view(self.local, self.nodes, n).copy_(chunks.view(self.local, self.nodes, n))
        return rows

    def _by_node(self, partial: torch.Tensor, n: int) -> torch.Tensor:
        """The node partial (``nodes * n`` values) as hop 2 sends it: one row per inter rank, padded."""
        rows = torch.zeros(self.nodes, self._padded(n), dtype=partial.dtype, device=partial.device)
        rows[:, :n].copy_(partial.view(self.nodes, n).index_select(0, self._index("_inter_rows", partial.device)))
        return rows

    def _after_intra(self, first: _Sent, out: torch.Tensor, n: int, key: Any) -> None:
        partial = self._received(first)[: self.nodes * n]
        if self.nodes == 1:
            out.copy_(partial)
            return
        second = self._send(self._by_node(partial, n), self.inter, key, 1)
        second.work.wait()
        out.copy_(self._received(second)[:n])

    def _index(self, name: str, device: torch.device) -> torch.Tensor:
        """The host index tensor ``name`` (``_intra_order``, ``_inter_rows``) on ``device``, copied there once: a
        copy from pageable host memory per bucket would make the host wait for the device in every backward hook."""
        key = (name, device)
        if key not in self._on_device:
            self._on_device[key] = getattr(self, name).to(device)
        return self._on_device[key]

    def _padded(self, numel: int) -> int:
        return -(-numel // self.block) * self.block

    def _send(self, rows: torch.Tensor, group: Any, key: Any, hop: int) -> _Sent:
        """Quantize each row (with error feedback) and start the all-to-all of one row per group rank."""
        count, width = rows.shape
        values = self._compensated(rows, key, hop)
        qb = self.codec.quantize(values.view(-1), self.bits, self.block)
        if self.feedback is not None:
            self._remember_error(values, qb, key, hop)
        scales = qb.scales.view(torch.uint8).view(count, -1)
        send = torch.cat([qb.data.view(count, -1), scales], dim=1)
        recv = torch.empty_like(send)
        self.bytes["intra" if hop == 0 else "inter"] += send.numel() * (count - 1) // count
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)
        return _Sent(work, send, recv, width)

    def _received(self, sent: _Sent) -> torch.Tensor:
        """The sum, in fp32, of the rows received (one per source), each dequantized."""
        count = sent.recv.shape[0]
        data_bytes = sent.numel * self.bits // 8
        data = sent.recv[:, :data_bytes].contiguous().view(-1)
        scales = sent.recv[:, data_bytes:].contiguous().view(torch.float32).view(-1)
        qb = self.codec.QuantizedBlocks(data, scales, count * sent.numel, self.bits, self.block)
        values = self.codec.dequantize(qb, torch.float32).view(count, sent.numel)
        total = values[0].clone()
        for row in values[1:]:  # row by row: torch's sum over dim 0 is several times slower here
            total.add_(row)
        return total

    def _compensated(self, rows: torch.Tensor, key: Any, hop: int) -> torch.Tensor:
        """What a hop quantizes: the rows, plus the error it kept for them (fp32) with error feedback."""
        if self.feedback is None:
            return rows
        error = self._errors.get((key, hop))
        if error is None or error.shape != rows.shape or (self._reductions[key] - 1) % self.feedback.reset_every == 0:
            error = self._errors[(key, hop)] = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
        return rows.float() + error

    def _remember_error(self, values: torch.Tensor, qb: Any, key: Any, hop: int) -> None:
        beta = self.feedback.beta
        sent = self.codec.dequantize(qb, torch.float32).view(values.shape)
        error = self._errors[(key, hop)].mul_(beta).add_(values - sent, alpha=1.0 - beta)
        error.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # an overflow step must not poison the next ones

    def _count(self, key: Any, inp: torch.Tensor, n: int) -> None:
        self._reductions[key] = self._reductions.get(key, 0) + 1
        self.bytes["input"] += inp.numel() * inp.element_size()
        if self._logged:
            return
        self._logged = True
        sent = self._padded(self.nodes * n) * self.bits // 8 * (self.local - 1) if self.local > 1 else 0
        across = self._padded(n) * self.bits // 8 * (self.nodes - 1)
        log.info(
            "zero_kernels qgZ: %d nodes x %d ranks; bucket '%s': %d bytes of %s gradients per rank reduced as int%d "
            "blocks of %d (+ fp32 scales): about %d bytes sent inside the node, %d across nodes, per rank",
            self.nodes, self.local, key, inp.numel() * inp.element_size(), str(inp.dtype).replace("torch.", ""),
            self.bits, self.block, sent, across,
        )  # fmt: skip


__all__ = ["Codec", "ErrorFeedback", "LOCO_KEYS", "QuantizedReduceScatter"]
