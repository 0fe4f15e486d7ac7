"""Which ZeRO stage to use, and what it costs: memory per GPU, communication per step, a DeepSpeed config.

The practical pick depends on memory pressure and interconnect speed: every stage that fits is a
candidate, and among those the one with the shortest estimated step wins; stage 3 moves 1.5x the
bytes of stage 2 (3Ψ instead of 2Ψ), so on a slow link it can lose even when memory would allow it.
The memory and communication models live in :mod:`zero_kernels.planner.models`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

from .models import (
    PHASES,
    STAGES,
    CommEstimate,
    LinkPreset,
    MemoryEstimate,
    check_count,
    check_positive,
    dtype_bytes,
    estimate_comm,
    estimate_memory,
    get_link,
    reduced_grad_dtype,
    shard_elements,
)
from .offload import OffloadEstimate, OffloadSetup, device_memory, estimate_offload, offload_keys

# Step times within this fraction of the fastest count as equal (the model is not finer than that);
# among equals the lowest stage wins: it moves the fewest bytes and launches the fewest collectives.
_TIE = 0.02
# Buckets are sized so the latency term stays under this fraction of a collective's bandwidth term.
_LATENCY_SHARE = 0.05
# DeepSpeed's default reduce_bucket_size / allgather_bucket_size, in elements.
_MAX_BUCKET = 500_000_000


@dataclass(frozen=True)
class StagePlan:
    """One stage's row of the plan.

    Attributes:
        stage: ZeRO stage.
        memory: model-state bytes per GPU.
        activation_bytes: activation memory per GPU added to ``memory.total``.
        fits: whether ``memory.total + activation_bytes`` is within the GPU memory.
        comm: communication per step.
        exposed_comm_s: communication (and offload traffic) seconds not hidden behind forward or backward
            compute, and the offloaded update after backward.
        step_s: compute seconds plus ``exposed_comm_s``.
        offload: with offload, what the host and the disk hold and move (``memory`` is then what stays on
            the device, and ``fits`` needs the host memory and the disk to fit too); else None.
    """

    stage: int
    memory: MemoryEstimate
    activation_bytes: int
    fits: bool
    comm: CommEstimate
    exposed_comm_s: float
    step_s: float
    offload: Optional[OffloadEstimate] = None

    @property
    def gpu_bytes(self) -> int:
        """Model states, stage-3 working set and activations: bytes needed on each GPU."""
        return self.memory.total + self.activation_bytes


@dataclass(frozen=True)
class Recommendation:
    """The stage to use, why, and a DeepSpeed config for it.

    Attributes:
        stage: the recommended ZeRO stage.
        reasons: human-readable lines explaining the choice.
        deepspeed: a DeepSpeed JSON config (as a dict) selecting that stage.
        plans: every stage's :class:`StagePlan`, in stage order.
    """

    stage: int
    reasons: tuple[str, ...]
    deepspeed: dict[str, Any]
    plans: tuple[StagePlan, ...]


class NoFitError(ValueError):
    """The model fits at no stage; ``plans`` holds every stage's row for display."""

    def __init__(self, message: str, plans: tuple[StagePlan, ...]) -> None:
        super().__init__(message)
        self.plans = plans


def format_bytes(num_bytes: float) -> str:
    """A byte count in decimal units with three significant digits, e.g. ``31.4 GB``.

    Args:
        num_bytes: the count.
    """
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.3g} {unit}"
    return f"{num_bytes:.0f} B"


def _count_module(model: Any) -> tuple[int, int]:
    """Parameters of a module, and the most that one submodule owns directly (a stage-3 gathered unit)."""
    total = sum(p.numel() for p in model.parameters())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total, largest


def _resolve_link(link: str | LinkPreset, link_gbps: float | None, latency_us: float | None) -> LinkPreset:
    """The preset named ``link`` (or given), with bandwidth and latency overridden when passed."""
    preset = link if isinstance(link, LinkPreset) else get_link(link)
    gbps = preset.gbytes_per_s if link_gbps is None else link_gbps
    lat = preset.latency_us if latency_us is None else latency_us
    return LinkPreset(preset.name, gbps, lat, preset.description)


def _compute_seconds(
    num_params: int, gpus: int, tokens_per_step: int | None, achieved_tflops: float | None, compute_s: float | None
) -> float | None:
    """Seconds of compute per step per GPU: ``compute_s``, or 6·Ψ·tokens FLOPs at ``achieved_tflops``.

    6·Ψ FLOPs per token (2Ψ forward, 4Ψ backward) is the usual transformer training estimate
    (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1: C ≈ 6N per token).
    """
    if compute_s is not None:
        check_positive("compute_s", compute_s)
        return float(compute_s)
    if tokens_per_step is None and achieved_tflops is None:
        return None
    if tokens_per_step is None or achieved_tflops is None:
        raise ValueError(
            f"tokens_per_step={tokens_per_step!r}, achieved_tflops={achieved_tflops!r}: give both, or compute_s"
        )
    check_count("tokens_per_step", tokens_per_step)
    check_positive("achieved_tflops", achieved_tflops)
    return 6.0 * num_params * tokens_per_step / (gpus * achieved_tflops * 1e12)


def _exposed(comm: CommEstimate, compute_s: float, offload: Optional[OffloadEstimate] = None) -> float:
    """Communication left over after hiding each phase's collectives behind that phase's compute, micro-step by
    micro-step: what every micro-step runs (``comm.micro_phase_s``) behind each micro-step's forward and backward,
    what runs once per optimizer step (the rest of ``comm.phase_s``) behind the last one's. With offload, each
    phase's offload traffic runs beside the last micro-step's collectives (other links), and the offloaded update
    comes after backward."""
    k = comm.micro_steps
    forward, backward = compute_s / (3.0 * k), 2.0 * compute_s / (3.0 * k)
    extra = offload.phase_s if offload is not None else dict.fromkeys(PHASES, 0.0)
    every = comm.micro_phase_s
    last = {phase: comm.phase_s[phase] - (k - 1) * every[phase] for phase in PHASES}
    repeated = max(0.0, every["forward"] - forward) + max(0.0, every["backward"] - backward)
    return (
        (k - 1) * repeated
        + max(0.0, max(last["forward"], extra["forward"]) - forward)
        + max(0.0, max(last["backward"], extra["backward"]) - backward)
        + last["after"]
        + extra["after"]
    )


def default_bucket_elements(link: LinkPreset, gpus: int, elem_bytes: int) -> int:
    """Smallest bucket (elements, rounded up to a million) whose latency is <= 5% of its transfer time.

    A ring reduce-scatter of ``b`` elements costs ``(N-1)/N·b·bytes/BW`` of bandwidth and ``(N-1)·lat``
    of latency, so the share stays under 5% when ``b >= 20·lat·N·BW/bytes``. Capped at DeepSpeed's
    default of 5e8.

    Args:
        link: the ring's link.
        gpus: ranks on the ring.
        elem_bytes: bytes per element on the wire.
    """
    need = link.latency_us * 1e-6 * gpus * link.gbytes_per_s * 1e9 / (_LATENCY_SHARE * elem_bytes)
    return int(min(_MAX_BUCKET, max(1, math.ceil(need / 1e6)) * 1_000_000))


def deepspeed_config(
    stage: int,
    *,
    param_dtype: str,
    bucket_elements: int,
    lr: float = 1e-3,
    weight_decay: float = 1e-2,
    offload: Optional[OffloadSetup] = None,
    sub_group_size: Optional[int] = None,
    largest_layer_params: Optional[int] = None,
    communication_data_type: Optional[str] = None,
    grad_accum_dtype: Optional[str] = None,
    gradient_accumulation_steps: int = 1,
    train_micro_batch_size_per_gpu: int = 1,
) -> dict[str, Any]:
    """A DeepSpeed config dict for ``stage``: batch sizes, precision, AdamW, bucket sizes, offload.

    Args:
        stage: ZeRO stage, 0 to 3.
        param_dtype: ``bf16`` or ``fp16`` enable that mixed-precision section; ``fp32`` enables neither.
        bucket_elements: ``reduce_bucket_size`` (and the all-gather / prefetch bucket) in elements.
        lr: AdamW learning rate (ShardedFusedAdam's default).
        weight_decay: AdamW weight decay (ShardedFusedAdam's default).
        offload: with an active offload, its ``offload_optimizer`` / ``offload_param`` and
            ``sub_group_size`` keys, and the top-level ``aio`` block when a disk is used.
        sub_group_size: elements per swapped sub-group (with ``offload``).
        largest_layer_params: the largest stage-3 unit (with ``offload_param`` to nvme: its buffer size).
        communication_data_type: written as the top-level key when given.
        grad_accum_dtype: written as ``data_types.grad_accum_dtype`` when given.
        gradient_accumulation_steps: the top-level key.
        train_micro_batch_size_per_gpu: the top-level key (DeepSpeed refuses a config with no batch size).
    """
    dtype_bytes("param_dtype", param_dtype)
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": stage != 1,  # what the stages do: stage 1 reduces at the step, the others during backward
        "contiguous_gradients": True,
        "reduce_bucket_size": bucket_elements,
    }
    if stage in (1, 2):
        zero["allgather_bucket_size"] = bucket_elements
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = bucket_elements
    top: dict[str, Any] = {}
    if offload is not None and offload.active:
        keys, top = offload_keys(
            offload, stage, sub_group_size=sub_group_size or 1, largest_layer_params=largest_layer_params
        )
        zero.update(keys)
    if communication_data_type is not None:
        top["communication_data_type"] = communication_data_type
    if grad_accum_dtype is not None:
        top["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    return {
        "train_micro_batch_size_per_gpu": train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        **top,
        "bf16": {"enabled": param_dtype == "bf16"},
        "fp16": {"enabled": param_dtype == "fp16"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": weight_decay},
        },
        "zero_optimization": zero,
    }


def plan_stages(
    num_params: int,
    *,
    gpus: int,
    gpu_memory: float,
    link: LinkPreset,
    activation_bytes: int = 0,
    param_dtype: str = "bf16",
    master_weights: bool = True,
    largest_layer_params: int | None = None,
    compute_s: float | None = None,
    bucket_elements: int = _MAX_BUCKET,
    offload: Optional[OffloadSetup] = None,
    communication_data_type: Optional[str] = None,
    grad_accum_dtype: Optional[str] = None,
    gradient_accumulation_steps: int = 1,
) -> tuple[StagePlan, ...]:
    """Every stage's memory, communication and step time, in stage order (stages 1-3 with offload).

    Args:
        num_params: Ψ.
        gpus: data-parallel GPUs.
        gpu_memory: bytes per GPU.
        link: the data-parallel ring's link (bandwidth and latency already resolved).
        activation_bytes: activation memory per GPU.
        param_dtype: parameter dtype (and the all-gathers' on the wire).
        master_weights: whether the optimizer keeps an fp32 master copy.
        largest_layer_params: the stage-3 gathered unit, or None.
        compute_s: compute seconds per optimizer step per GPU, or None (communication fully exposed).
        bucket_elements: collective bucket size in elements.
        offload: the offload to plan (:class:`OffloadSetup`); None or inactive plans without.
        communication_data_type: DeepSpeed's key: the dtype gradients are reduced in (None: ``param_dtype``).
        grad_accum_dtype: DeepSpeed's ``data_types.grad_accum_dtype`` (None: ``param_dtype``).
        gradient_accumulation_steps: micro-steps per optimizer step (``compute_s`` is split evenly over them).
    """
    active = offload is not None and offload.active
    plans = []
    for stage in STAGES[1:] if active else STAGES:
        memory = estimate_memory(
            num_params,
            gpus,
            stage,
            param_dtype=param_dtype,
            master_weights=master_weights,
            largest_layer_params=largest_layer_params,
            communication_data_type=communication_data_type,
            grad_accum_dtype=grad_accum_dtype,
            bucket_elements=bucket_elements,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )
        comm = estimate_comm(
            num_params,
            gpus,
            stage,
            link_gbps=link.gbytes_per_s,
            latency_us=link.latency_us,
            comm_dtype=communication_data_type,
            param_dtype=param_dtype,
            bucket_elements=bucket_elements,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )
        off = None
        if active:
            grads = reduced_grad_dtype(param_dtype, communication_data_type, grad_accum_dtype)
            off = estimate_offload(
                num_params,
                gpus,
                stage,
                offload,
                param_dtype=param_dtype,
                master_weights=master_weights,
                grad_dtype=grads,
            )
            memory = device_memory(memory, offload if stage == 3 else replace(offload, param="none"), stage=stage)
        exposed = _exposed(comm, compute_s or 0.0, off)
        fits = memory.total + activation_bytes <= gpu_memory and (off is None or off.fits)
        step = (compute_s or 0.0) + exposed
        plans.append(StagePlan(stage, memory, activation_bytes, fits, comm, exposed, step, off))
    return tuple(plans)


def _pick(plans: tuple[StagePlan, ...]) -> StagePlan:
    """The fitting stage with the shortest step; within ``_TIE`` of it, the lowest stage."""
    fitting = [p for p in plans if p.fits]
    best = min(p.step_s for p in fitting)
    return next(p for p in fitting if p.step_s <= best * (1.0 + _TIE))


def _min_gpus(per_param_bytes: int, num_params: int, room: float) -> int | None:
    """Fewest ranks N with ``ceil(Ψ/N)·per_param_bytes <= room``; None if no N is enough."""
    max_elems = math.floor(room / per_param_bytes) if room > 0 else 0
    return None if max_elems < 1 else -(-num_params // max_elems)


def _no_fit_message(num_params: int, gpus: int, gpu_memory: float, plans: tuple[StagePlan, ...], p3_bytes: int) -> str:
    """Why nothing fits, by how much, and what would make it fit: more GPUs, or optimizer offload."""
    s3 = plans[-1]
    short = s3.gpu_bytes - gpu_memory
    lines = [
        f"num_params={num_params} does not fit on gpus={gpus} with gpu_memory={format_bytes(gpu_memory)} at any "
        f"stage: even stage 3 needs {format_bytes(s3.gpu_bytes)} per GPU ({format_bytes(s3.memory.total)} model "
        f"states and working set + {format_bytes(s3.activation_bytes)} activations), "
        + (
            f"{format_bytes(short)} ({100 * short / gpu_memory:.1f}%) more than available."
            if short > 0
            else "which fits the GPU, but not the host or the disk."
        )
    ]
    if s3.offload is not None:
        return " ".join(lines + [_offload_shortfall(s3)])
    m = s3.memory
    room = gpu_memory - s3.activation_bytes - m.working_set - m.buffers  # what more ranks do not shrink (the idle
    # scratch buckets at most)
    per_param = (m.params + m.grads + m.optimizer) // shard_elements(num_params, gpus)
    need = _min_gpus(per_param, num_params, room)
    if need is None:
        lines.append(
            "More GPUs cannot help: activations and the largest gathered unit alone exceed the GPU memory; reduce "
            "activations (activation checkpointing, a smaller micro-batch) or the largest layer."
        )
        return " ".join(lines)
    lines.append(f"To fit at stage 3: use at least {need} GPUs.")
    offloaded = s3.gpu_bytes - s3.memory.optimizer
    need_off = _min_gpus(p3_bytes, num_params, room)
    verdict = "fits" if offloaded <= gpu_memory else f"still short by {format_bytes(offloaded - gpu_memory)}"
    lines.append(
        f"Offloading the optimizer state (zero_optimization.offload_optimizer, device cpu or nvme) would leave "
        f"{format_bytes(offloaded)} per GPU on {gpus} GPUs ({verdict}; {need_off} GPUs would suffice with it): "
        "plan it with --offload cpu (recommend(..., offload=OffloadSetup(...)))."
    )
    return " ".join(lines)


def _offload_shortfall(plan: StagePlan) -> str:
    """Which of the host memory and the disk the offload at ``plan``'s stage overflows, and by how much."""
    off = plan.offload
    parts = [f"With offload, stage 3 holds {format_bytes(off.host_bytes)} of host memory per rank"]
    parts.append(f"and {format_bytes(off.disk_bytes)} on disk per rank" if off.disk_bytes else "")
    verdicts = [] if off.host_fits else ["the host memory is too small"]
    verdicts += [] if off.disk_fits else ["the disk is too small"]
    tail = f" ({'; '.join(verdicts)})" if verdicts else ""
    return " ".join(p for p in parts if p) + tail + "."


def _reasons(choice: StagePlan, plans: tuple[StagePlan, ...], link: LinkPreset, compute_s: float | None) -> list[str]:
    """Lines explaining the choice: memory, communication against compute, and the alternatives."""
    c = choice.comm
    reasons = [
        f"stage {choice.stage} fits: {format_bytes(choice.gpu_bytes)} per GPU "
        f"({format_bytes(choice.memory.total)} model states + {format_bytes(choice.activation_bytes)} activations).",
        f"it sends {format_bytes(c.bytes_sent)} per GPU per optimizer step ({c.paper_volume}Ψ elements x (N-1)/N: "
        f"{format_bytes(c.grad_bytes)} of gradient reductions, {format_bytes(c.param_bytes)} of parameter "
        f"all-gathers), {c.time_s * 1e3:.1f} ms on {link.name} at {link.gbytes_per_s:g} GB/s per direction "
        f"({c.latency_s * 1e3:.2f} ms of it latency over {c.collectives} collective launches).",
    ]
    if c.micro_steps > 1 and c.micro_time_s > 0:
        reasons.append(
            f"of that, {c.micro_time_s * 1e3:.1f} ms runs at each of the {c.micro_steps} micro-steps, "
            f"{(c.time_s - c.micro_steps * c.micro_time_s) * 1e3:.1f} ms once per optimizer step."
        )
    elif c.micro_steps > 1:
        reasons.append(f"all of it after the last of the {c.micro_steps} micro-steps: nothing is sent before.")
    if compute_s is None:
        reasons.append("no compute estimate given: communication counted as fully exposed.")
    else:
        reasons.append(
            f"compute {compute_s * 1e3:.1f} ms per optimizer step; {choice.exposed_comm_s * 1e3:.1f} ms of "
            f"communication not hidden behind it; estimated step {choice.step_s * 1e3:.1f} ms."
        )
    if choice.offload is not None:
        reasons += _offload_reasons(choice)
    too_big = [str(p.stage) for p in plans if not p.fits]
    if too_big:
        where = "GPU memory" if choice.offload is None else "GPU memory, host memory or disk"
        reasons.append(f"stage(s) {', '.join(too_big)} do not fit in {where}.")
    for other in plans:
        if other.fits and other.stage > choice.stage:
            reasons.append(
                f"stage {other.stage} also fits but its step is estimated at {other.step_s * 1e3:.1f} ms "
                f"({other.comm.paper_volume}Ψ moved, {other.exposed_comm_s * 1e3:.1f} ms exposed)."
            )
    if choice.stage == 3 and choice.memory.working_set == 0:
        reasons.append("stage-3 working set not counted: pass largest_layer_params (or a module).")
    return reasons


def _offload_reasons(choice: StagePlan) -> list[str]:
    """What the offload at the chosen stage holds and moves, and what its update costs after backward."""
    off = choice.offload
    lines = [
        f"offload: {format_bytes(off.host_bytes)} of host memory and {format_bytes(off.disk_bytes)} on disk per "
        f"rank; per step {format_bytes(off.bus_down)} down and {format_bytes(off.bus_up)} up the host link, "
        f"{format_bytes(off.disk_read)} read and {format_bytes(off.disk_write)} written on disk.",
        f"offload: CPU Adam {off.adam_s * 1e3:.1f} ms per step; {off.phase_s['after'] * 1e3:.1f} ms of update "
        f"and uploads after backward, {off.phase_s['backward'] * 1e3:.1f} ms of host traffic beside backward.",
    ]
    return lines


def _plain_line(plain: tuple[StagePlan, ...]) -> str:
    """How the best stage without offload compares (one reason line)."""
    fitting = [p for p in plain if p.fits]
    if not fitting:
        return "without offload no stage fits in GPU memory."
    best = _pick(plain)
    return f"without offload stage {best.stage} fits too, with a step estimated at {best.step_s * 1e3:.1f} ms."


def recommend(
    model: Any,
    *,
    gpus: int,
    gpu_memory: float,
    link: str | LinkPreset,
    activation_bytes: int = 0,
    param_dtype: str = "bf16",
    master_weights: bool | None = None,
    largest_layer_params: int | None = None,
    tokens_per_step: int | None = None,
    achieved_tflops: float | None = None,
    compute_s: float | None = None,
    link_gbps: float | None = None,
    latency_us: float | None = None,
    bucket_elements: int | None = None,
    offload: Optional[OffloadSetup] = None,
    communication_data_type: str | None = None,
    grad_accum_dtype: str | None = None,
    gradient_accumulation_steps: int | None = None,
    train_micro_batch_size_per_gpu: int = 1,
) -> Recommendation:
    """The ZeRO stage to train ``model`` with on ``gpus`` data-parallel GPUs, why, and its DeepSpeed config.

    A stage fits when its model states (:func:`estimate_memory`) plus ``activation_bytes`` are within
    ``gpu_memory``. Among fitting stages the shortest estimated step wins; a step is compute plus the
    communication (:func:`estimate_comm`) that its phase cannot hide: the stage-0 all-reduce and the
    stage-2 reduce-scatter run during backward, the stage-3 all-gathers during forward and backward,
    and the stage-1/2 all-gather of updated parameters (and the stage-1 reduce-scatter) after it.
    Forward is 1/3 and backward 2/3 of the compute. Steps within 2% count as equal, and the lowest stage
    of those wins.

    Args:
        model: the parameter count Ψ, or a ``torch.nn.Module`` whose parameters are counted (its
            largest submodule's own parameters become ``largest_layer_params``).
        gpus: data-parallel GPUs N.
        gpu_memory: bytes of memory per GPU.
        link: a preset name from :data:`LINKS` (``nvlink``, ``pcie4``, ``pcie5``, ``ib-200``, ``ib-400``,
            ``ethernet-100``) or a :class:`LinkPreset`: the slowest link on the data-parallel ring.
        activation_bytes: activation memory per GPU, estimated or measured (``torch.cuda.max_memory_allocated``
            minus model states); 0 when unknown.
        param_dtype: ``bf16`` / ``fp16`` (mixed precision, fp32 master copy) or ``fp32``.
        master_weights: keep an fp32 master copy; default: yes unless ``param_dtype`` is ``fp32``.
        largest_layer_params: parameters of the largest unit stage 3 gathers at once.
        tokens_per_step: tokens per optimizer step over all GPUs; with ``achieved_tflops`` gives compute.
        achieved_tflops: sustained TFLOP/s per GPU.
        compute_s: compute seconds per step per GPU, instead of tokens and TFLOP/s.
        link_gbps: override of the preset's per-direction bandwidth, GB/s.
        latency_us: override of the preset's per-ring-step latency, microseconds.
        bucket_elements: collective bucket size in elements; default: the smallest bucket whose latency
            is under 5% of its transfer time (see :func:`default_bucket_elements`).
        offload: plan with the optimizer state (and stage 3's parameters) in host memory or on disk
            (:class:`~zero_kernels.planner.offload.OffloadSetup`): stages 1-3 are planned, a stage fits
            when the device, the host memory and the disk all hold their part, and the step adds the
            host link, disk and CPU Adam times the compute cannot hide; the config gets the offload keys.
        communication_data_type: DeepSpeed's key (``fp32``, ``bf16``, ``fp16``; None: ``param_dtype``): the
            dtype gradients are reduced in; a wider one widens the gradient shard of stages 2 and 3 and the
            offloaded gradients (:func:`~zero_kernels.planner.models.reduced_grad_dtype`). The config gets it.
        grad_accum_dtype: DeepSpeed's ``data_types.grad_accum_dtype`` (same values): a wider one widens the
            gradient shard of stages 2 and 3 and makes stage 2 reduce at every micro-step, as stage 3 does (stages 0
            and 1 add the micro-steps up in it locally). The config gets it.
        gradient_accumulation_steps: DeepSpeed's key, micro-steps per optimizer step (None: 1):
            ``tokens_per_step`` and ``compute_s`` stay per optimizer step; stage 3 gathers at every micro-step,
            and reduces at every one, as stage 2 does with a wider ``grad_accum_dtype``. The config gets it.
        train_micro_batch_size_per_gpu: DeepSpeed's key, samples per micro-step per GPU; the config gets it (the
            plan does not use it: ``activation_bytes`` and ``tokens_per_step`` are the workload's size).

    Returns:
        A :class:`Recommendation`.

    Raises:
        NoFitError: (a ValueError) when no stage fits; it says by how much, how many GPUs would do, and
            what optimizer offload would leave (and, with ``offload``, whether the host or the disk is short).
    """
    if isinstance(model, int) and not isinstance(model, bool):
        num_params = model
    elif hasattr(model, "parameters") and hasattr(model, "modules"):
        num_params, counted_largest = _count_module(model)
        largest_layer_params = counted_largest if largest_layer_params is None else largest_layer_params
    else:
        raise ValueError(f"model={model!r}: expected a parameter count (int >= 1) or a torch.nn.Module")
    check_count("num_params", num_params)
    check_count("gpus", gpus)
    check_positive("gpu_memory", gpu_memory)
    micro_steps = 1 if gradient_accumulation_steps is None else gradient_accumulation_steps
    check_count("gradient_accumulation_steps", micro_steps)
    check_count("train_micro_batch_size_per_gpu", train_micro_batch_size_per_gpu)
    if isinstance(activation_bytes, bool) or not isinstance(activation_bytes, int) or activation_bytes < 0:
        raise ValueError(f"activation_bytes={activation_bytes!r}: must be an integer >= 0")
    elem = dtype_bytes("param_dtype", param_dtype)
    master = param_dtype != "fp32" if master_weights is None else master_weights
    resolved = _resolve_link(link, link_gbps, latency_us)
    step_compute = _compute_seconds(num_params, gpus, tokens_per_step, achieved_tflops, compute_s)
    bucket = default_bucket_elements(resolved, gpus, elem) if bucket_elements is None else bucket_elements
    kwargs: dict[str, Any] = dict(
        gpus=gpus,
        gpu_memory=gpu_memory,
        link=resolved,
        activation_bytes=activation_bytes,
        param_dtype=param_dtype,
        master_weights=master,
        largest_layer_params=largest_layer_params,
        compute_s=step_compute,
        bucket_elements=bucket,
        communication_data_type=communication_data_type,
        grad_accum_dtype=grad_accum_dtype,
        gradient_accumulation_steps=micro_steps,
    )
    plans = plan_stages(num_params, **kwargs, offload=offload)
    if not any(p.fits for p in plans):
        shard_grads = dtype_bytes(
            "grad_dtype", reduced_grad_dtype(param_dtype, communication_data_type, grad_accum_dtype)
        )
        raise NoFitError(_no_fit_message(num_params, gpus, gpu_memory, plans, elem + shard_grads), plans)
    choice = _pick(plans)
    reasons = _reasons(choice, plans, resolved, step_compute)
    if choice.offload is not None:
        reasons.append(_plain_line(plan_stages(num_params, **kwargs)))
    config = deepspeed_config(
        choice.stage,
        param_dtype=param_dtype,
        bucket_elements=bucket,
        offload=offload,
        sub_group_size=choice.offload.sub_group_size if choice.offload else None,
        largest_layer_params=largest_layer_params,
        communication_data_type=communication_data_type,
        grad_accum_dtype=grad_accum_dtype,
        gradient_accumulation_steps=micro_steps,
        train_micro_batch_size_per_gpu=train_micro_batch_size_per_gpu,
    )
    return Recommendation(choice.stage, tuple(reasons), config, plans)
