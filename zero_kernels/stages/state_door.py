"""The one door to the sharded optimizer state: everything outside ``stages/`` that reads or writes a
shard, a flat buffer or the layout goes through here.

What it serves:

- the state tensors of a buffer (``KINDS``: Adam's ``exp_avg`` and ``exp_avg_sq``, AMSGrad's
  ``max_exp_avg_sq`` once a group has used it, the fp32 ``master`` of bf16/fp16 parameters), named once;
- sharded state (``shard_state``/``load_shard_state``): the flat fp32 shards of every buffer, valid only
  for the same layout (``layout_signature``: world size, stage, buffers and buckets), for the sharded
  state dict and the copies;
- full state (``gather_full_state``/``scatter_full_state``): ``{param index: {"step", "exp_avg",
  "exp_avg_sq"[, "max_exp_avg_sq"][, "master"]}}`` with tensors shaped like the parameters, the
  ``torch.optim.AdamW`` layout (which keeps extra keys such as ``master``). Gathering is a collective
  (every rank must call it); scattering only reads this rank's parts;
- per-parameter pieces this rank holds (``held_pieces``/``piece_views``: the ``opt.state`` views);
- one parameter's fp32 value, state or reduced gradient, as this rank's runs of it (``runs``, ``write_runs``)
  and whole (``assemble``: a collective): DeepSpeed's tensor-fragment functions (``optim.fragments``);
- a checkpoint's pieces out and in (``save_pieces``, ``load_pieces``, ``whole_params``), which hide
  where the parameters live (whole in ``param_flat`` at stages 0-2, this rank's ``param_shard`` at
  stage 3);
- a checkpoint load that stopped part way (``stopped_load``): steps, saves and state dicts are refused until a load
  completes (``unfinished_load``).

Reading the masters first gives them what was written into the parameters since the last step
(``adopt.current``); loading one keeps it where it rounds to the parameter's value, and the next
step takes the parameter's value elsewhere (``master``): so a master from an older state than the
model's weights never undoes the weights.

Where a shard lives is this module's business alone. Without offload every state tensor is a device
tensor of the buffer (``buf.exp_avg``...), and the functions above hand out views of it. With
``offload_optimizer`` (``stages.offloaded``, ``stages.placement``, ``offload``) the same attributes are host
tensors (the host tier), or hold only the part on the device while the rest is in the disk tier's files or,
with ``ratio`` below 1, in the host tier: ``state_tensors`` (and every function here that reaches the state)
first calls ``buf.ready()``, which brings the whole shard into host memory; the next step puts it back (a
checkpoint's ``save_pieces`` reads one buffer at a time and puts each back at once, unchanged, and
``LoadBuffer.into`` puts each back written). So
does stage 3's parameter shard with ``offload_param`` on nvme (``stage3.disk_params``: a stand-in while its
file holds it). Full states are gathered and scattered where the parameters are. Callers (state dicts,
copies, ``opt.state``, checkpoints) do not change; the update reaches the tier through ``stages.offloaded``.
Every function here that writes a shard first waits for the copies up still reading host shards (``uploads``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from . import placement
from .adopt import current, follow_buffer
from .base import FlatBuffer, Pipeline
from .layout import Segment
from .master import edited, push, record, settle, unrecord, written

log = logging.getLogger("zero_kernels")
STATE_DICT_KEY = "zero_kernels.sharded"  # the optimizer state dicts' key for what AdamW's layout has no place for
KINDS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")  # every state tensor a buffer may have
MOMENTS = KINDS[:3]  # Adam's state proper (a reset zeroes these; the master is the parameter's value)
_MOMENTS = KINDS[:2]
# Param-group keys a load keeps the optimizer's own values of: torch's implementation flags and the weight-decay mode
# (``ShardedFusedAdam`` has one mode for all groups; a group saying the other is refused at the step).
KEEP_OWN = ("foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")
_AMSGRAD = KINDS[2]


def _mode(adam_w: bool) -> str:
    if adam_w:
        return "decoupled weight decay (AdamW, decoupled_weight_decay=True)"
    return "L2 weight decay added to the gradient (Adam, decoupled_weight_decay=False)"


def warn_other_decay_mode(saved_groups: list[dict[str, Any]], adam_w_mode: bool, what: str) -> None:
    """One WARNING, from ``what`` (the load), when a saved group with a non-zero ``weight_decay`` was trained in the
    other decay mode: the optimizer keeps its own (``KEEP_OWN``), so the loaded decay now acts another way."""
    for g, saved in enumerate(saved_groups):
        mode = saved.get("decoupled_weight_decay", saved.get("adam_w_mode"))
        if mode is None or bool(mode) == adam_w_mode or not float(saved.get("weight_decay", 0.0)):
            continue
        log.warning(
            "%s: param group %d was saved with %s and weight_decay=%g; this optimizer keeps its own mode, %s, so "
            "from now on that decay acts as its mode does. Build it with adam_w_mode=%s to go on as the state was "
            "trained",
            what, g, _mode(bool(mode)), float(saved["weight_decay"]), _mode(adam_w_mode), bool(mode),
        )  # fmt: skip
        return


def step_tensor(count: float) -> torch.Tensor:
    """A step count as ``torch.optim.AdamW`` keeps it: a 0-dim float32 tensor (float64 under a float64 default dtype),
    never in a bf16 or fp16 default dtype set by the user (which would round counts past 256 or 2048)."""
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(float(count), dtype=dtype)


def state_tensors(buf: FlatBuffer) -> dict[str, torch.Tensor]:
    """``{kind: this rank's shard}`` of the state tensors ``buf`` has, in ``KINDS`` order (read in from the
    disk tier's files when it holds them: written back at the next step)."""
    buf.ready()
    return {kind: getattr(buf, kind) for kind in KINDS if getattr(buf, kind) is not None}


def layout_signature(pipeline: Pipeline) -> list[Any]:
    """What must match for a sharded state to load: stage, world size, and each buffer's shape."""
    buffers = [
        [buf.group, str(buf.dtype), buf.layout.numel, [b.numel for b in buf.layout.buckets], buf.indices]
        for buf in pipeline.buffers
    ]
    return [pipeline.stage, pipeline.world_size, buffers]


def shard_state(pipeline: Pipeline) -> list[dict[str, torch.Tensor]]:
    """Copies of this rank's shards, one dict per buffer."""
    current(pipeline)
    return [{n: t.clone() for n, t in state_tensors(buf).items()} for buf in pipeline.buffers]


def load_shard_state(pipeline: Pipeline, states: list[dict[str, torch.Tensor]]) -> None:
    """Copy shards saved by ``shard_state`` (same layout, checked by the caller) into the buffers."""
    pipeline.uploads.wait()
    for buf, saved in zip(pipeline.buffers, states):
        _match_amsgrad(buf, _AMSGRAD in saved)
        for name, tensor in saved.items():
            if getattr(buf, name) is not None:
                getattr(buf, name).copy_(tensor)
        if buf.master is not None and "master" not in saved:
            pipeline.refresh_master(buf)
        record(buf)


def _match_amsgrad(buf: FlatBuffer, loaded: bool) -> None:
    """Before loading: a buffer receives AMSGrad's maximum when the state has one; else it restarts at zero."""
    buf.ready()
    if loaded and buf.max_exp_avg_sq is None:
        buf.max_exp_avg_sq = torch.zeros_like(buf.exp_avg_sq)
    elif not loaded and buf.max_exp_avg_sq is not None:
        buf.max_exp_avg_sq.zero_()


def _gather(pipeline: Pipeline, buf: FlatBuffer, shard: torch.Tensor) -> torch.Tensor:
    if pipeline.num_shards == 1:
        return shard
    shard = shard.to(buf.device)  # an offloaded shard is gathered where the parameters are
    full = torch.empty(buf.layout.numel, dtype=shard.dtype, device=shard.device)
    handles = [
        pipeline.engine.all_gather(buf.bucket_slice(full, b), buf.shard_slice(shard, b), name=f"state.{b.index}")
        for b in buf.layout.buckets
    ]
    for h in handles:
        h.wait()
    return full


def gather_full_state(pipeline: Pipeline, keep: bool = True, host: bool = False) -> dict[int, dict[str, torch.Tensor]]:
    """``{param index: {"step", "exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"][, "master"]}}`` for every parameter
    that has stepped (``master``: bf16/fp16 parameters).

    One state kind of one buffer is gathered whole at a time (on the parameters' device): every rank holds one
    full buffer of it at most, beside what it keeps.

    Args:
        pipeline: the pipeline whose shards are gathered (a collective: every rank calls it).
        keep: False on ranks that only take part: they return ``{}``.
        host: the entries in host memory (``consolidate_state_dict``, as ``ZeroRedundancyOptimizer`` keeps the
            consolidated state on the CPU), not on the parameters' device.
    """
    current(pipeline)
    out: dict[int, dict[str, torch.Tensor]] = {}
    for buf in pipeline.buffers:
        slots = [(index, slot) for index, slot in buf.indexed_slots() if pipeline.steps[index] != 0] if keep else []
        for index, _ in slots:
            out[index] = {"step": step_tensor(pipeline.steps[index])}
        for name, shard in state_tensors(buf).items():
            full = _gather(pipeline, buf, shard)
            for index, slot in slots:
                piece = full.narrow(0, slot.offset, slot.numel).view(slot.shape)
                out[index][name] = piece.to("cpu", copy=True) if host else piece.clone()
            del full  # before the next kind's buffer is gathered
    return dict(sorted(out.items()))  # in parameter order, as torch.optim.AdamW lists its state


def scatter_full_state(pipeline: Pipeline, state: dict[int, dict[str, torch.Tensor]]) -> None:
    """Load a full state (shapes checked by the caller); parameters absent from it start fresh, and low-precision
    parameters without a ``master`` entry (fp32 parameters ignore one) start their master from their values."""
    pipeline.uploads.wait()
    for buf in pipeline.buffers:
        entries = [state.get(i) for i in buf.indices]
        _match_amsgrad(buf, any(e is not None and _AMSGRAD in e for e in entries))
        for name in _MOMENTS + ((_AMSGRAD,) if buf.max_exp_avg_sq is not None else ()):
            _scatter(pipeline, buf, state, name)
        if buf.master is not None:
            pipeline.refresh_master(buf)
            _scatter(pipeline, buf, state, "master")
            record(buf)
        for index, slot in buf.indexed_slots():
            entry = state.get(index)
            pipeline.steps[index] = 0 if entry is None else int(float(entry["step"]))


def _scatter(pipeline: Pipeline, buf: FlatBuffer, state: dict, name: str) -> None:
    """This rank's shard of ``name`` from the state's entries; where they lack it: zeros, or for ``master``
    what the shard holds (the parameters' values)."""
    full = torch.zeros(buf.layout.numel, dtype=torch.float32, device=buf.device)
    given = torch.zeros(buf.layout.numel, dtype=torch.bool, device=buf.device)
    for index, slot in buf.indexed_slots():
        entry = state.get(index)
        if entry is not None and name in entry:
            full.narrow(0, slot.offset, slot.numel).copy_(entry[name].reshape(-1))
            given.narrow(0, slot.offset, slot.numel).fill_(True)
    shard = getattr(buf, name)
    full, given = full.to(shard.device), given.to(shard.device)  # an offloaded shard: this rank's part goes down
    for b in buf.layout.buckets:
        mine = buf.shard_slice(shard, b)
        values = buf.rank_slice(full, b, pipeline.shard_rank)
        mine.copy_(values if name != "master" else values.where(buf.rank_slice(given, b, pipeline.shard_rank), mine))


# ---------------------------------------------------------------- pieces: where this rank's state is
@dataclass
class HeldPiece:
    """What this rank holds of one parameter: ``numel`` elements from ``start`` in buffer ``buffer``'s shard
    (contiguous there), which are the elements ``ranges`` (first element, count) of the flattened parameter.

    ``shape`` is the parameter's; ``whole`` is True when this rank holds every element of it.
    """

    buffer: int
    index: int
    start: int
    shape: torch.Size
    numel: int = 0
    ranges: list[tuple[int, int]] = field(default_factory=list)

    @property
    def whole(self) -> bool:
        return self.numel == math.prod(self.shape)


def held_pieces(pipeline: Pipeline) -> dict[int, HeldPiece]:
    """``{id(parameter): its HeldPiece}`` for every parameter this rank holds state of."""
    pieces: dict[int, HeldPiece] = {}
    for b, buf in enumerate(pipeline.buffers):
        for seg in buf.layout.segments(pipeline.shard_rank):
            slot = buf.layout.slots[seg.slot]
            piece = pieces.setdefault(
                id(buf.params[slot.param]), HeldPiece(b, buf.index_of(slot), seg.shard_offset, slot.shape)
            )
            piece.numel += seg.numel  # contiguous in the shard (see layout)
            piece.ranges.append((seg.param_offset, seg.numel))
    return pieces


def piece_views(pipeline: Pipeline, piece: HeldPiece) -> dict[str, torch.Tensor]:
    """The state tensors of ``piece`` (views into the shards: writes change the optimizer), shaped as the
    parameter when this rank holds all of it, else 1-D."""
    buf = pipeline.buffers[piece.buffer]
    views = {kind: t.narrow(0, piece.start, piece.numel) for kind, t in state_tensors(buf).items()}
    return {kind: v.view(piece.shape) for kind, v in views.items()} if piece.whole else views


def trained_index(pipeline: Pipeline, p: torch.Tensor) -> Optional[int]:
    """``p``'s optimizer index when the pipeline trains it (on any rank), else None."""
    where = pipeline.where.get(id(p))
    if where is None:
        return None
    return pipeline.buffers[where[0]].index_of(where[1])


def trained_indices(pipeline: Pipeline) -> set[int]:
    """The optimizer indices of every parameter the pipeline trains."""
    return {i for buf in pipeline.buffers for i in buf.indices}


def param_numels(pipeline: Pipeline) -> dict[int, int]:
    """``{optimizer index: element count}`` of every trained parameter."""
    return {index: slot.numel for buf in pipeline.buffers for index, slot in buf.indexed_slots()}


def param_states(pipeline: Pipeline) -> Iterator[tuple[int, torch.Size, tuple[str, ...]]]:
    """(optimizer index, shape, the state kinds it has) of every trained parameter."""
    for buf in pipeline.buffers:
        kinds = tuple(placement.tensors(buf))  # a state a tier keeps is not read in: its kinds are the buffer's
        for index, slot in buf.indexed_slots():
            yield index, slot.shape, kinds


# ---------------------------------------------------------------- checkpoints: pieces out and in
@dataclass(frozen=True)
class SavedPiece:
    """A run of one parameter that this rank saves: from element ``start`` of the flattened parameter,
    its values (``value``) and its state (``state``: kind -> tensor), all of the same length."""

    index: int
    start: int
    value: torch.Tensor
    state: dict[str, torch.Tensor]


def save_pieces(pipeline: Pipeline) -> Iterator[SavedPiece]:
    """This rank's part of every buffer: its shard under the stage's layout, or, where every rank holds
    all of it (stage 0), the same layout cut into one part per rank; follow replaced parameters first
    (``adopt.follow_replaced``). Buffer by buffer, each piece valid until the next buffer's: the buffer's
    masters take what was written into its parameters (``settle``), and a state a tier keeps between steps is
    read in for its pieces only (``placement.read_only``), so a save holds one buffer's state in host memory at
    a time and writes back to the disk tier's files only the buffers whose masters took edits."""
    for buf in pipeline.buffers:
        with pipeline.params_read_briefly(buf), _read_only(pipeline, buf):
            yield from _buffer_pieces(pipeline, buf)


@contextlib.contextmanager
def _read_only(pipeline: Pipeline, buf: FlatBuffer) -> Iterator[None]:
    if pipeline.tier is not None:
        with placement.read_only(pipeline, buf):
            yield
    else:
        settle(pipeline, buf)
        yield


def _buffer_pieces(pipeline: Pipeline, buf: FlatBuffer) -> Iterator[SavedPiece]:
    layout = buf.layout
    if pipeline.num_shards != pipeline.world_size:
        layout = pipeline.build_layout(buf.params, num_shards=pipeline.world_size)
    own = layout is buf.layout
    state = state_tensors(buf)
    for seg in layout.segments(pipeline.rank if layout.num_shards > 1 else 0):
        slot = layout.slots[seg.slot]
        full_offset = slot.offset + seg.param_offset
        at = seg.shard_offset if own else full_offset
        if buf.param_flat is not None:
            value = buf.param_flat.narrow(0, full_offset, seg.numel)
        else:  # stage 3: this rank's parameter shard
            value = buf.param_shard.narrow(0, seg.shard_offset, seg.numel)
        views = {kind: t.narrow(0, at, seg.numel) for kind, t in state.items()}
        yield SavedPiece(buf.index_of(slot), seg.param_offset, value, views)


@dataclass(frozen=True)
class LoadPiece:
    """A run of one parameter that this rank loads: ``numel`` elements from element ``start`` of the
    flattened parameter into ``state`` (kind -> destination view) and, when the parameters are sharded
    (stage 3), into ``param``; ``dtype`` is the parameter's."""

    index: int
    start: int
    numel: int
    dtype: torch.dtype
    state: dict[str, torch.Tensor]
    param: Optional[torch.Tensor]


def load_pieces(pipeline: Pipeline) -> Iterator[LoadPiece]:
    """Where this rank's shard of every buffer is loaded into (see ``whole_params`` for parameters every
    rank holds whole)."""
    pipeline.writing_params()
    pipeline.uploads.wait()
    for buf in pipeline.buffers:
        yield from _buffer_load_pieces(pipeline, buf)


def _buffer_load_pieces(pipeline: Pipeline, buf: FlatBuffer) -> Iterator[LoadPiece]:
    state = state_tensors(buf)
    for seg in buf.layout.segments(pipeline.shard_rank):
        at, n = seg.shard_offset, seg.numel
        param = buf.param_shard.narrow(0, at, n) if buf.param_flat is None else None
        views = {kind: t.narrow(0, at, n) for kind, t in state.items()}
        yield LoadPiece(buf.index_of(seg.slot), seg.param_offset, n, buf.dtype, views, param)


@dataclass(frozen=True)
class LoadSpec:
    """Where a run of one parameter loads (``LoadPiece`` without its destinations): the state ``kinds`` it has and
    whether a parameter shard loads too (stage 3)."""

    index: int
    start: int
    numel: int
    dtype: torch.dtype
    kinds: tuple[str, ...]
    param: bool


class LoadBuffer:
    """One buffer's part of a checkpoint load (``load_buffers``): its runs now (``specs``), their destinations while
    ``into`` holds its state whole. A state a tier keeps between steps (``kept``) is loaded in place, one buffer at a
    time: made whole without a read (``placement.loading``), written and put back where it lives."""

    def __init__(self, pipeline: Pipeline, buf: FlatBuffer, amsgrad: Callable[[int], bool]):
        self.pipeline, self.buf = pipeline, buf
        self.kept = pipeline.tier is not None and not placement.resident(buf)
        # AMSGrad's maximum loads into a buffer without one: given to it by ``give_amsgrad``
        self.gains_max = buf.max_exp_avg_sq is None and any(amsgrad(i) for i in buf.indices)

    def specs(self) -> list[LoadSpec]:
        buf, have = self.buf, placement.tensors(self.buf)
        kinds = tuple(k for k in KINDS if k in have or (k == _AMSGRAD and self.gains_max))
        return [
            LoadSpec(buf.index_of(seg.slot), seg.param_offset, seg.numel, buf.dtype, kinds, buf.param_flat is None)
            for seg in buf.layout.segments(self.pipeline.shard_rank)
        ]

    @contextlib.contextmanager
    def into(self) -> Iterator[list[LoadPiece]]:
        """The destinations of ``specs``, in their order, valid inside the block."""
        with self.pipeline.params_loading(self.buf):
            with placement.loading(self.pipeline.tier, self.buf) if self.kept else contextlib.nullcontext():
                yield list(_buffer_load_pieces(self.pipeline, self.buf))


def load_buffers(pipeline: Pipeline, amsgrad: Callable[[int], bool]) -> list[LoadBuffer]:
    """Every buffer's part of a checkpoint load (see ``whole_params`` for parameters every rank holds whole);
    ``amsgrad(index)``: whether the load gives parameter ``index`` AMSGrad's maximum."""
    pipeline.writing_params()
    pipeline.uploads.wait()
    return [LoadBuffer(pipeline, buf, amsgrad) for buf in pipeline.buffers]


def give_amsgrad(pipeline: Pipeline, targets: list[LoadBuffer]) -> None:
    """Give AMSGrad's maximum (zeros until loaded: what a first AMSGrad step starts from) to the buffers of
    ``targets`` that load one and have none, once the load is checked: a load that fails leaves none."""
    for group in dict.fromkeys(t.buf.group for t in targets if t.gains_max):
        pipeline.allocate_max_exp_avg_sq(group)


def stopped_load(pipeline: Pipeline, failure: Optional[str]) -> None:
    """Record on every rank how the last checkpoint load ended: ``failure`` (what failed, on which rank) when it
    stopped part way, once it had begun writing (the state and parameters partly the checkpoint's, on some ranks),
    None when it completed (``unfinished_load``)."""
    pipeline.unfinished_load = failure


def unfinished_load(pipeline: Pipeline, action: str) -> Optional[str]:
    """The error for ``action`` (a step, a save) while the last checkpoint load stopped part way, else None: what
    it would read is partly the checkpoint's and partly what was there, so it waits for a load that completes (the
    caller says what it left unchanged)."""
    if pipeline.unfinished_load is None:
        return None
    return (
        f"{action}: the last zk.checkpoint.load stopped part way ({pipeline.unfinished_load}), after it had begun "
        "writing: the optimizer state and the parameters are partly the checkpoint's and partly what they were, and "
        "the ranks may differ: call zk.checkpoint.load again (on every rank) and let it complete first"
    )


def whole_params(pipeline: Pipeline) -> Iterator[tuple[int, torch.dtype, torch.Tensor]]:
    """(optimizer index, dtype, destination) of every parameter this rank holds whole (stages 0-2)."""
    for buf in pipeline.buffers:
        if buf.param_flat is not None:
            for index, slot in buf.indexed_slots():
                yield index, buf.dtype, buf.param_flat.narrow(0, slot.offset, slot.numel)


# ---------------------------------------------------------------- copies: the shards themselves
def shard_tensors(pipeline: Pipeline) -> list[dict[str, torch.Tensor]]:
    """This rank's state shards, one dict per buffer (the tensors themselves: the caller copies)."""
    return [state_tensors(buf) for buf in pipeline.buffers]


def written_masters(pipeline: Pipeline) -> list[bool]:
    """Per buffer: whether its master was written from outside since the optimizer last wrote it (``master``):
    such a master wins over the parameters at the next read or step, which a copy must know."""
    return [written(buf) for buf in pipeline.buffers]


def mark_written(pipeline: Pipeline, flags: list[bool]) -> None:
    """After loading a copy's shards: the masters ``written_masters`` flagged count as written from outside."""
    for buf, flag in zip(pipeline.buffers, flags):
        if flag:
            unrecord(buf)


def param_shards(pipeline: Pipeline) -> list[Optional[torch.Tensor]]:
    """Per buffer: this rank's parameter shard where parameters are sharded (stage 3), else None (a shard kept in a
    file is read in first, until the next step)."""
    for buf in pipeline.buffers:
        buf.ready()
    return [getattr(buf, "param_shard", None) for buf in pipeline.buffers]


def load_param_shards(pipeline: Pipeline, shards: list[Optional[torch.Tensor]]) -> None:
    """Copy ``param_shards``' values (same layout) into this rank's parameter shards (once the copies up still
    reading them are done: ``uploads``)."""
    pipeline.writing_params()
    pipeline.uploads.wait()
    for buf, values in zip(pipeline.buffers, shards):
        if values is not None:
            buf.ready()
            buf.param_shard.copy_(values)


def shard_numels(pipeline: Pipeline) -> list[int]:
    """Per buffer: the elements of this rank's shard."""
    return [buf.layout.shard_numel for buf in pipeline.buffers]


# ---------------------------------------------------------------- one parameter: its runs on this rank
PARAM, GRAD = "param", "grad"  # ``runs``' kinds besides ``KINDS``: the fp32 value, the reduced gradient


def runs(pipeline: Pipeline, p: torch.Tensor, kind: str) -> list[tuple[int, torch.Tensor]]:
    """(first element in the flattened parameter, 1-D view) of every run of ``p`` this rank holds of ``kind``:
    ``PARAM`` (its fp32 value: the master of a bf16/fp16 parameter, else the parameter's own storage), ``GRAD``
    (this step's reduced gradient, as the step reads it: call ``finish_grad_sync`` first; with the gradients in a
    file, copies) or a state kind of ``state_tensors``. Empty where this rank holds none of ``p``. ``PARAM``'s runs
    first take what was written into the parameter (``_current_master``): a value read is the one the step starts
    from. Only ``p``'s runs are touched: a loop over every parameter costs one pass over the state."""
    buf, slot_index = _home(pipeline, p)
    segs = _segments(pipeline, buf, slot_index)
    if kind != GRAD:
        buf.ready()
    if kind == PARAM and buf.master is not None:
        _current_master(pipeline, buf, segs)
    return [(seg.param_offset, _view(pipeline, buf, seg, kind)) for seg in segs]


def _home(pipeline: Pipeline, p: torch.Tensor) -> tuple[FlatBuffer, int]:
    """The buffer holding ``p`` and its slot there."""
    b, slot_index = pipeline.where[id(p)]
    return pipeline.buffers[b], slot_index


def _segments(pipeline: Pipeline, buf: FlatBuffer, slot_index: int) -> list[Segment]:
    """The pieces of slot ``slot_index`` in this rank's shard of ``buf``."""
    return [seg for seg in buf.layout.segments(pipeline.shard_rank) if seg.slot == slot_index]


def _write_segments(segs: list[Segment], shard: torch.Tensor, value: torch.Tensor) -> None:
    """Each of ``segs`` in ``shard`` (shard-sized) takes its elements of ``value`` (the flattened parameter)."""
    for seg in segs:
        shard.narrow(0, seg.shard_offset, seg.numel).copy_(value.narrow(0, seg.param_offset, seg.numel))


def device_of(pipeline: Pipeline, p: torch.Tensor) -> torch.device:
    """The device of the buffer holding ``p``."""
    return _home(pipeline, p)[0].device


def _current_master(pipeline: Pipeline, buf: FlatBuffer, segs: list[Segment]) -> None:
    """``master.settle`` for the runs ``segs`` alone: a master written from outside gives the parameters its values,
    else these runs of the master take the parameter's edits."""
    follow_buffer(pipeline, buf, pipeline.name_of)
    if written(buf):
        push(pipeline, buf)
        return
    for seg in segs:
        bucket = buf.layout.buckets[seg.bucket]
        live = pipeline.live_param_shard(buf, bucket).narrow(0, seg.shard_offset - bucket.shard_offset, seg.numel)
        mine = buf.master.narrow(0, seg.shard_offset, seg.numel)
        live = live.to(mine.device)
        mine.copy_(live.float().where(edited(live, mine), mine))
    record(buf)


def _view(pipeline: Pipeline, buf: FlatBuffer, seg: Segment, kind: str) -> torch.Tensor:
    if kind == GRAD:
        bucket = buf.layout.buckets[seg.bucket]
        return pipeline.grad_shard(buf, bucket).narrow(0, seg.shard_offset - bucket.shard_offset, seg.numel)
    if kind == PARAM and buf.master is None:
        if buf.param_flat is not None:
            return buf.param_flat.narrow(0, buf.layout.slots[seg.slot].offset + seg.param_offset, seg.numel)
        return buf.param_shard.narrow(0, seg.shard_offset, seg.numel)
    tensors = state_tensors(buf)
    name = "master" if kind == PARAM else kind
    if name not in tensors:
        held = ", ".join(k for k in tensors if k != "master")
        why = f"the parameter's optimizer state holds {held} ({_AMSGRAD} once its group uses AMSGrad)"
        raise KeyError(f"{name!r}: {why}")
    return tensors[name].narrow(0, seg.shard_offset, seg.numel)


def spread(pipeline: Pipeline, p: torch.Tensor, local: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """The flattened ``p`` (fp32, on its buffer's device) holding this rank's ``local`` runs, zeros elsewhere."""
    full = torch.zeros(math.prod(pipeline.param_shape(p)), dtype=torch.float32, device=device_of(pipeline, p))
    for start, values in local:
        full.narrow(0, start, values.numel()).copy_(values)
    return full


def assemble(pipeline: Pipeline, p: torch.Tensor, local: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """The whole of ``p`` (its full shape, fp32) from every rank's ``local`` runs (a collective where the
    parameters' state is sharded: each element comes from the one rank that holds it, bit for bit)."""
    full = spread(pipeline, p, local)
    if pipeline.num_shards > 1:  # one rank writes each element, the others add zeros: a sum of the bits is exact
        pipeline.engine.all_reduce(full.view(torch.int32), op="sum", name="fragment").wait()
    return full.view(pipeline.param_shape(p))


def write_runs(pipeline: Pipeline, p: torch.Tensor, kind: str, value: torch.Tensor) -> None:
    """Write this rank's runs of ``p``'s ``kind`` from ``value``, the flattened whole parameter (fp32): the state
    tensors, the master and, for ``PARAM``, the parameter itself wherever it is kept (rounded to its dtype: every
    rank's whole copy at stages 0-2, this rank's shard and a gathered copy at stage 3), or the gradient shard."""
    if kind == PARAM:
        pipeline.writing_params()
    pipeline.uploads.wait()
    buf, slot_index = _home(pipeline, p)
    if kind == GRAD and pipeline.grads_in_file(buf):
        shard = pipeline.reduced_shard(buf)
        _write_segments(_segments(pipeline, buf, slot_index), shard, value)
        pipeline.assign_reduced(buf, shard)
        return
    for start, view in runs(pipeline, p, kind):
        view.copy_(value.narrow(0, start, view.numel()))
    if kind == PARAM:
        _write_params(pipeline, buf, slot_index, value)
        record(buf)


def _write_params(pipeline: Pipeline, buf: FlatBuffer, slot_index: int, value: torch.Tensor) -> None:
    """The parameter's storage takes ``value`` (bf16/fp16: rounded, as a step leaves it from its master) in every
    copy the model may read, not only in this rank's runs."""
    slot = buf.layout.slots[slot_index]
    for whole in (buf.param_flat, getattr(buf, "full", None)):  # every rank's copy; stage 3's gathered one
        if whole is not None:
            whole.narrow(0, slot.offset, slot.numel).copy_(value)
    if buf.param_flat is None:
        _write_segments(_segments(pipeline, buf, slot_index), buf.param_shard, value)
