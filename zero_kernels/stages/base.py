"""The pipeline base class: everything the ZeRO stages share, and the hooks a stage overrides.

A pipeline owns the flat buffers of an optimizer's trainable parameters and drives three phases;
``ShardedFusedAdam`` keeps the books (param groups, hyper-parameters, loss scale) and calls in.

Buffers. ``add_group(group, params, indices)`` builds one ``buffers.FlatBuffer`` per (param group,
dtype) from ``layout.BufferLayout``, its buckets of ``bucket_numel()`` elements (``stages.buckets``).

Backward. A post-accumulate-grad hook on each trainable parameter calls ``_on_grad_ready(p)``:
it records that ``p`` has a gradient this step, and unless synchronisation is off (``no_sync``),
``_consume_grad`` moves ``p.grad`` into the stage's gradient buffer and each bucket whose
parameters have all reported is handed to ``_launch_bucket``, strictly in global bucket order so
every rank issues the same collectives in the same order. At the end of backward (an autograd
engine callback) buckets still waiting for parameters that got no gradient are launched too.
At most ``max_inflight`` reductions stay in flight: launching one more completes the oldest (its
epilogue, e.g. stage 2's add into the gradient shard, runs then), so a stage that reduces into
scratch buckets holds a few buckets during backward, not the whole gradient. A launched
collective owns its buffers (``Inflight.held``). Every reduction is complete when backward
returns: another backward before the step writes into the gradients again (stage 0 all-reduces
``p.grad``'s storage in place).

Step. ``step()`` finishes gradient synchronisation (``_before_step``: stage 1 reduce-scatters
here), combines across ranks (``stats``) the per-parameter "has a gradient" flags and the
squared gradient norm (clipping) or whether every gradient is finite (skipping), checks that every
rank passed the same hyper-parameters, turns the norm into the clip coefficient and skip flag on
the gradients' device (``outcome``), then runs the fused kernel once per bucket on this rank's
shard: master ``_master_shard``, gradient ``_grad_shard``, fp32 m and v; for low-precision
parameters the kernel writes the updated shard (``out=``) straight into ``_param_shard``, the
all-gather input, having first taken what was written there since the last step as the master's
value (``master``: in-place writes into bf16/fp16 parameters reach the fp32 master). ``_publish``
then all-gathers each bucket back into ``param_flat`` (overlapping the next bucket's kernel; with
``overlap_param_gather`` the step leaves them in flight until a parameter is used, ``param_gather``). A
kernel launch is split where per-parameter step counts differ; the counts advance once the step's
outcome is read (``outcome.StepCounts``).

Rules. A parameter without a gradient on any rank this step (``p.grad is None`` in
``torch.optim.AdamW`` terms) is not updated: no change to it, its m and v, or its step count.
Gradients are averaged over ranks (``grad_divisor``). Overrides: ``num_shards``,
``_place_params``, ``_allocate_grads``, ``_consume_grad``, ``_launch_bucket``, ``_before_step``,
``_grad_shard``, ``_param_shard``, ``_publish``, ``_norm_views``, ``_register_grad_hooks``,
``gathered_params``, ``zero_grad``.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, ClassVar, Iterator, Optional, Sequence

import torch

from ..comm import Handle
from ..control import ControlLink
from ..layout import Bucket, BufferLayout, align_elements
from . import adopt, buckets, grad_state, master, outcome, param_gather, stats, update
from .buffers import FlatBuffer, GroupHyper, Inflight
from .outcome import StepResult

_owners: dict[int, weakref.ref] = {}  # id(param) -> the pipeline whose hooks handle it (the latest)


def _grad_hook(ref: weakref.ref) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        pipeline = ref()
        if pipeline is not None and _owners.get(id(param)) is ref:
            pipeline._on_grad_ready(param)

    return hook


class Pipeline:
    """Base of the stage pipelines; see the module docstring for the phases and the overrides.

    Args:
        engine: communication engine from ``comm.make_engine`` (rank, world size, collectives).
        options: the ``zero_optimization`` options (``config.ZeroOptions``).
        impl: kernel backend for ``kernels.adam_step``/``flatten`` (None: ``ZERO_KERNELS_IMPL``).
        module: the model, when the optimizer was given one (stage 3 needs it).
        comm_dtype: the dtype gradients are reduced in (None: their own); see ``comm_dtype_of``.
    """

    stage: ClassVar[int]
    requires_module: ClassVar[bool] = False  # True: needs the model, not just its parameters
    grad_divisor_is_world: ClassVar[bool] = False  # True: the reduced gradients are sums over ranks
    max_inflight: ClassVar[int] = 2  # gradient reductions in flight during backward; older ones are completed
    allgather_by_bucket: ClassVar[bool] = False  # True: the step all-gathers parameters bucket by bucket
    reduces_in_backward: ClassVar[bool] = False  # True: a launched bucket is reduced then (stages 0, 2, 3)
    grads_in_p_grad: ClassVar[bool] = True  # the step reads p.grad (stages 0, 1); False: a shard only it holds

    def __init__(
        self,
        engine: Any,
        options: Any,
        *,
        impl: Optional[str] = None,
        module: Any = None,
        comm_dtype: Optional[torch.dtype] = None,
    ):
        self.engine = engine
        self.options = options
        self.comm_dtype = comm_dtype
        self.impl = impl
        self.module = module
        self.device: Optional[torch.device] = None  # the parameters' device, where exchanges run (set by the optimizer)
        self.buffers: list[FlatBuffer] = []
        self.where: dict[int, tuple[int, int]] = {}  # id(param) -> (buffer index, slot index)
        self.step_counts = outcome.StepCounts()  # optimizer param index -> Adam step count (``steps``)
        self._control_link = ControlLink(engine)  # host-side exchanges (``stats``) never wait for a device
        self.has_grad: dict[int, bool] = {}  # optimizer param index -> got a gradient this step
        self.sync_enabled = True
        self._ref = weakref.ref(self)
        self._hooks: list[Any] = []
        self._launch_order: list[tuple[int, int]] = []  # (buffer, bucket) in collective order
        self._next_launch = 0
        self._reported: set[tuple[int, int]] = set()  # (buffer, slot) that reported in this round
        self._inflight: list[Inflight] = []  # in issue order
        self._round_open = False
        self._synced = False  # a synchronised backward happened since the last step
        self._grads_final = False  # finish_grad_sync() ran since the last step
        self.window_open = False  # a backward delivered gradients since the last step or zero_grad (``window``)
        self.stepped_with: set[int] = set()  # parameters that had a gradient in the last step (grad_state)
        self._held: tuple[int, set[int]] = (-1, set())  # (buffers counted, held_indices())
        overlap = self.allgather_by_bucket and getattr(options, "overlap_param_gather", False)
        self.gathers = param_gather.ParamGathers(overlap)  # the step's all-gathers, kept in flight when overlapping

    # ---------------------------------------------------------------- construction
    @property
    def steps(self) -> dict[int, int]:
        """Optimizer param index -> Adam step count, the last step's outcome applied (``outcome.StepCounts``)."""
        return self.step_counts.settled()

    def settle(self) -> None:
        """Apply the last step's outcome to the step counts (``outcome.StepCounts.settle``)."""
        self.step_counts.settle()

    @property
    def _control(self) -> Any:
        """The engine for host data (``control``): this engine on gloo, else the process group's control
        engine (made at its first host exchange, on every rank at the same point)."""
        return self._control_link.get()

    @property
    def rank(self) -> int:
        return self.engine.rank

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    def comm_dtype_of(self, buf: FlatBuffer) -> torch.dtype:
        """The dtype ``buf``'s gradients are reduced in: ``communication_data_type``, else their own."""
        return self.comm_dtype or buf.dtype

    def accumulate_dtype_of(self, buf: FlatBuffer) -> torch.dtype:
        """The dtype reduced gradients of ``buf`` are kept and added up in: the wider of theirs and the
        communication dtype (fp32 for bf16 gradients reduced in fp32)."""
        return torch.promote_types(buf.dtype, self.comm_dtype_of(buf))

    @property
    def num_shards(self) -> int:
        """Ranks the optimizer state is split over (stage 0: 1)."""
        return self.world_size

    @property
    def shard_rank(self) -> int:
        return self.rank if self.num_shards > 1 else 0

    def bucket_numel(self, element_size: int = 4) -> int:
        """Elements per bucket of a buffer of ``element_size``-byte elements (``buckets.bucket_numel``).

        Args:
            element_size: bytes per element of the buffer.
        """
        allgather = self.options.allgather_bucket_size if self.allgather_by_bucket else None
        size = buckets.bucket_numel(self.engine.backend, element_size, self.options.reduce_bucket_size, allgather)
        unit = self.num_shards * align_elements(element_size)  # the layout's bucket unit: round down, not up
        return max(unit, size // unit * unit)

    def build_layout(self, params: Sequence[torch.nn.Parameter], num_shards: Optional[int] = None) -> BufferLayout:
        """The layout of a buffer of ``params`` (one dtype), its buckets of ``bucket_numel()`` elements.

        Args:
            params: the buffer's parameters, in group order.
            num_shards: parts per bucket (None: this stage's ``num_shards``).
        """
        size = self.bucket_numel(params[0].element_size()) if params else self.bucket_numel()
        return BufferLayout.build(params, bucket_numel=size, num_shards=num_shards or self.num_shards)

    def add_group(self, group: int, params: Sequence[torch.nn.Parameter], indices: Sequence[int]) -> None:
        """Build the buffers of param group ``group``; ``indices`` number ``params`` in the optimizer.

        Args:
            group: index of the param group.
            params: all of its parameters (frozen ones are skipped).
            indices: optimizer-wide index of each parameter (AdamW state_dict numbering).
        """
        trainable = [(p, i) for p, i in zip(params, indices) if p.requires_grad]
        by_dtype: dict[tuple[torch.dtype, torch.device], list[tuple[torch.nn.Parameter, int]]] = {}
        for p, i in trainable:
            by_dtype.setdefault((p.dtype, p.device), []).append((p, i))
        built = []  # every layout is built (and checked) before anything changes
        for (dtype, device), members in by_dtype.items():
            ps = [p for p, _ in members]
            built.append(FlatBuffer(group, self.build_layout(ps), ps, [i for _, i in members], dtype, device))
        for buf in built:
            self._allocate(buf)
            self._index(buf)
        for _, i in trainable:
            self.step_counts.counts.setdefault(i, 0)
            self.has_grad.setdefault(i, False)

    def _allocate(self, buf: FlatBuffer) -> None:
        self._place_params(buf)
        self._allocate_grads(buf)
        n, kw = buf.layout.shard_numel, dict(dtype=torch.float32, device=buf.device)
        buf.exp_avg, buf.exp_avg_sq = torch.zeros(n, **kw), torch.zeros(n, **kw)
        if buf.dtype != torch.float32:
            buf.master = torch.empty(n, **kw)
            self.refresh_master(buf)
        buf.pending = [0] * len(buf.layout.buckets)

    def allocate_max_exp_avg_sq(self, group: int) -> None:
        """Give param group ``group``'s buffers AMSGrad's running maximum (zeros, as AdamW starts it), once.

        Args:
            group: index of the param group.
        """
        for buf in self.buffers:
            if buf.group == group and buf.max_exp_avg_sq is None:
                buf.max_exp_avg_sq = torch.zeros_like(buf.exp_avg_sq)

    def refresh_master(self, buf: FlatBuffer) -> None:
        """Set the fp32 master shard from the (low-precision) parameters."""
        for b in buf.layout.buckets:
            buf.shard_slice(buf.master, b).copy_(self._param_shard(buf, b))
        master.record(buf)

    def _index(self, buf: FlatBuffer) -> None:
        b = len(self.buffers)
        self.buffers.append(buf)
        for slot_index, slot in enumerate(buf.layout.slots):
            p = buf.params[slot.param]
            self.where[id(p)] = (b, slot_index)
            _owners[id(p)] = self._ref
        self._register_grad_hooks(buf)
        self._launch_order += [(b, k.index) for k in buf.layout.buckets]
        self._reset_pending(buf)

    def param_shape(self, p: torch.Tensor) -> torch.Size:
        """The full shape of ``p`` (stage 3 frees parameters between uses: ``p.shape`` may be ``(0,)``)."""
        where = self.where.get(id(p))
        if where is None:
            return p.shape
        b, slot = where
        return self.buffers[b].layout.slots[slot].shape

    def name_of(self, p: torch.Tensor) -> str:
        """How errors name ``p``: by its name in the model when the pipeline has the model."""
        return adopt.param_name(self.module, p) if self.module is not None else f"a parameter of shape {tuple(p.shape)}"

    def _place_params(self, buf: FlatBuffer) -> None:
        """Copy the parameters into ``param_flat`` and make each ``p.data`` a view of it."""
        buf.param_flat = torch.zeros(buf.layout.numel, dtype=buf.dtype, device=buf.device)
        for slot in buf.layout.slots:
            p = buf.params[slot.param]
            view = buf.param_flat.narrow(0, slot.offset, slot.numel)
            view.copy_(p.detach().reshape(-1))
            p.data = view.view(slot.shape)

    def _allocate_grads(self, buf: FlatBuffer) -> None:
        """Default (stages 0 and 1): a full gradient buffer that ``p.grad`` views."""
        buf.grad_flat = torch.zeros(buf.layout.numel, dtype=buf.dtype, device=buf.device)

    def _register_grad_hooks(self, buf: FlatBuffer) -> None:
        for p in buf.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(_grad_hook(self._ref)))

    def close(self) -> None:
        """Remove the gradient hooks (the parameters keep their current values)."""
        self.wait_params()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for buf in self.buffers:
            for p in buf.params:
                if _owners.get(id(p)) is self._ref:
                    del _owners[id(p)]

    # ---------------------------------------------------------------- backward
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        self._check_dense(p)
        self.window_open = True
        b, slot = self.where[id(p)]
        buf = self.buffers[b]
        self.has_grad[buf.indices[buf.layout.slots[slot].param]] = True
        if not self.sync_enabled:
            return
        if not self._first_report(b, slot, p):
            self._add_grad(buf, slot, p)
            return
        self._consume_grad(buf, slot, p)
        for k in buf.layout.slot_buckets[slot]:
            buf.pending[k] -= 1
        self._launch_ready()

    def _first_report(self, b: int, slot: int, p: torch.Tensor) -> bool:
        """Open the round if needed; False when ``p`` already reported in it.

        A parameter used in several segments of reentrant activation checkpointing
        (``torch.utils.checkpoint(..., use_reentrant=True)``) gets its gradient once per segment,
        each a backward of its own. A repeated gradient is added to the first while the parameter's
        buckets wait; once one of them has been reduced it cannot be, and this raises.
        """
        if not self._round_open:
            self._round_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_round)
        if (b, slot) not in self._reported:
            self._reported.add((b, slot))
            return True
        launched = set(self._launch_order[: self._next_launch])
        if self.reduces_in_backward and any((b, k) in launched for k in self.buffers[b].layout.slot_buckets[slot]):
            raise RuntimeError(grad_state.second_gradient(self.stage, self.name_of(p)))
        return False

    def _add_grad(self, buf: FlatBuffer, slot: int, p: torch.Tensor) -> None:
        """A repeated gradient of ``p`` in this round, its buckets not yet reduced (``_first_report``).

        Default (stages 0 and 1): ``p.grad`` views ``grad_flat`` and autograd added to it in place, or
        replaced it by the sum: ``_consume_grad`` keeps the sum."""
        self._consume_grad(buf, slot, p)

    def _check_dense(self, p: torch.Tensor) -> None:
        if p.grad.layout != torch.strided:
            b, slot = self.where[id(p)]
            index = self.buffers[b].indices[self.buffers[b].layout.slots[slot].param]
            raise RuntimeError(
                "ShardedFusedAdam does not support sparse gradients, please consider SparseAdam instead "
                f"(parameter {index}, shape {tuple(p.shape)}, has a {p.grad.layout} gradient)"
            )

    def _consume_grad(self, buf: FlatBuffer, slot: int, p: torch.Tensor) -> None:
        """Default (stages 0 and 1): make ``p.grad`` a view of ``grad_flat`` holding its value."""
        s = buf.layout.slots[slot]
        view = buf.grad_flat.narrow(0, s.offset, s.numel).view(s.shape)
        if p.grad is not view and (p.grad.data_ptr() != view.data_ptr() or p.grad.shape != view.shape):
            view.copy_(p.grad)
            p.grad = view

    def _launch_ready(self, flush: bool = False) -> None:
        while self._next_launch < len(self._launch_order):
            b, k = self._launch_order[self._next_launch]
            buf = self.buffers[b]
            if buf.pending[k] > 0 and not flush:
                return
            if buf.pending[k] > 0:
                grad_state.zero_dropped_grads(buf, buf.layout.buckets[k])
            self._launch_bucket(buf, buf.layout.buckets[k])
            self._next_launch += 1
            self._complete_inflight(keep=self.max_inflight)

    def _launch_bucket(self, buf: FlatBuffer, bucket: Bucket) -> None:
        """Start reducing ``bucket``'s gradients (``self._track`` the collective); default: at the step."""

    def _end_round(self) -> None:
        self._launch_ready(flush=True)
        self._complete_inflight()  # a next backward accumulates into p.grad: stage 0 reduces it in place
        self._round_open = False
        self._synced = True
        self._next_launch = 0
        self._reported.clear()
        for buf in self.buffers:
            self._reset_pending(buf)

    def _reset_pending(self, buf: FlatBuffer) -> None:
        buf.pending = [sum(1 for _ in k.slots) for k in buf.layout.buckets]

    def _sync_manual_grads(self) -> None:
        """A synchronisation round at the step for gradients no hook consumed (set by hand, or no_sync)."""
        for buf in self.buffers:
            for slot_index, slot in enumerate(buf.layout.slots):
                p = buf.params[slot.param]
                if p.grad is not None:
                    self._check_dense(p)
                    self.has_grad[buf.indices[slot.param]] = True
                    self._consume_grad(buf, slot_index, p)
        self._end_round()

    def _track(self, handle: Optional[Handle], epilogue: Optional[Callable[[], None]] = None, held: tuple = ()) -> None:
        """Remember a collective just issued (None: nothing was issued) until it is completed."""
        if handle is not None:
            self._inflight.append(Inflight(handle, epilogue, held))

    def _complete_inflight(self, keep: int = 0) -> None:
        """Complete the oldest collectives, in issue order, until at most ``keep`` are in flight."""
        while len(self._inflight) > keep:
            op = self._inflight.pop(0)
            op.handle.wait()
            if op.epilogue is not None:
                op.epilogue()

    def _before_step(self) -> None:
        """Finish the reduction of gradients into ``_grad_shard`` (stage 1 reduces here)."""

    # ---------------------------------------------------------------- step
    def _grad_shard(self, buf: FlatBuffer, bucket: Bucket) -> torch.Tensor:
        """This rank's reduced gradients of ``bucket``."""
        if buf.grad_flat is not None:
            return buf.rank_slice(buf.grad_flat, bucket, self.shard_rank)
        return buf.shard_slice(buf.grad_shard, bucket)

    def _param_shard(self, buf: FlatBuffer, bucket: Bucket) -> torch.Tensor:
        """This rank's parameters of ``bucket`` in the storage dtype (the all-gather input)."""
        return buf.rank_slice(buf.param_flat, bucket, self.shard_rank)

    def _master_shard(self, buf: FlatBuffer, bucket: Bucket) -> torch.Tensor:
        if buf.master is not None:
            return buf.shard_slice(buf.master, bucket)
        return self._param_shard(buf, bucket)

    def _publish(self, buf: FlatBuffer, bucket: Bucket) -> Optional[Handle]:
        """Bring every rank's updated shard of ``bucket`` into ``param_flat``."""
        if self.num_shards == 1:
            return None
        full = buf.bucket_slice(buf.param_flat, bucket)
        return self.engine.all_gather(full, self._param_shard(buf, bucket), name=f"params.{bucket.index}")

    def _norm_views(self) -> Iterator[torch.Tensor]:
        """Gradient pieces whose squares, summed over ranks, give the squared global norm."""
        for buf in self.buffers:
            for bucket in buf.layout.buckets:
                yield self._grad_shard(buf, bucket)

    def finish_grad_sync(self) -> None:
        """Make every gradient of this step present, reduced, in ``_grad_shard`` (once per step)."""
        if self._grads_final:
            return
        if not self._synced:
            self._sync_manual_grads()
        self._complete_inflight()
        self._before_step()
        grad_state.zero_unwritten(self)
        grad_state.read_grad_flags(self)
        self._grads_final = True

    @property
    def reduced_since_step(self) -> bool:
        """Whether a synchronised backward (or the step's own synchronisation) ran since the last step."""
        return self._synced

    def reset_grad_sync(self) -> None:
        """The gradients are gone (step or ``zero_grad``): the next ones start a new synchronisation."""
        self._synced = False
        self._grads_final = False
        self.window_open = False

    def reopen(self, synced: bool) -> None:
        """A window put back (``window.restore``): gradients held, reduced by a synchronised backward or not."""
        self._synced = synced
        self._grads_final = False
        self.window_open = True

    def _global_stats(self, checks: Sequence[tuple[str, float]], norm: bool, finite: bool) -> stats.StepStats:
        """Gradient flags, squared norm (``norm``) or finiteness (``finite``) combined over ranks, ``checks``
        compared: one all-gather (``stats``)."""
        device = self.buffers[0].device if self.buffers else torch.device("cpu")
        views = self._norm_views() if norm or finite else None
        extra = self._step_columns()
        combined = stats.exchange(
            self.engine, self._control, self.has_grad, views, checks, device, norm=norm,
            counts=self.step_counts.counts, held=self.held_indices(), name=self._index_name, extra=extra,
        )  # fmt: skip
        self._verify_step_columns(combined.extra)
        return combined

    def _step_columns(self) -> list[float]:
        """Values of this stage's own that ride the step's exchange (``stats``); default: none."""
        return []

    def _verify_step_columns(self, rows: list[list[float]]) -> None:
        """Compare every rank's ``_step_columns()`` (``rows``, in rank order); raise before any update."""

    def held_indices(self) -> set[int]:
        """Optimizer indices of the parameters whose state this rank holds (all of it or a piece)."""
        if self._held[0] != len(self.buffers):
            held = {buf.indices[buf.layout.slots[seg.slot].param] for buf in self.buffers
                    for seg in buf.layout.segments(self.shard_rank)}  # fmt: skip
            self._held = (len(self.buffers), held)
        return self._held[1]

    def _index_name(self, index: int) -> str:
        for buf in self.buffers:
            if index in buf.indices:
                return f"{self.name_of(buf.params[buf.indices.index(index)])} (optimizer index {index})"
        return f"parameter {index}"

    def step(
        self,
        hyper: Sequence[GroupHyper],
        *,
        grad_scale: float,
        clip_coef: Optional[torch.Tensor] = None,
        max_grad_norm: Optional[float] = None,
        check_finite: bool = False,
    ) -> StepResult:
        """Update this rank's shard and publish it; what the gradients decide stays on their device (``outcome``).

        Raises ``agreement.RanksDisagree`` on every rank, before any update, when the ranks pass
        different hyper-parameters, gradient scales or clipping norms. The step counts advance when
        the outcome is settled (``settle``): at once when it is host memory, else when next read.

        Args:
            hyper: per param group hyper-parameters, indexed by group.
            grad_scale: multiplier of the reduced gradients (1 / (loss scale x accumulation steps)).
            clip_coef: a float64 0-d tensor that multiplies ``grad_scale`` (``clip_grad_norm_``), or None.
            max_grad_norm: clip the global gradient norm to this (None: no clipping).
            check_finite: skip the step (and report it) if any gradient is inf/NaN on any rank.
        """
        self.wait_params()
        self.settle()
        self.finish_grad_sync()
        checks = stats.step_checks(hyper, grad_scale, max_grad_norm)
        scale: outcome.Scale = grad_scale if clip_coef is None else clip_coef * grad_scale
        if self.grad_divisor_is_world:
            scale = scale / self.world_size
        combined = self._global_stats(checks, norm=max_grad_norm is not None, finite=check_finite)
        self.step_counts.counts.update(combined.counts)  # as the ranks holding each parameter's state have it
        decision = outcome.decide(combined.grad_sq, scale, max_grad_norm, check_finite)
        result = StepResult(decision.norm, decision.skip)  # its copy to the host queues before the kernels
        master.push_written(self)
        for buf in self.buffers:
            for bucket in buf.layout.buckets:
                update.update_bucket(self, buf, bucket, hyper[buf.group], decision, combined.with_grad)
                self._track(self.gathers.defer(buf, bucket, self._publish(buf, bucket)))
        self._complete_inflight()
        self.gathers.arm()
        master.record_all(self)
        grad_state.clear_after_step(self)
        self.step_counts.pending(result, combined.with_grad)
        return result

    # ---------------------------------------------------------------- zero_grad, gathering, memory
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients like ``torch.optim.Optimizer.zero_grad`` (and the stage's buffers; see ``grad_state``)."""
        for buf in self.buffers:
            flat = None if buf.grad_flat is None else buf.grad_flat.untyped_storage().data_ptr()
            for p in buf.params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None and p.grad.untyped_storage().data_ptr() != flat:
                    p.grad.zero_()  # views of grad_flat are zeroed with it, below
            if buf.grad_flat is not None:
                buf.grad_flat.zero_()
            buf.written.clear()  # grad_shard: overwritten by the next reduction (grad_state.zero_unwritten)
        if set_to_none:
            self.has_grad = dict.fromkeys(self.has_grad, False)
            self.stepped_with = set()
        else:
            grad_state.keep_zero_grads(self)
        self.reset_grad_sync()

    def wait_params(self) -> None:
        """Finish the parameter all-gathers the last step left in flight (``overlap_param_gather``)."""
        self.gathers.wait()

    @contextlib.contextmanager
    def gathered_params(self) -> Iterator[None]:
        """Full parameters inside the block; stages 0-2 hold them once the step's all-gathers are waited for."""
        self.wait_params()
        yield

    @contextlib.contextmanager
    def hooks_removed(self) -> Iterator[None]:
        """The model without hooks that lead back to this pipeline inside the block (to copy or pickle
        it); stages 0-2 hook only the parameters, which copies do not carry, so this does nothing."""
        yield

    def memory_tensors(self) -> dict[str, list[Optional[torch.Tensor]]]:
        """Tensors this rank holds, by kind (``params`` lists only the flat buffers; the optimizer adds the rest)."""
        grads = [t for buf in self.buffers for t in (buf.grad_flat, buf.grad_shard, *buf.scratch.values())]
        grads += [t for op in self._inflight for t in op.held]
        return {
            "params": [buf.param_flat for buf in self.buffers],
            "grads": grads,
            "optimizer": [
                t for buf in self.buffers for t in (buf.master, buf.exp_avg, buf.exp_avg_sq, buf.max_exp_avg_sq)
            ],
            "buffers": [],
        }
