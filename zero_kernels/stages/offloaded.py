"""The step's update when the optimizer state lives in a tier (``offload_optimizer``): host memory or files.

A bucket whose state stays on the device (``offload_optimizer.ratio`` < 1: ``placement``) is updated there by
``update.update_bucket``, as without offload. Per bucket in the tier, in the step's bucket order:

1. the bucket's reduced gradient shard is copied down into the buffer's host copy (``HostTier.down``:
   in the dtype the stage keeps it in; bf16: 2 bytes per parameter); at stage 3 with the state on disk the
   gradient shards are in files instead (``stage3.disk_grads``), and the bucket's is read from its file, ahead
   (``step_grads``/``stepped_grads``);
2. where the device parameters differ from the host copy the tier last pushed up (a load or an
   edit since the last step; ``HostTier.changed``, by a fingerprint taken on the device), the bucket
   is copied down, so the update adopts the edit exactly as without offload;
3. the same fused kernel as without offload (``update.launch``: the C++ CPU Adam where the extension
   is built, else the PyTorch reference; the same backend both ways on a CPU-only machine, so results
   are bit for bit those without offload) updates the host state on the tier's threads
   (``HostTier.compute``), writing the new low-precision values into the host parameter copy (fp32
   parameters: their master is that copy); with ``super_offload`` a bucket updated during backward that the step
   keeps (``speculation``) is not updated again: its new parameters are copied into the host copy instead;
4. the bucket's parameters go up (``HostTier.up``), then the stage all-gathers them as usual.

Where the device is host memory (a CPU-only machine, ``HostTier.shares``) steps 1, 2 and 4 have nothing to do:
the kernel reads the reduced gradient shard and writes the device parameter shard in place.

Stage 3 with ``offload_param`` on the cpu keeps its parameter shards in the host copies themselves (the stage's
``params_offloaded``): steps 2 and 4 then have nothing to do, and its gathers copy the shards up. With
``offload_param`` on nvme a unit's shard may live in a file instead (``stage3.disk_params``): the update reads
the bucket's shard from it into a pool buffer and writes it back after (``step_params``/``stepped_params``);
where the update overwrites all of it (``overwritten``) and the file holds what a step wrote there from the master
(``params_from_master_in_file``) the read is skipped.

The state tensors of a bucket are views of resident host tensors or of the part the host tier keeps (``_state``),
or of a sub-group swapped in from the disk tier's files (``_swapped``), written back by ``tier.store``.
Clipping, the non-finite skip, loss scaling and the ranks' agreement checks run before, unchanged. A skipped step
whose flag is in host memory (``skipped_on_host``) leaves the tier alone (DeepSpeed returns early too), except
where stage 3 reads the bucket's gradients or parameters from files, whose reads the step's bookkeeping expects.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..comm.agreement import ranks_text
from ..comm.control import ControlLink
from ..comm.objects import all_gather_objects
from ..env import cpu_adam_threads, settings
from ..log import LOGGER_NAME
from ..offload import DiskTier, HostTier
from . import placement, update
from .buffers import FlatBuffer, GroupHyper
from .layout import Bucket
from .outcome import Decision
from .update import BucketTensors, launch

if TYPE_CHECKING:
    from .base import Pipeline


logger = logging.getLogger(LOGGER_NAME)
SUPER_OFFLOAD = (
    "zero_optimization.offload_optimizer.super_offload=true: the host Adam of each bucket runs during backward, as "
    "soon as its gradients are reduced, on what the step is expected to decide; the step keeps it where it read "
    "what the step's own update reads and otherwise redoes it (results the same as without it)"
)
SUPER_OFFLOAD_ELSEWHERE = (
    "zero_optimization.offload_optimizer.super_offload=true is accepted and ignored with device %s: DeepSpeed's "
    "SuperOffload runs the host Adam of a state offloaded to the cpu"
)
SUPER_OFFLOAD_IGNORED = (
    "zero_optimization.offload_optimizer.super_offload=true is accepted and ignored at stage %d, as DeepSpeed "
    "ignores it below stage 3 (the host Adam runs after backward)"
)


def make_tier(options: Any, engine: Any) -> Optional[HostTier]:
    """The state tier ``options.offload_optimizer`` asks for, or None; a tier that cannot start on some rank
    raises on every rank (after the others closed theirs). What ``super_offload`` does is said once."""
    config = options.offload_optimizer
    if config.super_offload:
        _say_super_offload(options)
    if not config.enabled:
        return None
    cpu_adam_threads()  # a bad value is a ValueError here, as every other variable's, not a tier that did not start
    tier: Optional[HostTier] = None
    problem: Optional[str] = None
    try:
        if config.device == "cpu":
            tier = HostTier(config)
        else:
            tier = DiskTier(config, options.aio, rank=engine.rank, sub_group_size=options.sub_group_size)
    except (OSError, ValueError) as err:
        problem = str(err)
    try:
        agree(engine, problem, "offload.start")
    except OSError:
        if tier is not None:
            tier.close()
        raise
    return tier


def _say_super_offload(options: Any) -> None:
    """What ``super_offload`` does here: at stage 3 with the state offloaded to the cpu, the speculation
    (``stages.speculation``, logged); else nothing (a warning)."""
    device = options.offload_optimizer.device
    if options.stage < 3:
        logger.warning(SUPER_OFFLOAD_IGNORED, options.stage)
    elif device != "cpu":
        logger.warning(SUPER_OFFLOAD_ELSEWHERE, device)
    else:
        logger.info(SUPER_OFFLOAD)


def attach(pipeline: "Pipeline", buf: FlatBuffer) -> None:
    """Give a new buffer whose state is (partly) in the tier its state and its host copies (none where the device
    is host memory), the parameters' taken from the device once, and put the state where it lives between steps
    (``placement``: the disk tier's straight into its files, never whole in host memory; a disk without room
    raises on every rank)."""
    tier = pipeline.tier
    if tier.kind != "disk":
        pipeline.allocate_state(buf)
    shard = tier.attach(id(buf), placement.tier_numel(buf), buf.dtype, pipeline.accumulate_dtype_of(buf), buf.device)
    for bucket in buf.layout.buckets[buf.tier_from :] if shard.params is not None else ():
        tier.init(placement.part(buf, shard.params, bucket), pipeline.param_shard(buf, bucket), (id(buf), bucket.index))
    if tier.kind != "disk":
        if placement.splits(tier, buf):
            placement.split(tier, buf)
        return
    buf.groups = sub_groups(buf, pipeline.options.sub_group_size)
    problem = None
    try:
        placement.start_split(pipeline, buf, [g[3] for g in buf.groups])
    except OSError as err:
        problem = str(err)
    try:
        agree(pipeline.engine, problem, "offload.reserve")
    except OSError:
        # only this buffer's files go: the state of the buffers before it (``add_param_group``) stays in theirs; a
        # constructor that fails closes the whole tier (``Pipeline.close``); the parameters keep their values
        tier.discard(id(buf))
        raise


def agree(
    engine: Any, problem: Optional[str], name: str, key: str = "offload_optimizer", what: str = "could not start"
) -> None:
    """Raise ``OSError`` on every rank when ``problem`` is set on any (``key``: the block that failed; ``what``: how,
    in words); host data, exchanged over the control group of ``engine``'s ranks (on NCCL a gloo group: no device
    needed)."""
    if engine.world_size == 1:
        problems = [problem]
    else:
        problems = all_gather_objects(ControlLink(engine).get(), problem, name=name)
    failed = [(r, p) for r, p in enumerate(problems) if p is not None]
    if failed:
        text = "; ".join(f"{ranks_text([r], engine.global_ranks)}: {p}" for r, p in failed)
        raise OSError(f"zero_optimization.{key} {what}: {text}")


def sub_groups(buf: FlatBuffer, size: int) -> list[tuple[int, int, int, int]]:
    """The disk tier's sub-groups of ``buf``: runs of whole buckets in the tier of at most ``size`` elements of
    this rank's shard (a bucket larger than ``size`` is a sub-group of its own), as (first bucket, end bucket,
    shard offset, elements)."""
    groups: list[tuple[int, int, int, int]] = []
    for bucket in buf.layout.buckets[buf.tier_from :]:
        if groups and groups[-1][3] + bucket.shard_numel <= size:
            first, _, offset, numel = groups[-1]
            groups[-1] = (first, bucket.index + 1, offset, numel + bucket.shard_numel)
        else:
            groups.append((bucket.index, bucket.index + 1, bucket.shard_offset, bucket.shard_numel))
    return groups


def update_bucket(
    pipeline: "Pipeline", buf: FlatBuffer, bucket: Bucket, h: GroupHyper, decision: Decision, with_grad: set[int]
) -> None:
    """One bucket's update: on the device as without offload where its state is there (``placement``), else
    through the tier (see the module docstring); same arguments as ``update.update_bucket``."""
    tier = pipeline.tier
    if bucket.index == 0 and placement.splits(tier, buf) and placement.resident(buf):
        placement.split(tier, buf)  # read in for the state door since the last step: back where it lives
    if not placement.in_tier(buf, bucket):
        update.update_bucket(pipeline, buf, bucket, h, decision, with_grad)
        return
    in_file = pipeline.params_in_file(buf)  # stage 3's offload_param on nvme: the bucket's shard read from its file
    if not in_file and not pipeline.grads_in_file(buf) and skipped_on_host(decision):
        return  # the update would change nothing: no copies, no state read or written
    # a shard read in whole (a state read or load, a value given) may hold what a step must adopt (an edit, or weights
    # newer than a master loaded) until a step writes it whole from the master: only one that did holds nothing to adopt
    whole = in_file and overwritten(pipeline, buf, bucket, decision, with_grad)
    fresh = whole and pipeline.params_from_master_in_file(buf, bucket)
    if in_file:
        params, device_params = pipeline.step_params(buf, bucket, read=not fresh), None
    else:
        device_params, params = _params(pipeline, buf, bucket)
    separate = device_params is not None and device_params.data_ptr() != params.data_ptr()
    spec = pipeline.speculation
    if spec is None or not spec.take(buf, bucket, params):  # (kept: its update ran during backward, ``speculation``)
        _update_host(pipeline, buf, bucket, h, decision, with_grad, params, adopt=not fresh)
    # the parameters go before the state is stored: a store that fails keeps the new state to write again, and the
    # parameters made with it must not be dropped (fp32 parameters in a file are their own master)
    if separate:
        tier.up(device_params, params, (id(buf), bucket.index))
    if in_file:
        pipeline.stepped_params(buf, bucket, params, whole)
    if tier.kind == "disk" and _group_of(buf, bucket)[1] == bucket.index + 1:
        tier.store(id(buf), buf.groups.index(_group_of(buf, bucket)))


def _update_host(
    pipeline: "Pipeline",
    buf: FlatBuffer,
    bucket: Bucket,
    h: GroupHyper,
    decision: Decision,
    with_grad: set[int],
    params: torch.Tensor,
    adopt: bool,
) -> None:
    """The host Adam of ``bucket`` on the tier's state, its reduced gradients and ``params`` (host memory, written);
    ``adopt``: whether ``params`` may hold an edit to adopt (``launch``)."""
    tier = pipeline.tier
    grads_in_file = pipeline.grads_in_file(buf)  # stage 3 with the state on disk: read from the file (ahead)
    grads = pipeline.step_grads(buf, bucket) if grads_in_file else _grads(pipeline, buf, bucket)
    state = _state(tier, buf, bucket) if tier.kind == "host" else _swapped(tier, buf, bucket)
    low = buf.master is not None
    tensors = BucketTensors(
        state["master"] if low else params,
        grads,
        state["exp_avg"],
        state["exp_avg_sq"],
        params if low else None,
        state.get("max_exp_avg_sq") if h.amsgrad else None,
    )
    impl = host_impl(pipeline.impl)
    with tier.compute():
        launch(pipeline, buf, bucket, h, decision, with_grad, tensors, impl=impl, adopt=adopt)
    if grads_in_file:
        pipeline.stepped_grads(buf, bucket)


def bucket_inputs(
    pipeline: "Pipeline", buf: FlatBuffer, bucket: Bucket
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """What the host Adam of ``bucket`` reads, for a buffer whose state is in host memory and whose shards are not in
    files (``speculation``): the parameters it writes, the reduced gradients and the state, in host memory."""
    _, params = _params(pipeline, buf, bucket)
    return params, _grads(pipeline, buf, bucket), _state(pipeline.tier, buf, bucket)


def _params(pipeline: "Pipeline", buf: FlatBuffer, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
    """(the device's parameters of ``bucket``, the host copy the update writes): the same tensor where the device is
    host memory (``HostTier.shares``) or the shard lives in the host copy; an edit on the device since the tier last
    pushed the copy up is copied down (``HostTier.changed``), so the update adopts it as without offload."""
    tier = pipeline.tier
    shard = tier.shards[id(buf)]
    device_params = pipeline.param_shard(buf, bucket)
    params = device_params if shard.params is None else placement.part(buf, shard.params, bucket)
    separate = device_params.data_ptr() != params.data_ptr()
    if separate and tier.changed((id(buf), bucket.index), device_params, params):
        tier.down(params, device_params)
    return device_params, params


def _grads(pipeline: "Pipeline", buf: FlatBuffer, bucket: Bucket) -> torch.Tensor:
    """The reduced gradients of ``bucket`` in host memory (copied down where the device is not)."""
    tier = pipeline.tier
    shard = tier.shards[id(buf)]
    return tier.gradients(shard, pipeline.grad_shard(buf, bucket), bucket.shard_offset - placement.cut(buf))


def overwritten(pipeline: "Pipeline", buf: FlatBuffer, bucket: Bucket, decision: Decision, with_grad: set[int]) -> bool:
    """Whether this step writes every element of the low-precision parameters of this rank's shard of ``bucket``
    from the master (one launch over all of it, the step not skipped): the values there before are not needed. The
    skip flag, which may wait for the device, is read last."""
    if buf.master is None or not update.whole(pipeline, buf, bucket, with_grad):
        return False
    return decision.skip is None or not bool(decision.skip.item())


def skipped_on_host(decision: Decision) -> bool:
    """Whether the step is skipped (a non-finite gradient) and the flag says so without waiting for a device: it is
    in host memory (a flag on a GPU is left to the kernel, which then changes nothing)."""
    return decision.skip is not None and decision.skip.device.type == "cpu" and bool(decision.skip.item())


def host_impl(impl: Optional[str]) -> Optional[str]:
    """The kernel backend of the host update: the pipeline's, unless that is Triton (a GPU kernel; the host
    state is updated by the C++ CPU Adam, or the PyTorch reference without the extension)."""
    chosen = impl or settings().impl
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton on the CPU: the host may use it too
    return "auto" if chosen == "triton" and not interpreted else impl


def _state(tier: Any, buf: FlatBuffer, bucket: Bucket) -> dict[str, torch.Tensor]:
    """``{kind: this rank's shard of bucket}`` of the state ``buf`` has in host memory: the resident tensors of a
    buffer wholly in the tier, else the part the tier keeps."""
    if placement.resident(buf):
        return {kind: buf.shard_slice(t, bucket) for kind, t in placement.tensors(buf).items()}
    return {kind: placement.part(buf, t, bucket) for kind, t in tier.shards[id(buf)].state.items()}


def _group_of(buf: FlatBuffer, bucket: Bucket) -> tuple[int, int, int, int]:
    return next(g for g in buf.groups if g[0] <= bucket.index < g[1])


def _swapped(tier: Any, buf: FlatBuffer, bucket: Bucket) -> dict[str, torch.Tensor]:
    """``{kind: this rank's shard of bucket}`` from the sub-group swapped in from the disk tier's files."""
    group = _group_of(buf, bucket)
    loaded = tier.load(id(buf), buf.groups.index(group), tuple(placement.tensors(buf)))
    return {kind: t.narrow(0, bucket.shard_offset - group[2], bucket.shard_numel) for kind, t in loaded.items()}


def finish_step(pipeline: "Pipeline") -> None:
    """After the last bucket: the disk tier's writes complete."""
    pipeline.tier.finish()
