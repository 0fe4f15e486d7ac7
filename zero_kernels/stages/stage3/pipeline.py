"""Stage 3: as stage 2, and each rank keeps only its shard of the parameters between uses.

Units. A *unit* is what is gathered and freed together: the trainable parameters of one param
group and dtype that a module holds directly (``module.parameters(recurse=False)``), or, for a
leaf module (``model_hints.set_leaf_modules``), holds in its whole subtree; a parameter listed by
several modules (weight tying) belongs to the first one in ``module.modules()`` order and is
gathered for each of them. Parameters under ``stage3_param_persistence_threshold``
elements are pooled, per param group and dtype, into one persistent unit that stays gathered
(like stage 2: updated at the step and all-gathered back). Each unit is one ``FlatBuffer``
(buckets of ``reduce_bucket_size`` elements, each split evenly over the ranks), so gathering a
unit is one all-gather per bucket into a full buffer that the parameters view; freeing sets
every ``p.data`` to an empty tensor (the ``Parameter`` objects, and so the model's and the
optimizer's references, stay valid): ``units.TrainableUnit``. Buffers are ordered from the last module to the
first, the order in which backward produces gradients.

When. ``hooks.Stage3Scheduler`` gathers a unit before each forward and backward use,
prefetches the next unit and more up to ``stage3_prefetch_bucket_size`` elements ahead, and frees
after use. Every rank checks that every rank gathers the same units (``stage3.check``): before the
gathers of the first pass of each kind, and in the step's exchange for passes that repeat it;
ranks that diverge raise ``CommError`` instead of pairing different gathers. How each gather runs (plain;
int8 blocks with ``zero_quantized_weights``; from the node's secondary partition with
``zero_hpz_partition_size``; plain and exact inside ``gathered_params()``) is ``stage3.gathers``'s business.
Once the backward of every forward use of a unit has ended (``stage3.uses``: a point that is the same on every rank,
whichever of its parameters the data gave a gradient), or at the end of backward, its gradients go
through the stage-2 path: copied (divided by the world size) into a bucket, reduce-scattered and
added to the rank's gradient shard; ``p.grad`` becomes ``None``. A parameter without a gradient
then counts as zero in the reduction (it is not marked as having a gradient: ranks where the
data routed nothing to an expert add nothing to its gradient).

Step. The fused kernel updates the rank's shard in place: fp32 parameters are their own master;
for bf16/fp16 the kernel writes the updated values (``out=``) into ``param_shard``, the
all-gather source of the next gather. Nothing is all-gathered at the step except persistent
units (and units held by ``gathered_params``).

Offload. With ``offload_param`` on the cpu and the optimizer state offloaded (``offload_optimizer``), the
host tier's copy of a unit's parameter shard is the shard itself: the host Adam writes the new values there,
nothing goes up at the step, and each gather copies the shard (or its int8 payload with
``zero_quantized_weights``) to the device first (``stage3.gathers``). Persistent units stay on the device.
With ``offload_param`` on the cpu and the state (or part of it) on the device, the shards live in host memory of
their own and the device's update runs on a copy of each bucket's shard (``stage3.host_params``).
With ``offload_param`` on nvme the units beyond ``max_in_cpu`` keep their shard in a file instead, read through a
bounded pool of host buffers for each gather and for the update (``stage3.disk_params``). With the optimizer
state on disk (``offload_optimizer`` nvme, ``ratio`` 1) the reduced gradient shards live in files too, written as
each bucket's reduction completes and read ahead by the update (``stage3.disk_grads``).

Frozen parameters are partitioned too, per holding module, as they are (or in int8 with
``zero_quantized_nontrainable_weights``), and gathered around their module's uses (``stage3.frozen``).

Limits: a parameter used
outside the forward of a module that holds it must be registered (or is found on first use) as
an external parameter of the module that uses it; every rank must run the same modules in the
same order outside leaf modules, as the collectives follow them.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from ...offload import HostTier
from .. import adopt, grad_accum, master, modifier, offloaded, placement, stats
from ..base import FlatBuffer
from ..buffers import same_bits
from ..eager import weakly
from ..layout import Bucket
from ..quantized_gather import WeightQuantizer
from ..speculation import Speculation
from ..stage2 import Stage2Pipeline
from . import disk_grads, disk_params, full_shape, generation, held_edits, model_hints, resize
from . import save as stage3_save
from .check import DeferredChecks, check_same_units
from .disk_grads import DiskGrads
from .disk_params import DiskParams
from .forward_writes import NONE, ForwardWrites, describe_persistent
from .frozen import FrozenUnit, InHost, frozen_members
from .gathers import UnitGathers
from .hooks import Stage3Scheduler
from .host_params import HostParams
from .plan import check_externals, holders
from .units import TrainableUnit


@dataclass
class Stage3Buffer(FlatBuffer):
    """A unit's buffer: ``param_shard`` (this rank's parameters) and ``full`` (while gathered)."""

    persistent: bool = False
    param_shard: Optional[torch.Tensor] = None
    full: Optional[torch.Tensor] = None
    secondary: Optional[list] = None  # hpZ: this rank's part of each gathered bucket, until the step (``gathers``)
    secondary_stamp: Optional[tuple] = None
    params_in: Optional[Callable[[], None]] = None  # reads a shard kept in a file in (``disk_params``)

    def ready(self) -> None:
        """As every buffer's, and this rank's parameter shard in memory when a file holds it."""
        super().ready()
        if self.params_in is not None:
            self.params_in()


class Stage3Pipeline(Stage2Pipeline):
    stage = 3
    requires_module = True
    allgather_by_bucket = False  # gathers by module unit, up to stage3_prefetch_bucket_size ahead

    def __init__(self, engine: Any, options: Any, *, module: Any = None, **kwargs: Any):
        if not isinstance(module, nn.Module):
            raise ValueError(
                "ZeRO stage 3 needs the model: pass the nn.Module itself (ShardedFusedAdam(model, ...)), "
                f"not its parameters; got {type(module).__name__}"
            )
        super().__init__(engine, options, module=module, **kwargs)
        model_hints.apply_leaf_config(module, self.options.leaf_module)
        model_hints.mark_adapter_variants(module)
        model_hints.register_position_tables(module)
        self._generating: list[nn.Module] = generation.sync_generate(module) if self.engine.world_size > 1 else []
        self._resizing: list[nn.Module] = resize.guard_resize(module)
        self.unit_gathers = UnitGathers(
            self.engine, self.options, self.param_traffic, self.weight_quantizer, self.uploads
        )
        self._holder: dict[int, int] = {}  # id(parameter) -> index of its unit's module (``stage3.plan.holders``)
        self._units: list = []  # ``TrainableUnit``s, then ``FrozenUnit``s
        self._frozen: Optional[list[FrozenUnit]] = None  # built at the first ``add_group``
        self._frozen_shape: dict[int, torch.Size] = {}  # id(frozen partitioned parameter) -> its shape
        self._scheduler: Optional[Stage3Scheduler] = None
        self._hold_depth = 0
        self._deferred = DeferredChecks()  # gathers of repeated passes, compared at the step
        self.forward_writes = ForwardWrites()  # a gathered parameter written in place, refused at the step
        self.persistent_writes = ForwardWrites()  # a persistent one, refused where the ranks' values differ
        self.disk_params: Optional[DiskParams] = None  # ``offload_param`` on nvme: shards in files
        self.disk_grads: Optional[DiskGrads] = disk_grads.start(self.tier)  # the state on disk: gradients in files
        self.host_params: Optional[HostParams] = None  # ``offload_param``, the state not all in the tier
        if self.options.offload_param.enabled and not self.params_offloaded:
            self.host_params = HostParams(self.options.offload_param.pin_memory)
        try:
            self.disk_params = disk_params.start(self.options, self.engine, self._agree_params)
        except (OSError, ValueError):
            if self.tier is not None:
                self.tier.close()
            raise
        self._state_dict_guard = stage3_save.guard_state_dict(self)
        if self.options.offload_optimizer.super_offload and self.tier is not None and self.tier.kind == "host":
            self.speculation = Speculation()  # the host Adam of each reduced bucket runs during backward

    def _agree_params(self, problem: Optional[str]) -> None:
        offloaded.agree(self.engine, problem, "offload_param.start", "offload_param")

    def add_group(self, group: int, params: Sequence[nn.Parameter], indices: Sequence[int]) -> None:
        """Build one buffer per unit of param group ``group`` (see the module docstring)."""
        check_externals(self.module)  # before anything changes
        self._holder = holders(self.module)
        trainable = [(p, i) for p, i in zip(params, indices) if p.requires_grad]
        foreign = [tuple(p.shape) for p, _ in trainable if id(p) not in self._holder]
        if foreign:
            raise ValueError(
                f"ZeRO stage 3: {len(foreign)} parameter(s) (shapes {foreign[:3]}) are not parameters of the "
                "model given to the optimizer; stage 3 can only gather the model's own parameters"
            )
        self._release_frozen({id(p) for p, _ in trainable if id(p) in self._frozen_shape})
        threshold = int(self.options.stage3_param_persistence_threshold)
        units: dict[tuple, list[tuple[nn.Parameter, int]]] = {}
        for p, i in trainable:
            persistent = p.numel() < threshold
            key = (persistent, -1 if persistent else -self._holder[id(p)], str(p.dtype), str(p.device))
            units.setdefault(key, []).append((p, i))
        buffers = [self._unit_buffer(group, units[key], persistent=key[0]) for key in sorted(units)]
        self._reserve_grads(buffers)
        # a failure from here on (a disk without room for a unit's parameters or state) takes back every unit of
        # the group, the parameters whole again: the later steps run as if the group had never been given
        mark = self._mark([p for p, _ in trainable])
        try:
            in_files = self._choose_files(buffers)
            for buf in buffers:
                grad_accum.warn_unused(self, buf, self._accum_warned)
                self._allocate(buf, in_file=id(buf) in in_files)
                self._index(buf)
        except BaseException:
            self._unbuild(buffers, mark)
            raise
        for _, i in trainable:
            self.step_counts.counts.setdefault(i, 0)
            self.has_grad.setdefault(i, False)
        if self._frozen is None:
            self._frozen = self._partition_frozen()
        self._install_scheduler()

    def _partition_frozen(self) -> list[FrozenUnit]:
        """The model's frozen parameters as units (``stage3.frozen``; int8 with
        ``zero_quantized_nontrainable_weights``), built once."""
        modules = list(self.module.named_modules(remove_duplicate=True))
        threshold = int(self.options.stage3_param_persistence_threshold)
        quantized = self._frozen_quantized
        return [
            self._frozen_unit(params, *modules[-key[0]])
            for key, params in frozen_members(self.module, self._holder, threshold, quantized).items()
        ]

    @property
    def _frozen_quantized(self) -> bool:
        return bool(getattr(self.options, "quantized_nontrainable_weights", False))

    def _frozen_unit(self, params: list[nn.Parameter], name: str, holder: nn.Module) -> FrozenUnit:
        # the unit holds the pipeline weakly: a reference cycle kept it until Python's collector ran
        unit = FrozenUnit(
            self.engine, params, name, type(holder).__name__, self.param_traffic, weakly(self.name_of),
            self._frozen_quantized, home=self._frozen_home(),
        )  # fmt: skip
        self._frozen_shape.update((id(p), shape) for p, shape in zip(params, unit.shapes))
        return unit

    def _frozen_home(self) -> Optional[InHost]:
        """Where frozen chunks live: in host memory with ``offload_param``, else beside the parameters (None)."""
        config = self.options.offload_param
        if not config.enabled:
            return None
        pin = bool(config.pin_memory) and torch.cuda.is_available()
        return InHost(pin, self.unit_gathers.on_device, HostTier.shares)

    def _release_frozen(self, unfrozen: set[int]) -> None:
        """Parameters of frozen units given to a param group (unfrozen after the optimizer was built): each unit
        holding one is gathered (a collective: every rank adds the same group) and rebuilt without them; they hold
        their full values again (in int8, the dequantized ones), to be sharded as trainable ones. In int8 the unit's
        other parameters are quantized again in the new chunk's blocks (within half of their scale)."""
        if not unfrozen:
            return
        modules = dict(self.module.named_modules(remove_duplicate=True))
        kept = []
        for unit in self._frozen or ():
            if not any(id(p) in unfrozen for p in unit.params):
                kept.append(unit)
                continue
            if unit.full is None:
                unit.start_gather()
                unit.finish_gather()
            values = [p.detach().clone() for p in unit.params]
            unit.free()
            for p, value in zip(unit.params, values):
                p.data = value
                self._frozen_shape.pop(id(p))
                full_shape.unlabel(p)
            remaining = [p for p in unit.params if id(p) not in unfrozen]
            if remaining:
                kept.append(self._frozen_unit(remaining, unit.name, modules[unit.name]))
        self._frozen = kept

    def _unit_buffer(self, group: int, members: list[tuple[nn.Parameter, int]], *, persistent: bool) -> Stage3Buffer:
        ps = [p for p, _ in members]
        buf = Stage3Buffer(group, self.build_layout(ps), ps, [i for _, i in members], ps[0].dtype, ps[0].device)
        buf.persistent = persistent
        return buf

    def _choose_files(self, buffers: list[Stage3Buffer]) -> set[int]:
        """``offload_param`` on nvme: the ids of the units of ``buffers`` whose shards go to files, their files
        reserved (before anything else changes; a disk without room on any rank raises on every rank, and a shard
        larger than ``buffer_size`` is the same on every rank)."""
        if self.disk_params is None:
            return set()
        problem, chosen = None, []
        try:
            # a unit of no elements (zero-element parameters) has nothing to keep in a file
            chosen = self.disk_params.choose(
                [b for b in buffers if not b.persistent and b.layout.buckets], self._unit_name
            )
        except OSError as err:
            problem = str(err)
        self._agree_params(problem)
        return {id(b) for b in chosen}

    def _unit_name(self, buf: Stage3Buffer) -> str:
        """A unit by the parameters it holds, for errors."""
        names = [self.name_of(p) for p in buf.params[:2]]
        return f"the unit of {', '.join(names)}{', ...' if len(buf.params) > 2 else ''}"

    def _install_scheduler(self) -> None:
        previous = self._scheduler
        if previous is not None:
            previous.remove()
        modules = list(self.module.named_modules(remove_duplicate=True))
        holder_of = holders(self.module)  # read now: modules come and go (register_parametrization, remove_...)
        units = []
        for uid, buf in enumerate(self.buffers):
            name, holder = self._unit_holder(buf, modules, holder_of)
            label = f"{name} (persistent parameters)" if buf.persistent else name
            units.append(TrainableUnit(self, buf, uid, holder, label))
        for frozen in self._frozen or ():
            frozen.uid = len(units)
            units.append(frozen)
        prefetch = int(self.options.stage3_prefetch_bucket_size)
        self._units = units
        self._scheduler = Stage3Scheduler(
            self.module,
            units,
            prefetch_numel=prefetch,
            max_live_numel=int(self.options.stage3_max_live_parameters),
            check=weakly(self._check_gathers),
            on_end=weakly(self._end_scheduled_round),
            written=weakly(self._written_in_forward),
            late=weakly(self._late_on_any_rank),
        )
        if previous is not None:  # hooks put back (a copy was made on this rank alone): no first pass again
            self._scheduler.follow(previous)

    def _unit_holder(
        self, buf: Stage3Buffer, modules: list[tuple[str, nn.Module]], holder_of: dict[int, int]
    ) -> tuple[str, nn.Module]:
        """(name, module) a unit is named after: the module that holds its first parameter still in the model, as the
        model is now. Since the optimizer was built modules may have come (``register_parametrization`` puts the
        parameter under ``parametrizations.<name>``) or gone (``remove_parametrizations``, ``remove_weight_norm``:
        the parameters they held left the model, replaced by new ones): positions read when the units were made
        would name another module or none. A unit none of whose parameters is in the model any more is never
        gathered (no module uses it) and gets no gradient, so the step leaves it alone, as AdamW does."""
        for p in buf.params:
            if id(p) in holder_of:
                return modules[holder_of[id(p)]]
        return f"{self._unit_name(buf)} (no longer in the model)", nn.Module()

    def _check_gathers(self, batch: list[int], phase: str, deferred: bool) -> None:
        """Every rank must be about to gather the same units (``stage3.check``); else ``CommError`` now, or at
        the step for a batch whose check is ``deferred``."""
        units = [self._units[i] for i in batch]
        if deferred:
            self._deferred.add(units, phase)
        else:
            check_same_units(self._control, units, phase, self._suggest_leaf)

    def _late_on_any_rank(self, late: set[int]) -> set[int]:
        """The units that some rank reduces at the end of the backward beginning now (``late``: this rank's; see
        ``stage3.uses``): one small all-reduce, so that every rank reduces them there. A unit reduced at the end on
        one rank and earlier on another (a call whose input is a computed tensor on some ranks only: ``x * self.scale
        if use else x``) put its reduction before a gather on one rank and after it on the other."""
        if self._control.world_size == 1:
            return late
        flags = torch.zeros(len(self._units), dtype=torch.int64)  # host data: on the CPU, as the checks
        flags[sorted(late)] = 1
        self._control.all_reduce(flags, op="max", name="stage3.late").wait()
        return set(flags.nonzero().flatten().tolist())

    def _written_in_forward(self, p: nn.Parameter) -> None:
        """A persistent parameter written in place during a forward: compared across ranks at the step
        (``forward_writes``)."""
        b, slot = self.where[id(p)]
        self.persistent_writes.record(self.buffers[b].index_of(slot))

    def _step_columns(self) -> list[float]:
        return self._deferred.columns() + self.forward_writes.columns() + self.persistent_writes.columns()

    def _verify_step_columns(self, rows: list[list[float]]) -> None:
        n = len(self._deferred.columns())
        self._deferred.verify(self._control, [row[:n] for row in rows], self._units, self._suggest_leaf)
        self.forward_writes.verify([row[n : n + 1] for row in rows], self._index_name, self._control.global_ranks)
        mine = self.persistent_writes.found
        self._verify_persistent_writes(self.persistent_writes.take([row[n + 1 :] for row in rows]), mine)

    def _verify_persistent_writes(self, found: list[int], mine: set[int]) -> None:
        """Where some rank found a persistent parameter written during a forward (every rank has ``found``, each
        rank's first, or ``NONE``; ``mine``: all this rank found), the ranks compare the bits of every persistent
        parameter and raise where one that some rank found written differs. With qwZ each rank holds the other
        ranks' parts dequantized, so the bits differ by design: there only a write made on some ranks and not on
        others is found (the marks differ); one made on every rank is taken as the same."""
        if all(index == NONE for index in found):
            return
        held = [(index, p) for buf in self.buffers if buf.persistent for index, p in zip(buf.indices, buf.params)]
        marked = torch.tensor([index in mine for index, _ in held], dtype=torch.int64, device=self.device)
        dequantized = getattr(self.options, "quantized_weights", False) and self.num_shards > 1
        values = marked if dequantized else held_edits.word_sums([p for _, p in held], self.device)
        differ = held_edits.marked_differing(self.engine, values, marked)
        if differ:
            raise RuntimeError(describe_persistent(self._index_name(held[differ[0]][0])))

    def _suggest_leaf(self, names: list[str]) -> str:
        """The fix for ranks that gather the units of modules ``names``: their closest common caller as a leaf."""
        common: list[str] = []
        for level in zip(*(name.split(".") if name else [] for name in names)):
            if len(set(level)) > 1:
                break
            common.append(level[0])
        while common and isinstance(self.module.get_submodule(".".join(common)), (nn.ModuleList, nn.ModuleDict)):
            common.pop()  # containers are never called: hooks on them never run
        fix = (
            "Where the data chooses the modules (a mixture of experts routing tokens), mark the module that makes "
            "the choice as a leaf module, gathered whole on every rank: zero_kernels.set_leaf_modules(model, [{}])."
        )
        if len(names) < 2 or not common:
            return fix.format("ThatModuleClass")
        path = ".".join(common)
        kind = type(self.module.get_submodule(path)).__name__
        return f"The closest module around both is '{path}' ({kind}). " + fix.format(kind)

    def _on_no_grad(self, p: nn.Parameter) -> None:
        """``p`` has no gradient this round: its part of the buckets counts as zero (it is not marked as having one)."""
        if not self.sync_enabled:
            return
        b, slot = self.where[id(p)]
        if not self._first_report(b, slot, p):
            return
        buf = self.buffers[b]
        for k in buf.layout.slot_buckets[slot]:
            buf.pending[k] -= 1
        self._launch_ready()

    def _close_failed_round(self, keep: bool) -> None:
        """As every stage, and first the scheduler's backward, which the same exception left open: ``keep``, its
        units not yet reduced are reduced into the round (opened here: no backward runs to end it), else freed."""
        scheduler = self._scheduler
        if scheduler is not None and scheduler.in_backward:
            self._round_open = self._round_open or keep
            scheduler.end_failed_backward(keep)
        super()._close_failed_round(keep)

    @property
    def failed_round_open(self) -> bool:
        """As every stage, or the scheduler's backward the same exception left open."""
        scheduler = self._scheduler
        return super().failed_round_open or (scheduler is not None and scheduler.in_backward)

    @property
    def params_offloaded(self) -> bool:
        """``offload_param`` with all the state in the tier (``offload_optimizer.ratio`` 1): the parameter shards are
        the state tier's host copies (or, on nvme, in files: ``disk_params``). Otherwise ``host_params`` keeps them."""
        tier = self.tier
        return tier is not None and self.options.offload_param.device in ("cpu", "nvme") and tier.config.ratio == 1.0

    def _allocate(self, buf: Stage3Buffer, in_file: bool = False) -> None:
        super()._allocate(buf)
        shard = self.tier.shards.get(id(buf)) if self.tier is not None and not buf.persistent else None
        if self.params_offloaded and shard is not None and shard.params is not None:  # none for a unit of no elements
            buf.param_shard = shard.params  # the host copy, filled from the device shard
        elif self.host_params is not None and not buf.persistent:
            self.host_params.place(buf, shard)
        if in_file:
            self.disk_params.place(buf, buf.param_shard)
            if shard is not None:
                shard.params = None  # the file holds the shard; the step reads it bucket by bucket
            if self.host_params is not None:
                self.host_params.drop(buf)

    def _reserve_grads(self, buffers: list[Stage3Buffer]) -> None:
        """With the state on disk: the files of the gradient shards of ``buffers`` (``disk_grads``), reserved before
        anything changes (a disk without room on any rank raises on every rank, the tier's files removed)."""
        if self.disk_grads is None:
            return
        problem, added = None, []
        try:
            for buf in buffers:
                self.disk_grads.add(buf, self.accumulate_dtype_of(buf), self._unit_name(buf))
                added.append(buf)
        except OSError as err:
            problem = str(err)
        try:
            offloaded.agree(self.engine, problem, "offload.reserve_grads")
        except OSError:
            # only these files go: the state and gradients of the units before them (``add_param_group``) stay in
            # theirs; a constructor that fails closes the whole tier (``Pipeline.close``)
            for buf in reversed(added):
                self.disk_grads.remove(buf)
            raise

    def _mark(self, params: Sequence[nn.Parameter]) -> dict[str, Any]:
        """As every stage, and the host room of ``offload_param`` on nvme (``max_in_cpu``) the new units take."""
        mark = super()._mark(params)
        mark["room"] = None if self.disk_params is None else self.disk_params.room
        return mark

    def _unbuild(self, bufs: Sequence[FlatBuffer], mark: dict[str, Any]) -> None:
        """As every stage; ``offload_param`` on nvme gets its host room back."""
        super()._unbuild(bufs, mark)
        if self.disk_params is not None:
            self.disk_params.room = mark["room"]

    def _discard(self, buf: FlatBuffer) -> None:
        """As every stage, and the unit's gradient file and parameter file (or host shard) go too."""
        super()._discard(buf)
        if self.disk_grads is not None:
            self.disk_grads.remove(buf)
        if self.disk_params is not None:
            self.disk_params.discard(buf)
        if self.host_params is not None:
            self.host_params.drop(buf)
            self.host_params.moved.discard(id(buf))

    def _allocate_grads(self, buf: FlatBuffer) -> None:
        """As stage 2, unless the gradient shard is in its file (``_reserve_grads``)."""
        if self.disk_grads is None:
            super()._allocate_grads(buf)

    def _accumulate(self, buf: FlatBuffer, bucket: Bucket, mine: torch.Tensor, first: bool) -> None:
        if self.speculation is not None:  # an update run on the bucket's last sum is undone, one run on the new
            self.speculation.drop(self, buf, bucket)
            super()._accumulate(buf, bucket, mine, first)
            self.speculation.start(self, buf, bucket)
        elif self.disk_grads is None:
            super()._accumulate(buf, bucket, mine, first)
        else:  # the part and its column terms go to the file (``disk_grads``)
            self.disk_grads.reduced(buf, bucket, mine, first, final=self.window_ends)

    def grads_in_file(self, buf: FlatBuffer) -> bool:
        return self.disk_grads is not None

    def grad_shard(self, buf: FlatBuffer, bucket: Bucket) -> torch.Tensor:
        """As stage 2; a gradient shard in a file gives a copy read from it (the update reads ``step_grads``)."""
        if self.disk_grads is None:
            return super().grad_shard(buf, bucket)
        return self.disk_grads.read(buf, bucket)

    def grad_column(self, norm: bool) -> torch.Tensor:
        """As stage 2; with the gradients in files, the terms taken as each bucket was reduced (no read)."""
        if self.disk_grads is None:
            return super().grad_column(norm)
        return stats.combine(self.disk_grads.column(norm), self.column_device)

    def zero_reduced(self, buf: FlatBuffer, bucket: Bucket) -> None:
        if self.disk_grads is None:
            super().zero_reduced(buf, bucket)
        else:
            self.disk_grads.zero(buf, bucket)

    def reduced_shard(self, buf: FlatBuffer) -> torch.Tensor:
        return super().reduced_shard(buf) if self.disk_grads is None else self.disk_grads.whole(buf)

    def assign_reduced(self, buf: FlatBuffer, shard: torch.Tensor) -> None:
        if self.disk_grads is None:
            super().assign_reduced(buf, shard)
        else:
            self.disk_grads.assign(buf, shard)

    def step_grads(self, buf: FlatBuffer, bucket: Bucket) -> torch.Tensor:
        """The host Adam's gradients of ``bucket`` from the shard's file, read ahead (``disk_grads``)."""
        return self.disk_grads.step(buf, bucket)

    def stepped_grads(self, buf: FlatBuffer, bucket: Bucket) -> None:
        """The update is done with ``step_grads``' buffer."""
        self.disk_grads.used(buf, bucket)

    def _place_params(self, buf: Stage3Buffer) -> None:
        """Persistent units keep the full buffer; the others keep this rank's shard and free the parameters."""
        if buf.persistent:
            super()._place_params(buf)
            return
        buf.param_shard = torch.zeros(buf.layout.shard_numel, dtype=buf.dtype, device=buf.device)
        for seg in buf.layout.segments(self.shard_rank):
            flat = buf.param_of(seg.slot).detach().reshape(-1)
            buf.param_shard.narrow(0, seg.shard_offset, seg.numel).copy_(flat.narrow(0, seg.param_offset, seg.numel))
        for p in buf.params:
            p.data = torch.empty(0, dtype=buf.dtype, device=buf.device)

    def _register_grad_hooks(self, buf: FlatBuffer) -> None:
        """The scheduler hands gradients on (``TrainableUnit.reduce_grads``) when it reduces a unit."""

    def _queue_round_end(self) -> None:
        """The round ends where the scheduler's backward ends (``_end_scheduled_round``): the units hand their gradients
        on from its reductions, which a reentrant checkpoint segment's inner backward may run, and that inner backward
        ends before the outer one has handed on the rest."""

    def _end_scheduled_round(self) -> None:
        """The scheduler's backward ended, every unit reduced: the round those reductions opened ends."""
        if self._round_open:
            self._end_round()

    def param_shape(self, p: torch.Tensor) -> torch.Size:
        """As the base, and the full shape of a partitioned frozen parameter."""
        shape = self._frozen_shape.get(id(p))
        return super().param_shape(p) if shape is None else shape

    def frozen_partitioned(self) -> set[int]:
        """id of every frozen parameter partitioned (``stage3.frozen``)."""
        return set(self._frozen_shape)

    def gathered_frozen(self) -> Iterator[list[nn.Parameter]]:
        """Each unit of frozen parameters in turn, gathered while the iteration is on it; a
        collective: every rank iterates to the end, between steps."""
        for unit in self._frozen or ():
            if unit.full is not None:  # gathered already (inside gathered_params())
                yield unit.params
                continue
            unit.start_gather()
            unit.finish_gather()
            try:
                yield unit.params
            finally:
                unit.free()

    def assign_frozen(self, values: dict[int, torch.Tensor]) -> None:
        """Give the partitioned frozen parameters the full values ``values`` holds (id(parameter) -> value):
        this rank's chunks are rebuilt (a checkpoint load)."""
        for unit in self._frozen or ():
            mine = {k: v for k, v in values.items() if k in {id(p) for p in unit.params}}
            if mine:
                unit.assign(mine)

    def frozen_chunks(self) -> list[tuple[list[nn.Parameter], list[torch.Size], torch.Tensor]]:
        return [(unit.params, unit.shapes, unit.held.tensor) for unit in self._frozen or ()]

    def load_frozen_chunks(self, chunks: Sequence[tuple[Sequence[nn.Parameter], Any, torch.Tensor]]) -> None:
        units = {tuple(id(p) for p in unit.params): unit for unit in self._frozen or ()}
        for params, _, chunk in chunks:
            unit = units.get(tuple(id(p) for p in params))
            if unit is None:
                raise RuntimeError("the rebuilt optimizer has other frozen units than the saved one")
            unit.held.tensor = chunk

    def param_shard(self, buf: Stage3Buffer, bucket: Bucket) -> torch.Tensor:
        if buf.persistent:
            return super().param_shard(buf, bucket)
        if self.disk_params is not None:
            self.disk_params.resident(buf)
        return buf.shard_slice(buf.param_shard, bucket)

    def device_params(self, buf: Stage3Buffer, bucket: Bucket) -> contextlib.AbstractContextManager[torch.Tensor]:
        """As the base, or a copy on the device of a shard kept in host memory or in a file (``host_params``)."""
        if self.params_in_file(buf):
            return self._staged_from_file(buf, bucket)
        return self._staged(buf, self.param_shard(buf, bucket))

    def _staged(self, buf: Stage3Buffer, shard: torch.Tensor) -> contextlib.AbstractContextManager[torch.Tensor]:
        """``shard`` (host memory) on the device inside the block (``host_params``), or itself where it is there."""
        return contextlib.nullcontext(shard) if self.host_params is None else self.host_params.staged(buf, shard)

    @contextlib.contextmanager
    def _staged_from_file(self, buf: Stage3Buffer, bucket: Bucket) -> Iterator[torch.Tensor]:
        """The device's update of a bucket of a unit whose shard is in a file: read into a pool buffer, updated on a
        copy on the device, written back (``disk_params``)."""
        host = self.step_params(buf, bucket)
        with self._staged(buf, host) as params:
            yield params
        self.stepped_params(buf, bucket, host, whole=False)  # this update always reads the shard (adopts edits)

    def params_in_file(self, buf: FlatBuffer) -> bool:
        return self.disk_params is not None and self.disk_params.holds(buf)

    def params_from_master_in_file(self, buf: FlatBuffer, bucket: Bucket) -> bool:
        return self.params_in_file(buf) and self.disk_params.from_master(buf, bucket)

    def params_read_briefly(self, buf: Stage3Buffer) -> contextlib.AbstractContextManager[None]:
        return self.disk_params.read_briefly(buf) if self.params_in_file(buf) else contextlib.nullcontext()

    def params_loading(self, buf: Stage3Buffer) -> contextlib.AbstractContextManager[None]:
        return self.disk_params.loading(buf) if self.params_in_file(buf) else contextlib.nullcontext()

    def step_params(self, buf: Stage3Buffer, bucket: Bucket, read: bool = True) -> torch.Tensor:
        """The host Adam's copy of this rank's shard of ``bucket`` of a unit kept in a file (``disk_params``);
        ``read``: False where the update overwrites all of it (no edit to adopt: see ``DiskParams.step_params``)."""
        return self.disk_params.step_params(buf, bucket, read)

    def stepped_params(self, buf: Stage3Buffer, bucket: Bucket, params: torch.Tensor, whole: bool) -> None:
        """``step_params``' values as the update left them, written back to the file; ``whole``: every element
        written from the master."""
        self.disk_params.stepped(buf, bucket, params, whole)

    def finish_offloaded_step(self) -> None:
        super().finish_offloaded_step()
        if self.disk_grads is not None:
            self.disk_grads.finish_step()
        if self.disk_params is not None:
            self.disk_params.finish_step()

    def live_param_shard(self, buf: Stage3Buffer, bucket: Bucket) -> torch.Tensor:
        """Inside ``gathered_params()`` the model reads (and writes) the gathered buffer, which the block's end
        writes back to the shard: this rank's part of it."""
        if self.holding and not buf.persistent and buf.full is not None:
            return buf.rank_slice(buf.full, bucket, self.shard_rank)
        return self.param_shard(buf, bucket)

    def _publish(self, buf: Stage3Buffer, bucket: Bucket):
        """Persistent units and units gathered right now receive the updated shards; the others gather later."""
        if buf.persistent:
            return super()._publish(buf, bucket)
        if buf.full is None:
            return None
        return self.unit_gathers.start(
            buf, bucket, self.param_shard(buf, bucket), f"params.{bucket.index}", keep=False, exact=self.holding
        )

    def epilogue_quantizer(self, buf: Stage3Buffer) -> Optional[WeightQuantizer]:
        """Persistent units as stages 1-2; the others' shards are sent as int8 at their next gather (qwZ)."""
        if buf.persistent:
            return super().epilogue_quantizer(buf)
        return self.weight_quantizer if self.unit_gathers.quantized else None

    def _gather_held_exact(self) -> None:
        """qwZ: the units gathered now (persistent ones, and any a pass left gathered) hold other ranks'
        dequantized values; ``gathered_params()`` gathers them again unquantized (the others it gathers so)."""
        if not self.unit_gathers.quantized:
            return
        self.gather_exact([buf for buf in self.buffers if buf.persistent])
        for buf in self.buffers:
            if not buf.persistent and buf.full is not None:
                for b in buf.layout.buckets:
                    full, shard = buf.bucket_slice(buf.full, b), buf.shard_slice(buf.param_shard, b)
                    shard = self.unit_gathers.on_device(shard, full)
                    self.engine.all_gather(full, shard, name=f"exact.{b.index}").wait()

    @property
    def holding(self) -> bool:
        """Inside ``gathered_params()``: gathers are exact (no quantization, no secondary partition)."""
        return self._hold_depth > 0

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """As every stage; the shards change, so ZeRO++'s quantized copies and secondary partitions go first."""
        self._drop_secondary()
        return super().step(*args, **kwargs)

    def writing_params(self, buf: Optional[Stage3Buffer] = None) -> None:
        """A rank whose shard holds none of what is written (padding only, or another parameter) is not written, so its
        own shard cannot tell it that the secondary partition (other ranks' values) is stale: it would gather from
        it alone. A value given to a freed parameter (``buf``) goes into the shards where each rank adopts it: at a
        state read on some ranks, at the unit's next gather on the others, so only ``buf``'s partition goes, which
        every rank then drops before that gather."""
        if buf is None:
            self._drop_secondary()
        else:
            buf.secondary = buf.secondary_stamp = None

    def _drop_secondary(self) -> None:
        self.unit_gathers.changed()
        for buf in self.buffers:
            buf.secondary = buf.secondary_stamp = None

    def dequantized_copies(self) -> bool:
        """Stage 3's model state_dict holds the parameters only inside its own ``gathered_params()``, exact there
        (``stage3.save``); outside it raises."""
        return False

    @contextlib.contextmanager
    def gathered_params(self, modifier_rank: Optional[int] = None) -> Iterator[None]:
        """Every parameter holds its full value inside the block; changes go back to the shards on exit.

        Each rank writes back its own part of each parameter (and its fp32 master where the value
        changed), so every rank must make the same change (checked: ``held_edits``), or name the one rank that
        makes it: ``modifier_rank`` (its full values go to every rank first, ``stages.modifier``).
        """
        modifier.check_modifier_rank(modifier_rank, self.engine.world_size)
        if self._scheduler is None:
            yield
            return
        self._begin_hold()
        others = self._others()
        before = self._held_sums(others) if modifier_rank is None and self._hold_depth == 1 else None
        # also when the block raised (on every rank): the ranks agree, as DeepSpeed's __exit__
        with modifier.ending(functools.partial(self._end_hold, modifier_rank, others, before)):
            yield

    def each_unit_whole(self) -> Iterator[Sequence[nn.Parameter]]:
        """Each unit's parameters whole in turn, exact, gathered one unit at a time (``stage3.consolidated``): the
        whole model read without ever being whole on the device. A collective: every rank iterates to the end,
        between steps and outside a forward; inside ``gathered_params()`` every unit is whole already."""
        if self._scheduler is None or self._hold_depth:
            for unit in self._units:
                yield unit.params
            return
        self._hold_depth += 1  # gathers are exact (``holding``)
        try:
            self._gather_held_exact()
            for unit in self._scheduler.each_gathered("a consolidated state dict"):
                yield unit.params
        finally:
            self._hold_depth -= 1
            self.requantize_whole()

    def _others(self) -> modifier.Others:
        """What a modifier block sends besides the buffers: the gathered frozen units' and the model's other
        parameters."""
        frozen = [p for unit in self._frozen or () if unit.full is not None for p in unit.params]
        held = [p for buf in self.buffers for p in buf.params] + [p for unit in self._frozen or () for p in unit.params]
        return modifier.Others([(self.name_of(p), p) for p in frozen] + modifier.loose(self.module, held))

    def _begin_hold(self) -> None:
        """Enter a hold (``gathered_params``, ``close``): from here gathers are exact (``holding``); the outermost
        gathers every unit, again unquantized where qwZ left others' parts dequantized. A gather that raises (a
        shard's file that cannot be read) leaves the hold not entered, the units gathered so far freed again."""
        self._hold_depth += 1
        if self._hold_depth == 1:
            try:
                self._gather_held_exact()
                self._scheduler.hold()
            except BaseException:
                self._hold_depth -= 1
                self._scheduler.release()
                raise

    def _end_hold(
        self, modifier_rank: Optional[int], others: modifier.Others, before: Optional[torch.Tensor] = None
    ) -> None:
        """Leave a ``gathered_params`` block: ``modifier_rank``'s values to every rank (without it, the outermost
        block's edits compared with ``before``, ``held_edits``), the edits into the shards (outermost block), the
        units released. When the ranks cannot agree on what to send, what still fits is sent and written back, then
        ``ModifierMismatch`` raised (``stages.modifier``)."""
        try:
            mismatch = None
            self._renew_replaced()
            if modifier_rank is not None:
                mismatch = self._broadcast_full(modifier_rank, others)
            elif before is not None:
                self._agree_on_edits(others, before)
            if self._hold_depth == 1:
                self._write_back()
                self.requantize_whole()  # qwZ: persistent units' other ranks' parts as the step leaves them
            if mismatch is not None:
                raise mismatch
        finally:
            self._hold_depth -= 1
            if self._hold_depth == 0:
                for unit in self._units:  # writes inside the block are meant (``forward_writes``)
                    if isinstance(unit, TrainableUnit) and unit.buf.full is not None:
                        unit.record_versions()
                self._scheduler.release()

    @contextlib.contextmanager
    def hooks_removed(self) -> Iterator[None]:
        """The model without the scheduler's hooks inside the block (to copy or pickle it); a new
        scheduler is installed after. Call it between steps, outside ``gathered_params()``."""
        if self._hold_depth:
            raise RuntimeError("ZeRO stage 3: the optimizer cannot be copied or pickled inside gathered_params()")
        installed = self._scheduler is not None
        if installed:
            self._scheduler.remove()
        self._state_dict_guard.remove()
        try:
            yield
        finally:
            self._state_dict_guard = stage3_save.guard_state_dict(self)
            if installed:
                self._install_scheduler()

    def _held_sums(self, others: modifier.Others) -> torch.Tensor:
        """``held_edits.word_sums`` of every full buffer and of ``others``."""
        full = [buf.param_flat if buf.persistent else buf.full for buf in self.buffers]
        return held_edits.word_sums(full + others.tensors(), self.device)

    def _agree_on_edits(self, others: modifier.Others, before: torch.Tensor) -> None:
        """The outermost block without ``modifier_rank``: where some rank edited a full buffer or another parameter
        of the model (its sums moved from ``before``) and the ranks now differ, say so, naming the first parameter
        that differs (``held_edits``)."""
        differ = held_edits.edited_differently(self.engine, before, self._held_sums(others))
        if not differ:
            return
        if differ[0] < len(self.buffers):
            buf = self.buffers[differ[0]]
            params = [buf.param_of(slot) for slot in range(len(buf.layout.slots))]
            per = held_edits.differing(self.engine, held_edits.word_sums(params, self.device))
            name = self.name_of(params[per[0]]) if per else "the parameters"
        else:
            name = others.described()[differ[0] - len(self.buffers)][0]
        held_edits.warn(name)

    def _broadcast_full(self, modifier_rank: int, others: modifier.Others) -> Optional[modifier.ModifierMismatch]:
        """Every parameter's full value (gathered units, persistent buffers, frozen units, the model's other
        parameters) from ``modifier_rank``, once the ranks agree on what they send (``modifier.check_sendable``);
        a ``p.data = ...`` there is taken into its buffer first. When they cannot agree: the replaced ``.data`` put
        back, what still fits sent, and the mismatch returned, to raise once the block's end is written back."""
        full = [buf.param_flat if buf.persistent else buf.full for buf in self.buffers]
        pairs = [(buf, flat) for buf, flat in zip(self.buffers, full) if flat is not None]
        misfits = [m for buf, flat in pairs for m in adopt.misfits(buf, flat, self.name_of)]
        try:
            modifier.check_sendable(self.engine, modifier_rank, misfits, others, self.device)
        except modifier.ModifierMismatch as mismatch:
            for buf, flat in pairs:
                adopt.put_back(buf, flat)
            others.put_back()
            modifier.send_what_fits(self.engine, modifier_rank, full, others, self.device)
            return mismatch
        for buf, flat in pairs:
            adopt.readopt(buf, flat, self.name_of, adopt.every_param(self))
        modifier.broadcast(self.engine, full + others.tensors(), modifier_rank)
        return None

    def _renew_replaced(self) -> None:
        """A unit some of whose parameters were given another ``.data`` in the block (an EMA swapped in) moves to a
        new storage before the assigned values are copied into it: what was assigned from the old one keeps its
        values (``stage3.storage``)."""
        for unit in self._units:
            if (
                isinstance(unit, TrainableUnit)
                and unit.buf.full is not None
                and adopt.replaced(unit.buf, unit.buf.full)
            ):
                unit.buf.full = unit.storage.renew()

    def _write_back(self) -> None:
        """The block's edits into the shards. Shards kept in files are all read in first: a read that fails raises
        before any shard took an edit, so the block's edits are written everywhere or nowhere. Those the block left as
        they were go back to their files after (``DiskParams.let_go``)."""
        self.uploads.wait()
        sharded = [buf for buf in self.buffers if not buf.persistent]
        marks = {} if self.disk_params is None else self.disk_params.read_all_in(sharded)
        for buf in self.buffers:
            if not self._write_back_buffer(buf, watched=id(buf) in marks) and id(buf) in marks:
                self.disk_params.let_go(buf, marks[id(buf)])
        for unit in self._frozen or ():
            unit.write_back()

    def _write_back_buffer(self, buf: Stage3Buffer, watched: bool = False) -> bool:
        """The block's values into ``buf``'s shard, and its masters as the step would have them; ``watched``: return
        whether the shard changed (a value the block wrote, or a master written from outside given to the
        parameters; compared only for a shard its file holds too, ``DiskParams.read_all_in``), else True."""
        changed = not watched or master.written(buf)
        if not buf.persistent:
            adopt.readopt(buf, buf.full, self.name_of, adopt.every_param(self))  # p.data = ... in the block
            self._take_owed_before_a_change(buf)
            for bucket in buf.layout.buckets:
                shard, value = self.param_shard(buf, bucket), buf.rank_slice(buf.full, bucket, self.shard_rank)
                changed = changed or not same_bits(shard, value.to(shard.device))
                shard.copy_(value)
        if placement.resident(buf) or master.written(buf) or buf.persistent:
            master.settle(self, buf)  # a master written from outside wins, as at the step
        else:  # a state in its tier is not read in for the edits: the step adopts them (or the next read)
            placement.adopt_when_read(self, buf)
        return changed

    def _take_owed_before_a_change(self, buf: Stage3Buffer) -> None:
        """Where the masters of ``buf`` owe an earlier block's edits (``placement.adopt_when_read``) and this block
        changed this rank's shard, they take the shard's values from before this block first, as they would have at
        that block's end: taken later, a change back to what the masters held would hide them. A persistent buffer,
        edited where it lives, keeps no values from before a block: its masters take its edits as each block ends."""
        if buf.master is None or buf.edits_owed is None or master.written(buf):
            return
        values = [buf.rank_slice(buf.full, bucket, self.shard_rank) for bucket in buf.layout.buckets]
        shards = [self.param_shard(buf, bucket) for bucket in buf.layout.buckets]
        if all(torch.equal(s, v.to(s.device)) for s, v in zip(shards, values)):
            return
        buf.edits_owed = None
        buf.ready()
        for bucket, shard in zip(buf.layout.buckets, shards):
            master.take(buf, bucket, shard)
        master.record(buf)

    def memory_tensors(self) -> dict[str, list[Optional[torch.Tensor]]]:
        """As the base, with ``params`` the shards, the persistent buffers and whatever is gathered now."""
        tensors = super().memory_tensors()
        tensors["params"] = [t for buf in self.buffers for t in (buf.param_flat, buf.param_shard, buf.full)]
        if self.params_offloaded:  # the shards are the tier's host copies, counted under ``host``, or in files
            tensors["params"] = [t for buf in self.buffers for t in (buf.param_flat, buf.full)]
            tensors["params"] += [buf.param_shard for buf in self.buffers if self._shard_in_place(buf)]
        if self.host_params is not None:  # the shards in host memory
            _to_host(tensors, self.host_params.tensors())
        if self.disk_params is not None:  # the pool; a shard read in whole between steps (host memory)
            _to_host(tensors, self.disk_params.resident_shards())
            tensors["host"] += self.disk_params.files.pool()
        if self.disk_grads is not None:  # the gradient shards are in files (a stand-in here); the pool
            tensors["grads"] = [t for t in tensors["grads"] if t is None or t.device.type != "meta"]
            tensors["host"] += self.disk_grads.files.pool()
        tensors["params"] += [t for unit in self._frozen or () for t in unit.tensors()]
        tensors.setdefault("host", []).extend(t for unit in self._frozen or () for t in unit.host_tensors())
        tensors["secondary"] += [t for buf in self.buffers for t in buf.secondary or ()] + self.unit_gathers.tensors()
        return tensors

    def _shard_in_place(self, buf: Stage3Buffer) -> bool:
        """Whether ``buf``'s parameter shard is in host memory with no host copy of the tier's (a CPU-only machine:
        ``HostTier.shares``) and not in a file."""
        shard = self.tier.shards.get(id(buf))
        in_place = shard is not None and shard.params is None and buf.param_shard is not None
        return in_place and not buf.persistent and not self.params_in_file(buf)

    def close(self) -> None:
        """Remove every hook; each parameter is left holding its full value (gathered exactly, as in
        ``gathered_params()``: with qwZ a quantized gather would leave other ranks' parts dequantized)."""
        self._state_dict_guard.remove()
        generation.restore(self._generating)
        resize.restore(self._resizing)
        if self._scheduler is not None:
            self._begin_hold()
            self._hold_depth -= 1
            self._scheduler.remove()
            self._scheduler = None
        for unit in self._units:
            for p in unit.params:
                full_shape.unlabel(p)
        if self.disk_grads is not None:
            self.disk_grads.close()  # its writes done before the tier removes the files
        super().close()
        if self.disk_params is not None:
            self.disk_params.close()

    def disk_bytes(self) -> int:
        """As the base, with the parameter shards' files."""
        extra = 0 if self.disk_params is None else self.disk_params.files.disk_bytes()
        return super().disk_bytes() + extra


def _to_host(tensors: dict[str, list[Optional[torch.Tensor]]], moved: list[torch.Tensor]) -> None:
    """``moved`` (tensors in host memory) counted once, under ``host``, not under ``params``."""
    ids = {id(t) for t in moved}
    tensors["params"] = [t for t in tensors["params"] if id(t) not in ids]
    tensors.setdefault("host", []).extend(moved)
