"""The pipeline base class: everything the ZeRO stages share, and the hooks a stage overrides.

A pipeline owns the flat buffers of an optimizer's trainable parameters and drives three phases;
``ShardedFusedAdam`` keeps the books (param groups, hyper-parameters, loss scale) and calls in.

Buffers. ``add_group(group, params, indices)`` builds one ``buffers.FlatBuffer`` per (param group,
dtype) from ``layout.BufferLayout``, its buckets of ``bucket_numel()`` elements (``stages.buckets``).

Backward (``stages.backward``). A post-accumulate-grad hook on each trainable parameter calls ``_on_grad_ready(p)``:
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
shard: master ``master_shard``, gradient ``grad_shard``, fp32 m and v; for low-precision
parameters the kernel writes the updated shard (``out=``) straight into ``param_shard``, the
all-gather input, having first taken what was written there since the last step as the master's
value (``master``: in-place writes into bf16/fp16 parameters reach the fp32 master). ``_publish``
then all-gathers each bucket back into ``param_flat`` (overlapping the next bucket's kernel; with
``overlap_param_gather`` the step leaves them in flight until a parameter is used, ``param_gather``). A
kernel launch is split where per-parameter step counts differ; the counts advance once the step's
outcome is read (``outcome.StepCounts``).

Rules. A parameter without a gradient on any rank this step (``p.grad is None`` in
``torch.optim.AdamW`` terms) is not updated: no change to it, its m and v, or its step count.
Gradients are averaged over ranks as their bucket is reduced (``_launch_bucket``). Public override points
(the shard accessors the update, ``master`` and ``stats`` use): ``grad_shard``, ``param_shard``, ``master_shard``,
``norm_views`` (and ``grad_column``, ``zero_reduced``, ``reduced_shard``, ``assign_reduced``, for a stage that
keeps the reduced gradients elsewhere: stage 3's files), and ``epilogue_quantizer`` (where the update leaves
qwZ's int8 copies). Overrides within the stages: ``num_shards``, ``_place_params``, ``_allocate_grads``,
``_consume_grad``, ``_launch_bucket``, ``_before_step``, ``_publish``, ``_register_grad_hooks``,
``gathered_params``, ``zero_grad``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from typing import Any, Callable, ClassVar, Iterator, Optional, Sequence, Union

import torch

from ..comm.control import ControlLink
from ..comm.handles import Handle
from . import (
    adopt,
    buckets,
    grad_accum,
    grad_state,
    master,
    modifier,
    offloaded,
    outcome,
    param_gather,
    placement,
    quantized_gather,
    refusals,
    stats,
    update,
)
from .backward import BackwardRound
from .buffers import FlatBuffer, GroupHyper, Inflight
from .grad_ready import GradReady, owners
from .layout import Bucket, BufferLayout, align_elements
from .outcome import StepResult
from .speculation import Speculation
from .uploads import Uploads

log = logging.getLogger("zero_kernels")


class Pipeline(BackwardRound):
    """Base of the stage pipelines; see the module docstring for the phases and the overrides.

    Args:
        engine: communication engine from ``comm.make_engine`` (rank, world size, collectives).
        options: the ``zero_optimization`` options (``config.ZeroOptions``).
        impl: kernel backend for ``kernels.adam_step``/``flatten`` (None: ``ZERO_KERNELS_IMPL``).
        module: the model, when the optimizer was given one (stage 3 needs it).
        comm_dtype: the dtype gradients are reduced in (None: their own); see ``comm_dtype_of``.
        accum_dtype: the dtype gradients are accumulated in over micro-steps (DeepSpeed's
            ``data_types.grad_accum_dtype``; None: their own); see ``accumulate_dtype_of`` and ``reduces_micro_steps``.
    """

    stage: ClassVar[int]
    requires_module: ClassVar[bool] = False  # True: needs the model, not just its parameters
    max_inflight: ClassVar[int] = 2  # gradient reductions in flight during backward; older ones are completed
    allgather_by_bucket: ClassVar[bool] = False  # True: the step all-gathers parameters bucket by bucket
    reduces_in_backward: ClassVar[bool] = False  # True: a launched bucket is reduced then (stages 0, 2, 3)
    quantizes_gradients: ClassVar[bool] = False  # True: zero_quantized_gradients applies (stages 2, 3: qgZ)
    # True: every accumulation micro-step (``gradient_accumulation_steps``) reduces its gradients at once, added up
    # in the gradient shard (of a wider accum_dtype where one is set), not in ``p.grad`` until the last, as
    # DeepSpeed's ZeRO-2 and ZeRO-3 do (stages 2, 3); ``no_sync()`` still accumulates locally
    reduces_micro_steps: ClassVar[bool] = False
    accumulates_locally: ClassVar[bool] = False  # True: grad_flat keeps the whole local gradient (stages 0, 1)

    def __init__(
        self,
        engine: Any,
        options: Any,
        *,
        impl: Optional[str] = None,
        module: Any = None,
        comm_dtype: Optional[torch.dtype] = None,
        accum_dtype: Optional[torch.dtype] = None,
    ):
        self.engine = engine
        self.options = options
        self.comm_dtype = comm_dtype
        self.accum_dtype = accum_dtype
        self._accum_warned: set[str] = set()  # ``grad_accum.warn_unused``'s messages given
        self.wide_local = False  # grad_flat is wider than some buffer's gradients: it holds them, not p.grad
        self.summed: set[int] = set()  # wide_local: parameters whose slot of grad_flat holds this window's gradients
        self.impl = impl
        self.module = module
        self.index_name: Callable[[int], str] = lambda index: f"parameter {index}"  # set by the optimizer
        self.device: Optional[torch.device] = None  # the parameters' device, where exchanges run (set by the optimizer)
        self.buffers: list[FlatBuffer] = []
        self.exact_blocks = 0  # gathered_params() blocks open (qwZ: every rank holds every rank's exact parameters)
        self.where: dict[int, tuple[int, int]] = {}  # id(param) -> (buffer index, slot index)
        self.step_counts = outcome.StepCounts()  # optimizer param index -> Adam step count (``steps``)
        self._control_link = ControlLink(engine)  # host-side exchanges (``stats``) never wait for a device
        self.has_grad: dict[int, bool] = {}  # optimizer param index -> got a gradient this step
        self._sync_enabled = True
        # the next backward is expected to end the accumulation window (set by the optimizer): a reduction before
        # the window's last one need not take the step's statistics of its gradients (``stage3.disk_grads``)
        self.window_ends = True
        self._ref = weakref.ref(self)
        self._hooks: list[Any] = []
        self._owned: list[int] = []  # id() of the parameters ``owners`` maps to this pipeline
        weakref.finalize(self, _let_go, self._hooks, self._owned, self._ref).atexit = False
        self._launch_order: list[tuple[int, int]] = []  # (buffer, bucket) in collective order
        self._next_launch = 0
        self._reported: set[tuple[int, int]] = set()  # (buffer, slot) that reported in this round
        self._inflight: list[Inflight] = []  # in issue order
        self._hook_stream: Optional[Any] = None  # CUDA: the stream the last round's or pass's hooks ran on (backward)
        self._round_open = False
        self._pass_open = False  # a backward that reduces nothing is running, or raised (``_open_pass``)
        self._synced = False  # a synchronised backward happened since the last step
        self._owed = False  # gradients may be left unreduced after it: the step reduces once more (``sync_enabled``)
        self._grads_final = False  # finish_grad_sync() ran since the last step, and no gradient arrived since
        self.clipped = False  # clip_grad_norm_ measured this step's gradients (set by the optimizer)
        self.loss_scaled = False  # fp16 loss scaling: gradients must come from the optimizer's backward (refusals)
        self.scaled_backward = False  # inside the optimizer's backward (set by the optimizer)
        self.refusals = refusals.Refusals()  # problems found in backward, raised at the step on every rank
        self.window_open = False  # a backward delivered gradients since the last step or zero_grad (``window``)
        self.grad_arrivals = 0  # gradients delivered so far (a window's part zero_grad calls span none of them)
        self.since_step_call: set[int] = set()  # parameters that got a gradient since the last step() call
        self.repeated_since_step_call = False  # one of them got a second (several backward passes per call)
        self.zeroed_part: Any = None  # the modules zeroed in this window so far, not all (``module_zero_grad``)
        self.stepped_with: set[int] = set()  # parameters that had a gradient in the last step (grad_state)
        self.spent = False  # the last step dropped gradients p.grad does not hold, and no zero_grad() came since
        self.spent_warned = False  # ``grad_state.warn_spent`` spoke
        self._held: tuple[int, set[int]] = (-1, set())  # (buffers counted, held_indices())
        self.unfinished_load: Optional[str] = None  # why the last checkpoint load stopped part way (``state_door``)
        if getattr(options, "quantized_gradients", False) and not self.quantizes_gradients:
            log.warning("zero_quantized_gradients applies at stages 2 and 3; stage %d reduces unquantized", self.stage)
        overlap = self.allgather_by_bucket and getattr(options, "overlap_param_gather", False)
        self.gathers = param_gather.ParamGathers(overlap)  # the step's all-gathers, kept in flight when overlapping
        self.tier = offloaded.make_tier(options, engine)  # where the optimizer state lives when offloaded (else None)
        self.speculation: Optional[Speculation] = None  # super_offload: updates run during backward (stage 3)
        self.uploads = Uploads()  # copies up from host shards in flight: host writers wait for them (``uploads``)
        self.param_traffic = quantized_gather.Traffic()  # what parameter all-gathers sent (ZeRO++), logged once
        self.weight_quantizer = quantized_gather.WeightQuantizer()  # int8 copies of the shards (qwZ), per version

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

    @property
    def grads_in_p_grad(self) -> bool:
        """Whether the step reads ``p.grad`` (stages 0 and 1, as views of ``grad_flat``). False where the pipeline
        alone holds the gradients: stages 2-3 (a reduced shard), and stages 0-1 with a ``grad_accum_dtype`` wider
        than some buffer's gradients (``wide_local``: ``grad_flat`` of that dtype, ``p.grad`` None after backward).
        The stages whose step can read ``p.grad`` keep the whole local gradient (``accumulates_locally``)."""
        return self.accumulates_locally and not self.wide_local

    def comm_dtype_of(self, buf: FlatBuffer) -> torch.dtype:
        """The dtype ``buf``'s gradients are reduced in: ``communication_data_type``, else their own."""
        return self.comm_dtype or buf.dtype

    def accumulate_dtype_of(self, buf: FlatBuffer) -> torch.dtype:
        """The dtype reduced gradients of ``buf`` are kept and added up in: the widest of theirs, the
        communication dtype and ``accum_dtype`` (fp32 for bf16 gradients reduced or accumulated in fp32). Never
        narrower than the gradients."""
        wide = torch.promote_types(buf.dtype, self.comm_dtype_of(buf))
        if (self.reduces_micro_steps or self.accumulates_locally) and self.accum_dtype is not None:
            wide = torch.promote_types(wide, self.accum_dtype)
        return wide

    @property
    def holding(self) -> bool:
        """Inside stage 3's ``gathered_params()``; never at stages 0-2, whose parameters are always whole."""
        return False

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
        mark = self._mark([p for p, _ in trainable])
        try:
            for buf in built:
                grad_accum.warn_unused(self, buf, self._accum_warned)
                self._allocate(buf)
                self._index(buf)
                self.wide_local = self.wide_local or (buf.grad_flat is not None and buf.grad_flat.dtype != buf.dtype)
        except BaseException:
            self._unbuild(built, mark)
            raise
        for _, i in trainable:
            self.step_counts.counts.setdefault(i, 0)
            self.has_grad.setdefault(i, False)

    def _allocate(self, buf: FlatBuffer) -> None:
        self._place_params(buf)
        self._allocate_grads(buf)
        count = len(buf.layout.buckets)
        buf.tier_from = count if self.tier is None else placement.device_buckets(self, buf)
        if placement.on_device(buf):
            self.allocate_state(buf)
        else:
            offloaded.attach(self, buf)  # the disk tier writes the state into its files without allocating it
        buf.pending = [0] * len(buf.layout.buckets)

    def allocate_state(self, buf: FlatBuffer) -> None:
        """The whole state shard of a new buffer: the moments' zeros, and the master from the parameters where they
        are bf16/fp16 (on the device, or in the host tier's memory: ``_state_zeros``)."""
        n = buf.layout.shard_numel
        buf.exp_avg, buf.exp_avg_sq = self._state_zeros(buf, n), self._state_zeros(buf, n)
        if buf.dtype != torch.float32:
            buf.master = self._state_zeros(buf, n)
            self.refresh_master(buf)

    def _state_zeros(self, buf: FlatBuffer, numel: int) -> torch.Tensor:
        """An fp32 state shard of zeros: on the buffer's device, or in the tier's host memory when (part of) it is
        offloaded (``placement`` puts the device part on the device)."""
        if not placement.on_device(buf):
            return self.tier.zeros(numel)
        return torch.zeros(numel, dtype=torch.float32, device=buf.device)

    def allocate_max_exp_avg_sq(self, group: int) -> None:
        """Give param group ``group``'s buffers AMSGrad's running maximum (zeros, as AdamW starts it), once.

        Args:
            group: index of the param group.
        """
        on_disk: list[FlatBuffer] = []
        for buf in self.buffers:
            if buf.group != group or buf.max_exp_avg_sq is not None:
                continue
            if self.tier is not None and self.tier.kind == "disk" and placement.splits(self.tier, buf):
                on_disk.append(buf)  # its state lives in files between steps: the same on every rank
                continue
            split = not placement.resident(buf)
            buf.ready()
            buf.max_exp_avg_sq = self._state_zeros(buf, buf.layout.shard_numel)
            if split:  # back where its state lives between steps (``placement``)
                placement.split(self.tier, buf)
        if on_disk:
            self._reserve_max_on_disk(on_disk)

    def _reserve_max_on_disk(self, bufs: list[FlatBuffer]) -> None:
        """AMSGrad's maximum of ``bufs`` (buffers whose state lives in files between steps) in new files, never whole
        in host memory unless the buffer's state is read in whole there now (a state read on this rank alone); a disk
        without room on some rank raises ``OSError`` on every rank (every rank reserves at the same point: the
        constructor, or the step's start once the ranks agree on ``amsgrad``, whatever each read), with none of the
        files made by this call left."""
        made: list[FlatBuffer] = []
        problem: Optional[str] = None
        for buf in bufs:
            try:
                placement.add_zeros(self.tier, buf, "max_exp_avg_sq")
            except OSError as err:
                problem = str(err)
                break
            made.append(buf)
        try:
            what = "could not make AMSGrad's maximum (max_exp_avg_sq) in its files; nothing was updated"
            offloaded.agree(self.engine, problem, "offload.amsgrad", what=what)
        except OSError:
            for buf in made:
                placement.drop_zeros(self.tier, buf, "max_exp_avg_sq")
            raise

    def refresh_master(self, buf: FlatBuffer) -> None:
        """Set the fp32 master shard from the (low-precision) parameters."""
        buf.ready()
        for b in buf.layout.buckets:
            buf.shard_slice(buf.master, b).copy_(self.param_shard(buf, b))
        master.record(buf)

    def _index(self, buf: FlatBuffer) -> None:
        b = len(self.buffers)
        self.buffers.append(buf)
        for slot_index, slot in enumerate(buf.layout.slots):
            p = buf.params[slot.param]
            self.where[id(p)] = (b, slot_index)
            owners[id(p)] = self._ref
            self._owned.append(id(p))
        self._register_grad_hooks(buf)
        self._launch_order += [(b, k.index) for k in buf.layout.buckets]
        self._reset_pending(buf)

    def _mark(self, params: Sequence[torch.nn.Parameter]) -> dict[str, Any]:
        """What ``add_group`` is about to change, for ``_unbuild`` (``params``: the group's trainable parameters,
        whose ``.data`` the buffers replace: the tensors they hold now are kept, unchanged)."""
        return {
            "buffers": len(self.buffers), "hooks": len(self._hooks), "launch": len(self._launch_order),
            "wide_local": self.wide_local, "data": [(p, p.data) for p in params],
            "owners": {id(p): owners.get(id(p)) for p in params},
        }  # fmt: skip

    def _unbuild(self, bufs: Sequence[FlatBuffer], mark: dict[str, Any]) -> None:
        """Undo an ``add_group`` that failed part way (a disk without room for a buffer's state, on every rank): the
        buffers of ``bufs`` it indexed are taken out again, what each holds in the tier is discarded (its files
        removed; the other buffers' state stays in theirs), and their parameters get back the tensors they had, so
        the model and the optimizer are as before the call (stage 3 had already taken the parameters apart)."""
        gone = self.buffers[mark["buffers"] :]
        for buf in gone:
            for p in buf.params:
                self.where.pop(id(p), None)
        ids = {id(p) for buf in gone for p in buf.params}
        self._owned[:] = [i for i in self._owned if i not in ids]
        for i, before in mark["owners"].items():
            if before is None:
                owners.pop(i, None)
            else:
                owners[i] = before
        del self.buffers[mark["buffers"] :]
        for hook in self._hooks[mark["hooks"] :]:
            hook.remove()
        del self._hooks[mark["hooks"] :]
        del self._launch_order[mark["launch"] :]
        self.wide_local = mark["wide_local"]
        for buf in bufs:
            self._discard(buf)
        for p, value in mark["data"]:
            p.data = value

    def _discard(self, buf: FlatBuffer) -> None:
        """Forget a buffer ``_unbuild`` takes out: its part of the tier (files) goes."""
        if self.tier is not None:
            self.tier.discard(id(buf))

    def param_shape(self, p: torch.Tensor) -> torch.Size:
        """The full shape of ``p`` (stage 3 frees parameters between uses: ``p.shape`` may be ``(0,)``)."""
        where = self.where.get(id(p))
        if where is None:
            return p.shape
        b, slot = where
        return self.buffers[b].layout.slots[slot].shape

    def frozen_partitioned(self) -> set[int]:
        """id of every frozen parameter this pipeline holds as shards (stage 3); the others stay whole in the
        model."""
        return set()

    def gathered_frozen(self) -> Iterator[list[torch.nn.Parameter]]:
        """The frozen parameters of ``frozen_partitioned``, group by group, whole while the iteration is on a group
        (a collective)."""
        return iter(())

    def assign_frozen(self, values: dict[int, torch.Tensor]) -> None:
        """Give frozen parameters of ``frozen_partitioned`` full values (id(parameter) -> value)."""

    def frozen_chunks(self) -> list[tuple[list[torch.nn.Parameter], list[torch.Size], torch.Tensor]]:
        """For a copy: per unit of ``frozen_partitioned``, its parameters, their shapes and this rank's chunk."""
        return []

    def load_frozen_chunks(self, chunks: Sequence[tuple[Sequence[torch.nn.Parameter], Any, torch.Tensor]]) -> None:
        """Into a copy rebuilt from ``frozen_chunks``'s parameters: this rank's chunks."""

    def name_of(self, p: torch.Tensor) -> str:
        """How errors name ``p``: by its name in the model when the pipeline has the model, else as the optimizer
        names its index (``index_name``)."""
        if self.module is not None:
            return adopt.param_name(self.module, p)
        if id(p) in self.where:
            b, s = self.where[id(p)]
            buf = self.buffers[b]
            return self.index_name(buf.indices[buf.layout.slots[s].param])
        return f"a parameter of shape {tuple(p.shape)}"

    def _place_params(self, buf: FlatBuffer) -> None:
        """Copy the parameters into ``param_flat`` and make each ``p.data`` a view of it."""
        buf.param_flat = torch.zeros(buf.layout.numel, dtype=buf.dtype, device=buf.device)
        for slot in buf.layout.slots:
            p = buf.params[slot.param]
            view = buf.param_flat.narrow(0, slot.offset, slot.numel)
            view.copy_(p.detach().reshape(-1))
            p.data = view.view(slot.shape)

    def _allocate_grads(self, buf: FlatBuffer) -> None:
        """Default (stages 0 and 1): a full gradient buffer that ``p.grad`` views, or of a wider ``grad_accum_dtype``
        (``grad_accum.local_dtype``) that holds them itself."""
        dtype = grad_accum.local_dtype(self, buf)
        buf.grad_flat = torch.zeros(buf.layout.numel, dtype=dtype, device=buf.device)

    def _register_grad_hooks(self, buf: FlatBuffer) -> None:
        for p in buf.params:
            self._hooks.append(GradReady(p, self._ref))

    def close(self) -> None:
        """Remove the gradient hooks (the parameters keep their current values); a disk tier removes its files."""
        self.wait_params()
        if self.speculation is not None:
            self.speculation.close()
        if self.tier is not None:
            self.tier.close()
        _let_go(self._hooks, self._owned, self._ref)

    # ---------------------------------------------------------------- step
    # The shard accessors (grad_shard, param_shard, master_shard, norm_views) are the public override
    # points through which the update, the masters and the statistics reach this rank's shards: a stage
    # (or a state tier) that keeps a shard elsewhere overrides them.
    def grad_shard(self, buf: FlatBuffer, bucket: Bucket) -> torch.Tensor:
        """This rank's reduced gradients of ``bucket``."""
        if buf.grad_flat is not None:
            return buf.rank_slice(buf.grad_flat, bucket, self.shard_rank)
        return buf.shard_slice(buf.grad_shard, bucket)

    def param_shard(self, buf: FlatBuffer, bucket: Bucket) -> torch.Tensor:
        """This rank's parameters of ``bucket`` in the storage dtype (the all-gather input)."""
        return buf.rank_slice(buf.param_flat, bucket, self.shard_rank)

    def device_params(self, buf: FlatBuffer, bucket: Bucket) -> contextlib.AbstractContextManager[torch.Tensor]:
        """This rank's parameters of ``bucket`` where the device's update reads and writes them, inside the block:
        ``param_shard`` itself, unless a stage keeps the shard off the device (stage 3's ``offload_param``)."""
        return contextlib.nullcontext(self.param_shard(buf, bucket))

    def grads_in_file(self, buf: FlatBuffer) -> bool:
        """Whether this rank's gradient shard of ``buf`` lives in a file (stage 3 with the state on disk)."""
        return False

    def params_in_file(self, buf: FlatBuffer) -> bool:
        """Whether this rank's parameter shard of ``buf`` lives in a file (stage 3's ``offload_param`` on nvme)."""
        return False

    def params_from_master_in_file(self, buf: FlatBuffer, bucket: Bucket) -> bool:
        """Whether that shard's part of ``bucket`` is in its file alone, as a step wrote it from the master (nothing
        read in whole since, which may have brought an edit or weights newer than a master loaded)."""
        return False

    def params_read_briefly(self, buf: FlatBuffer) -> contextlib.AbstractContextManager[None]:
        """Around a block that reads this rank's parameter shard of ``buf`` and writes none of it (a checkpoint's
        save): a shard a file holds is let go after it (stage 3)."""
        return contextlib.nullcontext()

    def params_loading(self, buf: FlatBuffer) -> contextlib.AbstractContextManager[None]:
        """Around a block that writes every parameter element of that shard (a checkpoint's load): a shard a file
        holds is written into it and let go after it, and not read before it (stage 3)."""
        return contextlib.nullcontext()

    def finish_offloaded_step(self) -> None:
        """After the update's last bucket: the tier's (``offloaded.finish_step``)."""
        if self.tier is not None:
            offloaded.finish_step(self)

    def disk_bytes(self) -> int:
        """Bytes of this rank's files under ``nvme_path`` (the state tier's)."""
        return 0 if self.tier is None else self.tier.disk_bytes()

    def live_param_shard(self, buf: FlatBuffer, bucket: Bucket) -> torch.Tensor:
        """This rank's parameters of ``bucket`` as the model sees them now (what the master follows)."""
        return self.param_shard(buf, bucket)

    def master_shard(self, buf: FlatBuffer, bucket: Bucket) -> torch.Tensor:
        """This rank's fp32 master of ``bucket`` (the parameters themselves when they are fp32)."""
        if buf.master is not None:
            return buf.shard_slice(buf.master, bucket)
        return self.param_shard(buf, bucket)

    def _publish(self, buf: FlatBuffer, bucket: Bucket) -> Optional[Handle]:
        """Bring every rank's updated shard of ``bucket`` into ``param_flat``."""
        if self.num_shards == 1:
            return None
        full = buf.bucket_slice(buf.param_flat, bucket)
        shard, name = self.param_shard(buf, bucket), f"params.{bucket.index}"
        if getattr(self.options, "quantized_weights", False):  # qwZ: this rank's chunk of full is its exact shard
            buf.dequantized = True
            layout = quantized_gather.Payload(shard.numel())
            payload = self.weight_quantizer.take(self.weight_quantizer.key(buf, bucket), shard, layout)
            return quantized_gather.publish(self.engine, full, shard, payload, name, self.param_traffic)
        return self.engine.all_gather(full, shard, name=name)

    def requantize_whole(self) -> None:
        """qwZ, after a load or a ``gathered_params()`` block wrote exact values into every rank's whole copy of the
        parameters (stage 3: of its persistent units): the other ranks' parts as the step's quantized all-gather leaves
        them (dequantized), so that a resumed run, or one that held a block, even an empty one or a save, goes on from
        the values the uninterrupted run held (this rank's part stays exact, as after a step, edits included). Only
        where a step sent them so (``buf.dequantized``): before the first step every rank's copy is exact."""
        for buf in self.buffers:
            if buf.param_flat is not None and buf.dequantized and self.epilogue_quantizer(buf) is not None:
                for handle in [self._publish(buf, bucket) for bucket in buf.layout.buckets]:
                    if handle is not None:
                        handle.wait()

    def requantize_loaded(self, dequantized: Union[bool, list[int]]) -> None:
        """qwZ, after a load wrote exact values into the whole copies: the other ranks' parts as the saved run held
        them, dequantized where a step's int8 all-gather had written them (``requantize_whole``), else exact; inside
        ``gathered_params()`` they stay exact until the block's end does so.
        ``dequantized``: the param groups it had written, or True / False for all of them; a buffer whose step sends
        no int8 all-gather (qwZ off here, or one shard) stays exact whatever the saved run held."""
        for buf in self.buffers:
            saved = dequantized if isinstance(dequantized, bool) else buf.group in dequantized
            buf.dequantized = saved and self.epilogue_quantizer(buf) is not None
        if self.exact_blocks == 0 and not self.holding:
            self.requantize_whole()

    def epilogue_quantizer(self, buf: FlatBuffer) -> Optional[quantized_gather.WeightQuantizer]:
        """Where the step's Adam kernel leaves the int8 copy of ``buf``'s updated shards (``update``'s epilogue),
        or None when no quantized gather sends them (qwZ off, or one shard)."""
        if self.num_shards > 1 and getattr(self.options, "quantized_weights", False):
            return self.weight_quantizer
        return None

    def norm_views(self) -> Iterator[torch.Tensor]:
        """Gradient pieces whose squares, summed over ranks, give the squared global norm."""
        for buf in self.buffers:
            for bucket in buf.layout.buckets:
                yield self.grad_shard(buf, bucket)

    @property
    def column_device(self) -> torch.device:
        """Where this rank's gradient statistics are taken: its buffers' device (the CPU without any)."""
        return self.buffers[0].device if self.buffers else torch.device("cpu")

    def grad_column(self, norm: bool) -> torch.Tensor:
        """This rank's part of the gradient column (``stats.grad_column`` of ``norm_views()``): the squared norm
        (``norm``), else whether every gradient is finite."""
        return stats.grad_column(self.norm_views(), self.column_device, norm=norm)

    def zero_reduced(self, buf: FlatBuffer, bucket: Bucket) -> None:
        """Zero this rank's reduced gradients of ``bucket`` (no reduction wrote them: ``grad_state.zero_unwritten``)."""
        buf.shard_slice(buf.grad_shard, bucket).zero_()

    def reduced_shard(self, buf: FlatBuffer) -> torch.Tensor:
        """This rank's whole reduced gradient shard of ``buf`` (stages 2-3; a window saved: ``window.capture``)."""
        return buf.grad_shard

    def assign_reduced(self, buf: FlatBuffer, shard: torch.Tensor) -> None:
        """Give this rank's reduced gradient shard of ``buf`` the values ``shard`` holds (``window.restore``)."""
        buf.grad_shard.copy_(shard)

    def finish_grad_sync(self) -> None:
        """Make every gradient of this step present, reduced, in ``grad_shard`` (again after a gradient arrived).

        A round of reduction at the step when no synchronised backward ran, or gradients were left in
        ``p.grad`` after it (``sync_enabled``); else stages 0-1 read what ``p.grad`` holds (a new tensor put
        there after backward, as ``torch.optim.AdamW`` with DDP would), and stages 2-3 refuse a ``p.grad``
        that no reduction took (``refusals``).
        """
        self._close_failed_round(keep=True)
        if self._grads_final:
            return
        if not self._synced or self._owed:
            self._sync_manual_grads()
        else:
            self._take_replaced_grads()
        self._complete_inflight()
        self._before_step()
        grad_state.zero_unwritten(self)
        grad_state.read_grad_flags(self)
        self._grads_final = True

    def _take_replaced_grads(self) -> None:
        """Stages 0-1: ``p.grad`` replaced by a new tensor after backward is what the step reads (with ``wide_local``
        it is added to the gradients held: autograd's ``p.grad`` was emptied into them); stages 2-3: a ``p.grad``
        no reduction took is refused."""
        for buf in self.buffers:
            for slot_index, slot in enumerate(buf.layout.slots):
                p = buf.params[slot.param]
                if p.grad is None:
                    continue
                self._check_dense(p)
                if buf.grad_flat is not None:
                    self.has_grad[buf.index_of(slot)] = True
                    self._consume_grad(buf, slot_index, p)
                else:
                    self._refuse(refusals.UNSEEN_GRADIENT, buf.index_of(slot), p)

    @property
    def grads_final(self) -> bool:
        """Whether this step's gradients were made final (``finish_grad_sync``) since the last gradient arrived."""
        return self._grads_final

    def reduce_again(self) -> None:
        """The next ``finish_grad_sync`` reduces what ``p.grad`` holds again (stage 1: a GradScaler's ``unscale_`` may
        have divided it after an early reduction read it)."""
        self._grads_final = False

    @property
    def reduced_since_step(self) -> bool:
        """Whether a synchronised backward (or the step's own synchronisation) ran since the last step."""
        return self._synced

    @property
    def failed_round_open(self) -> bool:
        """Whether a backward that raised left its round open (outside a backward: ``_close_failed_round``), or left
        open the pass of one that reduces nothing (``_open_pass``)."""
        return self._round_open or self._pass_open

    def keep_failed_round(self) -> None:
        """A micro-step's ``step()``: what a backward that raised left is the window's, as at the step that updates
        (``_close_failed_round``), so that the window's next ``zero_grad()`` keeps it."""
        self._close_failed_round(keep=True)

    def reset_grad_sync(self) -> None:
        """The gradients are gone (step or ``zero_grad``): the next ones start a new synchronisation."""
        self._synced = False
        self._owed = False
        self._grads_final = False
        self.clipped = False
        self.refusals.clear()
        self.window_open = False
        self.zeroed_part = None
        self.summed.clear()
        self.since_step_call.clear()  # a backward whose gradients are dropped counts for no step() call
        self.repeated_since_step_call = False

    @property
    def owed(self) -> bool:
        """Whether gradients left in ``p.grad`` after this step's synchronised backward await a round at the step."""
        return self._owed

    def writing_params(self, buf: Optional[FlatBuffer] = None) -> None:
        """Parameter values are about to be written on every rank (a load, ``safe_set_full_fp32_param``), perhaps into
        some ranks' shards only: copies that hold other ranks' values go (stage 3's hpZ partitions); stages 0-2 keep
        none. ``buf``: into that buffer's parameters alone (a value given to a freed stage-3 parameter), whose copies
        alone go."""

    def reopen(self, synced: bool, owed: bool = False) -> None:
        """A window put back (``window.restore``): gradients held, reduced by a synchronised backward or not, and
        whether more were left in ``p.grad`` after it (``owed``)."""
        self._synced = synced
        self._owed = owed and synced
        self._grads_final = False
        self.window_open = True

    def _global_stats(self, checks: Sequence[tuple[str, float]], norm: bool, finite: bool) -> stats.StepStats:
        """Gradient flags, squared norm (``norm``) or finiteness (``finite``) combined over ranks, ``checks``
        compared: one all-gather (``stats``)."""
        column = self.grad_column(norm) if norm or finite else None
        extra = self.refusals.columns() + self._step_columns()
        combined = stats.exchange(
            self.engine, self._control, self.has_grad, column, checks,
            counts=self.step_counts.counts, held=self.held_indices(), name=self._index_name, extra=extra,
        )  # fmt: skip
        self._verify_step_columns([row[2:] for row in combined.extra])
        self.refusals.verify(
            [row[:2] for row in combined.extra], self.stage, self._index_name, self._control.global_ranks
        )
        return combined

    def _step_columns(self) -> list[float]:
        """Values of this stage's own that ride the step's exchange (``stats``); default: none."""
        return []

    def _verify_step_columns(self, rows: list[list[float]]) -> None:
        """Compare every rank's ``_step_columns()`` (``rows``, in rank order); raise before any update."""

    def held_indices(self) -> set[int]:
        """Optimizer indices of the parameters whose state this rank holds (all of it or a piece)."""
        if self._held[0] != len(self.buffers):
            held = {buf.index_of(seg.slot) for buf in self.buffers
                    for seg in buf.layout.segments(self.shard_rank)}  # fmt: skip
            self._held = (len(self.buffers), held)
        return self._held[1]

    def _index_name(self, index: int) -> str:
        p = self.param_at(index)
        return f"parameter {index}" if p is None else f"{self.name_of(p)} (optimizer index {index})"

    def param_at(self, index: int) -> Optional[torch.Tensor]:
        """The parameter the optimizer numbers ``index`` (None: one the buffers do not hold, a frozen one)."""
        for buf in self.buffers:
            if index in buf.indices:
                return buf.params[buf.indices.index(index)]
        return None

    def step(
        self,
        hyper: Sequence[GroupHyper],
        *,
        grad_scale: float,
        clip_coef: Optional[torch.Tensor] = None,
        max_grad_norm: Optional[float] = None,
        clip_max_norm: Optional[float] = None,
        check_finite: bool = False,
    ) -> StepResult:
        """Update this rank's shard and publish it; what the gradients decide stays on their device (``outcome``).

        Raises ``agreement.RanksDisagree`` on every rank, before any update, when the ranks pass
        different hyper-parameters, gradient scales or clipping norms (``max_grad_norm``, ``clip_max_norm``). Then
        ``ValueError`` on every rank, before any update, when a group's lr, betas, eps or weight_decay is not finite.
        The step counts advance when the outcome is settled (``settle``): at once when it is host memory, else when
        next read.

        Args:
            hyper: per param group hyper-parameters, indexed by group.
            grad_scale: multiplier of the reduced gradients (1 / loss scale with fp16 loss scaling, else
                1 / accumulation steps).
            clip_coef: a float64 0-d tensor that multiplies ``grad_scale`` (``clip_grad_norm_``), or None.
            max_grad_norm: clip the global gradient norm to this (None: no clipping).
            clip_max_norm: the smallest ``max_norm`` of the clips behind ``clip_coef``, compared across ranks (None:
                none).
            check_finite: skip the step (and report it) if any gradient is inf/NaN on any rank.
        """
        self.wait_params()
        self.settle()
        self.uploads.wait()
        grad_state.warn_spent(self)
        self.finish_grad_sync()
        if self.speculation is not None and (written := self.speculation.written(self)) is not None:
            self.refusals.record(refusals.STATE_WRITTEN, written)  # raised on every rank by the exchange
        checks = stats.step_checks(hyper, grad_scale, max_grad_norm, clip_max_norm)
        scale: outcome.Scale = grad_scale if clip_coef is None else clip_coef * grad_scale
        combined = self._global_stats(checks, norm=max_grad_norm is not None, finite=check_finite)
        stats.check_step_hyper(hyper)
        for g, h in enumerate(hyper):  # a group given amsgrad since the last step: its maximum before any update
            if h.amsgrad:
                self.allocate_max_exp_avg_sq(g)
        self.step_counts.counts.update(combined.counts)  # as the ranks holding each parameter's state have it
        decision = outcome.decide(combined.grad_sq, scale, max_grad_norm, check_finite)
        result = StepResult(decision.norm, decision.skip)  # its copy to the host queues before the kernels
        if self.speculation is not None:  # the updates run during backward that the step keeps; the others undone
            self.speculation.settle(self, decision, list(hyper), combined.with_grad)
        master.push_written(self)
        self.weight_quantizer.changed()
        update_bucket = update.update_bucket if self.tier is None else offloaded.update_bucket
        for buf in self.buffers:
            for bucket in buf.layout.buckets:
                update_bucket(self, buf, bucket, hyper[buf.group], decision, combined.with_grad)
                self._track(self.gathers.defer(buf, bucket, self._publish(buf, bucket)))
        self.weight_quantizer.seal()
        self.finish_offloaded_step()
        self._complete_inflight()
        self.gathers.arm()
        self.param_traffic.log_once()
        master.record_all(self)
        grad_state.clear_after_step(self)
        self.step_counts.pending(result, combined.with_grad)
        return result

    # ---------------------------------------------------------------- zero_grad, gathering, memory
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients like ``torch.optim.Optimizer.zero_grad`` (and the stage's buffers; see ``grad_state``), and
        those a backward that raised left (``_close_failed_round``)."""
        self._close_failed_round(keep=False)
        if self.speculation is not None:
            self.speculation.roll_back()  # the gradients they were run on are gone
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
        self.spent = False
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
    def gathered_params(self, modifier_rank: Optional[int] = None) -> Iterator[None]:
        """Full parameters inside the block; stages 0-2 hold them once the step's all-gathers are waited for
        (with ``zero_quantized_weights``, gathered again unquantized: exact, e.g. for saving; at the block's end the
        other ranks' parts are dequantized again, as the step leaves them). ``modifier_rank``:
        that rank's values of the model's parameters go to every rank at the block's end
        (``stages.modifier``); the next step, or read of the state, takes them as it takes any edit."""
        modifier.check_modifier_rank(modifier_rank, self.engine.world_size)
        self.wait_params()
        self.gather_exact(self.buffers)
        self.exact_blocks += 1
        try:
            if modifier_rank is None:
                yield
            else:
                held = [p for buf in self.buffers for p in buf.params]
                others = modifier.Others(modifier.loose(self.module, held))
                # also when the block raised (on every rank): the ranks agree, as DeepSpeed's __exit__
                with modifier.ending(functools.partial(self._broadcast_params, modifier_rank, others)):
                    yield
        finally:
            self.exact_blocks -= 1
        if self.exact_blocks == 0 and self._quantized_gathers():
            # qwZ: the other ranks' parts dequantized again, as the step leaves them (a block, even an empty one or
            # a save, must not change the run); values assigned in the block (p.data = ...) go into param_flat first.
            # Only at the outermost block's end: a block inside one (a save) leaves the outer one's values exact
            adopt.follow_replaced(self, self.name_of)
            self.requantize_whole()

    def _broadcast_params(self, modifier_rank: int, others: modifier.Others) -> None:
        """Every rank takes ``modifier_rank``'s values of the held and the model's other parameters, once the ranks
        agree on what they send (``modifier.check_sendable``); if they cannot, of what still fits, then raises."""
        flats = [buf.param_flat for buf in self.buffers]
        misfits = [m for buf in self.buffers for m in adopt.misfits(buf, buf.param_flat, self.name_of)]
        try:
            modifier.check_sendable(self.engine, modifier_rank, misfits, others, self.device)
        except modifier.ModifierMismatch:
            for buf in self.buffers:
                adopt.put_back(buf, buf.param_flat)
            others.put_back()
            modifier.send_what_fits(self.engine, modifier_rank, flats, others, self.device)
            raise
        adopt.follow_replaced(self, self.name_of)  # p.data = ... on the modifier rank: into param_flat first
        modifier.broadcast(self.engine, flats + others.tensors(), modifier_rank)

    def dequantized_copies(self) -> bool:
        """qwZ outside ``gathered_params()``: this rank holds the other ranks' parameters as the step's quantized
        all-gather left them, dequantized, and so does the model's state_dict."""
        return self.exact_blocks == 0 and self._quantized_gathers()

    def _quantized_gathers(self) -> bool:
        """qwZ: some buffer's updated shard is all-gathered as int8 blocks after the step."""
        return any(self.epilogue_quantizer(buf) is not None for buf in self.buffers)

    def gather_exact(self, buffers: Sequence[FlatBuffer]) -> None:
        """qwZ: all-gather ``buffers`` (whole ``param_flat``) again unquantized, so that every rank holds every
        rank's exact parameters (the step's quantized gather left the dequantized values of other ranks)."""
        if not getattr(self.options, "quantized_weights", False) or self.num_shards == 1:
            return
        for buf in buffers:
            for bucket in buf.layout.buckets:
                full = buf.bucket_slice(buf.param_flat, bucket)
                self.engine.all_gather(full, self.param_shard(buf, bucket), name=f"exact.{bucket.index}").wait()

    @contextlib.contextmanager
    def hooks_removed(self) -> Iterator[None]:
        """The model without hooks that lead back to this pipeline inside the block (to copy or pickle
        it); stages 0-2 hook only the parameters, which copies do not carry, so this does nothing."""
        yield

    def grad_shard_bytes(self) -> int:
        """Bytes of this rank's gradient shards: the most the idle scratch buckets of stages 1-3 hold."""
        return sum(b.grad_shard.numel() * b.grad_shard.element_size() for b in self.buffers if b.grad_shard is not None)

    def new_scratch(self, size: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new scratch bucket for a bucket of ``numel`` elements: of ``size`` elements (what fits every bucket, which
        the idle ones may keep), or of ``numel`` alone where one of ``size`` holds more bytes than the gradient shards
        and so would never be kept (a model of fewer than two buckets per rank held two of the largest size where its
        other bucket is small). Left unfilled."""
        kept = size * dtype.itemsize <= self.grad_shard_bytes()
        return torch.empty(size if kept else numel, dtype=dtype, device=device)

    def memory_tensors(self) -> dict[str, list[Optional[torch.Tensor]]]:
        """Tensors this rank holds, by kind (``params`` lists only the flat buffers; the optimizer adds the rest).
        With offload, the optimizer state in the tier is under ``host`` (``placement.memory``), not ``optimizer``."""
        grads = [t for buf in self.buffers for t in (buf.grad_flat, buf.grad_shard, *buf.scratch.values())]
        grads += [t for op in self._inflight for t in op.held]
        state = [t for buf in self.buffers for t in (buf.master, buf.exp_avg, buf.exp_avg_sq, buf.max_exp_avg_sq)]
        tensors = {
            "params": [buf.param_flat for buf in self.buffers],
            "grads": grads,
            "optimizer": state,
            "buffers": [],
            "secondary": [],
        }
        if self.tier is not None:
            tensors.update(placement.memory(self))
        if self.speculation is not None:  # super_offload's copies, in host memory with the tier's
            tensors["host"] = tensors.get("host", []) + self.speculation.copies()
        return tensors


def _let_go(hooks: list[Any], owned: list[int], ref: weakref.ref) -> None:
    """Take a pipeline's gradient hooks off its parameters and its entries out of ``owners``: at ``close``, or once
    the pipeline is collected (a model trained by one optimizer after another, a learning-rate finder or a notebook
    building them anew: the hooks of the dead ones did nothing, and each forward and backward paid for them)."""
    for h in hooks:
        h.remove()
    hooks.clear()
    for i in owned:
        if owners.get(i) is ref:
            del owners[i]
    owned.clear()
