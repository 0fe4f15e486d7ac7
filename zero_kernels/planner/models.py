"""Memory and communication models of ZeRO data parallelism, one GPU's view per training step.

Memory follows the model-state accounting of the ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", section 5 and Figure 1): with Ψ parameters,
mixed-precision Adam keeps 2Ψ bytes of bf16/fp16 parameters, 2Ψ bytes of gradients and KΨ bytes of
optimizer state (K = 12: fp32 master copy, Adam m and v). Stage 1 shards the optimizer state, stage 2
also the gradients, stage 3 also the parameters, each over the N data-parallel ranks.

Communication follows section 7 of the same paper: the data-parallel all-reduce of gradients is a
reduce-scatter followed by an all-gather, a volume of 2Ψ elements per rank; stages 1 and 2 keep that
volume (reduce-scatter of gradients, all-gather of updated parameters); stage 3 all-gathers the
parameters twice (forward and backward) and reduce-scatters the gradients once, 3Ψ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

STAGES = (0, 1, 2, 3)

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# Adam's two moments are always fp32 (4 + 4 bytes); the fp32 master copy adds 4 more.
_ADAM_MOMENT_BYTES = 8
_MASTER_BYTES = 4

# Which model states a stage shards over the ranks: (params, grads, optimizer).
_SHARDED = {
    0: (False, False, False),
    1: (False, False, True),
    2: (False, True, True),
    3: (True, True, True),
}

# The ring collectives each stage issues, in the order they run: what they carry (``grads`` cross the wire in the
# communication dtype, ``params`` in the parameters' dtype), the compute phase they can hide behind ("forward",
# "backward", or "after": between backward and the next forward, exposed), and how often they run: "micro" at every
# accumulation micro-step, "step" once per optimizer step (gradient reductions: at the last micro-step, or at every
# one where :func:`reduces_micro_steps`).
COLLECTIVES = {
    0: (("all_reduce", "grads", "backward", "step"),),
    1: (("reduce_scatter", "grads", "after", "step"), ("all_gather", "params", "after", "step")),
    2: (("reduce_scatter", "grads", "backward", "step"), ("all_gather", "params", "after", "step")),
    3: (
        ("all_gather", "params", "forward", "micro"),
        ("all_gather", "params", "backward", "micro"),
        ("reduce_scatter", "grads", "backward", "step"),
    ),
}

# Per collective on a ring of N ranks: each rank sends this many times (N - 1)/N of the buffer, in this
# many times N - 1 ring steps.
_RING_VOLUME = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}


@dataclass(frozen=True)
class LinkPreset:
    """A data-parallel link: the bandwidth one GPU has for its ring, and the per-hop latency.

    Attributes:
        name: preset name accepted by ``recommend`` and the ``plan`` command.
        gbytes_per_s: bandwidth per GPU and per direction, in GB/s (10^9 bytes per second).
        latency_us: latency of one ring step, in microseconds.
        description: where the figures come from.
    """

    name: str
    gbytes_per_s: float
    latency_us: float
    description: str


def _links() -> dict[str, LinkPreset]:
    """Preset links. Bandwidths are per GPU and per direction, in GB/s (10^9 B/s).

    Sources:
        - ``nvlink``: NVLink 4 on H100/H200 SXM, 900 GB/s per GPU counting both directions (NVIDIA H100
          and H200 datasheets, "NVLink: 900GB/s"), so 450 GB/s each way.
        - ``pcie4``: PCIe 4.0 x16, 64 GB/s both directions (NVIDIA A100 PCIe datasheet, "PCIe Gen4:
          64GB/s"), 32 GB/s each way.
        - ``pcie5``: PCIe 5.0 x16, 128 GB/s both directions (NVIDIA H100 datasheet, "PCIe Gen5:
          128GB/s"), 64 GB/s each way.
        - ``ib-200``: InfiniBand HDR, 200 Gb/s per port and direction (NVIDIA ConnectX-6), 25 GB/s.
        - ``ib-400``: InfiniBand NDR, 400 Gb/s per port and direction (NVIDIA ConnectX-7 user manual,
          "NDR 400Gb/s"), 50 GB/s; one port per GPU as in DGX H100.
        - ``ethernet-100``: 100 Gb/s Ethernet (IEEE 802.3 100GBASE), 12.5 GB/s.

        Per-step latencies are NCCL's own ring model for its Simple protocol (NVIDIA/nccl,
        ``src/graph/tuning.cc``, table ``hwLat``, Ring/Simple column): 3.4 us over NVLink, 5.7 us over
        PCIe, 9.6 us over the network.
    """
    presets = (
        LinkPreset("nvlink", 450.0, 3.4, "NVLink 4 (H100/H200 SXM): 900 GB/s bidirectional"),
        LinkPreset("pcie4", 32.0, 5.7, "PCIe 4.0 x16: 64 GB/s bidirectional"),
        LinkPreset("pcie5", 64.0, 5.7, "PCIe 5.0 x16: 128 GB/s bidirectional"),
        LinkPreset("ib-200", 25.0, 9.6, "InfiniBand HDR 200 Gb/s per GPU"),
        LinkPreset("ib-400", 50.0, 9.6, "InfiniBand NDR 400 Gb/s per GPU"),
        LinkPreset("ethernet-100", 12.5, 9.6, "100 Gb/s Ethernet per GPU"),
    )
    return {p.name: p for p in presets}


LINKS = _links()


def get_link(name: str) -> LinkPreset:
    """The preset called ``name``; a ValueError lists the valid ones.

    Args:
        name: one of the keys of ``LINKS``.
    """
    if name not in LINKS:
        raise ValueError(f"link={name!r} is not a known preset; valid presets: {', '.join(LINKS)}")
    return LINKS[name]


def check_positive(name: str, value: float) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is a finite number > 0.

    Args:
        name: the argument's name, for the message.
        value: the value to check.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be a finite number > 0")


def check_count(name: str, value: int) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is an integer >= 1.

    Args:
        name: the argument's name, for the message.
        value: the value to check.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: must be an integer >= 1")


def check_stage(stage: int) -> None:
    """Raise a ValueError unless ``stage`` is one of ``STAGES``.

    Args:
        stage: the ZeRO stage to check.
    """
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage={stage!r}: allowed stages are {', '.join(map(str, STAGES))}")


def dtype_bytes(name: str, value: str) -> int:
    """Bytes per element of a dtype.

    Args:
        name: the argument's name, for the message.
        value: ``fp32``, ``bf16`` or ``fp16``.
    """
    if value not in DTYPE_BYTES:
        raise ValueError(f"{name}={value!r}: allowed dtypes are {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[value]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one GPU holds for model states at one stage.

    Attributes:
        params: parameters in their storage dtype (the whole model, or this rank's shard at stage 3).
        grads: gradients (whole, or this rank's shard at stages 2 and 3).
        optimizer: Adam m and v, plus the fp32 master copy when there is one (this rank's shard at 1-3).
        working_set: stage 3 only: the largest gathered unit's full parameters and gradients.
        total: the sum of the six.
        secondary: stage 3 with ZeRO++ only: hpZ's secondary partition at its peak (every unit gathered once
            since the step: 1/H of the model) and qwZ's int8 copy of this rank's shard.
        buffers: what ``memory_report()["buffers"]`` shows on several ranks: at stage 1 the reduced gradient shard
            the step reduce-scatters into and the scratch buckets it keeps for the next step
            (:func:`stage1_buffers`), at stages 2 and 3 the idle scratch buckets backward keeps for the next one
            (:func:`idle_scratch`). Beyond the ZeRO paper's model states.
    """

    params: int
    grads: int
    optimizer: int
    working_set: int
    total: int
    secondary: int = 0
    buffers: int = 0

    @property
    def model_states(self) -> int:
        """``total`` without ``buffers``: what the ZeRO paper counts (with the stage-3 working set and ZeRO++)."""
        return self.total - self.buffers


def shard_elements(num_params: int, world_size: int) -> int:
    """Elements in one rank's shard: the flat buffer padded to a multiple of ``world_size``, divided.

    Args:
        num_params: elements of the flat buffer before padding.
        world_size: ranks sharing it.
    """
    return -(-num_params // world_size)


def estimate_memory(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    param_dtype: str = "bf16",
    grad_dtype: str | None = None,
    master_weights: bool = True,
    largest_layer_params: int | None = None,
    hpz_partition_size: int = 1,
    quantized_weights: bool = False,
    frozen_params: int = 0,
    quantized_nontrainable_weights: bool = False,
    communication_data_type: str | None = None,
    grad_accum_dtype: str | None = None,
    bucket_elements: int = 500_000_000,
    gradient_accumulation_steps: int = 1,
) -> MemoryEstimate:
    """Model-state bytes per GPU for ``num_params`` parameters trained with Adam at ``stage``.

    With bf16 params and grads and an fp32 master copy this is the ZeRO paper's (2 + 2 + K)Ψ with K = 12:
    stage 0 ``16Ψ``, stage 1 ``4Ψ + 12Ψ/N``, stage 2 ``2Ψ + 14Ψ/N``, stage 3 ``16Ψ/N``. With fp32 params
    and ``master_weights=False`` (what ShardedFusedAdam holds for an fp32 model): params 4Ψ, grads 4Ψ,
    Adam m and v 8Ψ, sharded the same way. A sharded state takes ``ceil(Ψ/N)`` elements per rank. At stages 2
    and 3 the gradients are the reduced shard, kept in :func:`reduced_grad_dtype` (4 bytes per element with
    ``communication_data_type`` or ``grad_accum_dtype`` ``fp32`` in bf16/fp16 training); at stages 0 and 1 the
    local gradients are added up in the wider ``grad_accum_dtype`` too.

    Args:
        num_params: Ψ, the number of parameters (>= 1).
        world_size: N, the number of data-parallel ranks (>= 1).
        stage: ZeRO stage, 0 to 3.
        param_dtype: storage dtype of the parameters: ``fp32``, ``bf16`` or ``fp16``.
        grad_dtype: dtype of the gradients; defaults to ``param_dtype``.
        master_weights: whether the optimizer keeps an fp32 master copy (4 bytes per parameter).
        largest_layer_params: parameters of the largest unit stage 3 gathers at once (one module's own
            parameters); its full parameters and gradients are the stage-3 working set. None counts 0.
        hpz_partition_size: ZeRO++'s ``zero_hpz_partition_size`` H (stage 3; 0 and 1: off): each rank keeps
            ``ceil(Ψ/H)`` parameters of the secondary partition, in ``param_dtype`` or, with
            ``quantized_weights``, as int8 with a float32 scale per block.
        quantized_weights: ZeRO++'s ``zero_quantized_weights`` (stage 3 keeps its shard's int8 copy for the step).
        frozen_params: parameters that are frozen (``requires_grad=False``), besides the ``num_params`` trained:
            no gradient nor optimizer state; counted in ``params``, whole on every rank at stages 0-2 and
            partitioned at stage 3 (each rank keeps ``ceil(frozen_params/N)`` of them in ``param_dtype``).
        quantized_nontrainable_weights: ZeRO++'s ``zero_quantized_nontrainable_weights`` (stage 3): the frozen
            parameters' partition is kept in int8 with a float32 scale per block.
        communication_data_type: DeepSpeed's key: the dtype gradients are reduced in (None: their own).
        grad_accum_dtype: DeepSpeed's ``data_types.grad_accum_dtype`` (None: the gradients' own).
        bucket_elements: elements per bucket (``reduce_bucket_size``): stage 1's scratch buckets.
        gradient_accumulation_steps: micro-steps per optimizer step: the estimate is the same for every value (stages
            0-1 add micro-steps up in the full local gradient, stages 2-3 reduce each into the shard,
            :func:`reduces_micro_steps`).

    Returns:
        A :class:`MemoryEstimate` in bytes.
    """
    check_count("num_params", num_params)
    check_count("world_size", world_size)
    check_stage(stage)
    p_bytes = dtype_bytes("param_dtype", param_dtype)
    grads_in = param_dtype if grad_dtype is None else grad_dtype
    unit_g_bytes = dtype_bytes("grad_dtype", grads_in)  # a gathered unit's gradients (stage 3)
    g_bytes = DTYPE_BYTES[reduced_grad_dtype(grads_in, None, grad_accum_dtype)]
    shard_g_bytes = DTYPE_BYTES[reduced_grad_dtype(grads_in, communication_data_type, grad_accum_dtype)]
    k_bytes = _ADAM_MOMENT_BYTES + (_MASTER_BYTES if master_weights else 0)
    if largest_layer_params is not None:
        check_count("largest_layer_params", largest_layer_params)
        if largest_layer_params > num_params:
            raise ValueError(f"largest_layer_params={largest_layer_params}: cannot exceed num_params={num_params}")
    if isinstance(hpz_partition_size, bool) or not isinstance(hpz_partition_size, int) or hpz_partition_size < 0:
        raise ValueError(f"hpz_partition_size={hpz_partition_size!r}: expected an integer >= 0 (0 and 1: off)")
    if isinstance(frozen_params, bool) or not isinstance(frozen_params, int) or frozen_params < 0:
        raise ValueError(f"frozen_params={frozen_params!r}: expected an integer >= 0")
    if quantized_nontrainable_weights and stage != 3:
        raise ValueError(f"quantized_nontrainable_weights applies at stage 3 only; the stage is {stage}")
    shard = shard_elements(num_params, world_size)
    shard_params, shard_grads, shard_opt = _SHARDED[stage]
    params = p_bytes * (shard if shard_params else num_params)
    if quantized_nontrainable_weights:
        params += int(_INT8_BYTES * shard_elements(frozen_params, world_size))
    elif stage == 3:
        params += p_bytes * shard_elements(frozen_params, world_size)
    else:
        params += p_bytes * frozen_params
    check_count("gradient_accumulation_steps", gradient_accumulation_steps)
    grads = shard_g_bytes * shard if shard_grads else g_bytes * num_params
    optimizer = k_bytes * (shard if shard_opt else num_params)
    working = (p_bytes + unit_g_bytes) * (largest_layer_params or 0) if stage == 3 else 0
    secondary = _zeropp_bytes(num_params, shard, hpz_partition_size, quantized_weights, p_bytes) if stage == 3 else 0
    buffers = 0
    if stage >= 1 and world_size > 1:
        comm_bytes = DTYPE_BYTES[grads_in if communication_data_type is None else communication_data_type]
        if stage == 1:
            buffers = stage1_buffers(num_params, shard, shard_g_bytes, comm_bytes, bucket_elements)
        else:
            buffers = idle_scratch(num_params, shard * shard_g_bytes, comm_bytes, bucket_elements, STAGE2_SCRATCH)
    total = params + grads + optimizer + working + secondary + buffers
    return MemoryEstimate(params, grads, optimizer, working, total, secondary, buffers)


# Scratch buckets in use at once: at stage 1's step ``stages.stage1.STEP_INFLIGHT`` reductions in flight and the one
# being launched; in a backward at stages 2-3 on a device, ``max_inflight + 1`` in flight and ``stages.stage2.FILLING``
# being filled (``Stage2Pipeline.pool_limit``; in host memory more where one parameter spans more buckets).
STAGE1_SCRATCH = 5
STAGE2_SCRATCH = 5


def stage1_buffers(num_params: int, shard: int, shard_bytes: int, comm_bytes: int, bucket_elements: int) -> int:
    """What stage 1 keeps between steps beside the local gradients (``Stage1Pipeline``): the reduced gradient shard
    (``shard`` elements of ``shard_bytes``) and its idle scratch buckets (:func:`idle_scratch`, at most
    ``STAGE1_SCRATCH``).

    Args:
        num_params: elements of the flat buffer.
        shard: elements of this rank's shard.
        shard_bytes: bytes per element of the reduced shard (:func:`reduced_grad_dtype`).
        comm_bytes: bytes per element of the communication dtype.
        bucket_elements: elements per bucket.
    """
    kept = shard * shard_bytes
    return kept + idle_scratch(num_params, kept, comm_bytes, bucket_elements, STAGE1_SCRATCH)


def idle_scratch(num_params: int, shard_bytes: int, comm_bytes: int, bucket_elements: int, at_once: int) -> int:
    """Bytes of the idle scratch buckets a stage keeps for its next reductions: one bucket of the communication
    dtype each, as many as were in use at once (at most ``at_once``, and no more than there are buckets), while
    they hold no more bytes than the gradient shard (``shard_bytes``). An upper bound: the stage uses buckets of at
    most ``bucket_elements`` (smaller where its backend overlaps better with them).

    Args:
        num_params: elements of the flat buffer.
        shard_bytes: bytes of this rank's reduced gradient shard.
        comm_bytes: bytes per element of the communication dtype.
        bucket_elements: elements per bucket.
        at_once: scratch buckets in use at once (``STAGE1_SCRATCH``, ``STAGE2_SCRATCH``).
    """
    check_count("bucket_elements", bucket_elements)
    scratch = min(bucket_elements, num_params) * comm_bytes
    in_use = min(at_once, -(-num_params // bucket_elements))
    return min(in_use, shard_bytes // scratch) * scratch


def reduced_grad_dtype(
    grad_dtype: str, communication_data_type: str | None = None, grad_accum_dtype: str | None = None
) -> str:
    """The dtype a stage keeps the reduced gradients in (the gradient shard of stages 2 and 3, the host tier's
    copy of it with offload, stage 1's reduction target), as ``Pipeline.accumulate_dtype_of`` allocates it: the
    promotion of the gradients' dtype, ``communication_data_type`` and ``grad_accum_dtype``; two different
    dtypes promote to fp32 (bf16 with fp16 too, as torch promotes them). Without ``communication_data_type``:
    the dtype stages 0-1 add the micro-steps' local gradients up in (``stages.grad_accum.local_dtype``).

    Args:
        grad_dtype: the gradients' dtype (``fp32``, ``bf16`` or ``fp16``).
        communication_data_type: the dtype gradients are reduced in; None: ``grad_dtype``.
        grad_accum_dtype: the dtype micro-steps are added up in; None: ``grad_dtype``.
    """
    given = {
        "grad_dtype": grad_dtype,
        "communication_data_type": communication_data_type,
        "grad_accum_dtype": grad_accum_dtype,
    }
    for name, value in given.items():
        if value is not None:
            dtype_bytes(name, value)
    names = {value for value in given.values() if value is not None}
    return names.pop() if len(names) == 1 else "fp32"


# int8 plus a float32 scale per block of (at most) 2048 elements: ``stages.quantized_gather.WEIGHT_BLOCK``.
_INT8_BYTES = 1 + 4 / 2048


def _zeropp_bytes(num_params: int, shard: int, hpz: int, quantized: bool, p_bytes: int) -> int:
    """Stage 3's ZeRO++ copies per rank: hpZ's secondary partition and qwZ's quantized shard."""
    per_param = _INT8_BYTES if quantized else p_bytes
    secondary = per_param * -(-num_params // hpz) if hpz > 1 else 0
    copy = _INT8_BYTES * shard if quantized else 0
    return int(secondary + copy)


def reduces_micro_steps(stage: int) -> bool:
    """Whether every accumulation micro-step reduces its gradients (``Pipeline.reduces_micro_steps``): at stages 2 and
    3 (into the shard, as DeepSpeed's ZeRO-2 and ZeRO-3); stages 0 and 1 add micro-steps up locally and reduce once
    per optimizer step.

    Args:
        stage: ZeRO stage, 0 to 3.
    """
    return stage >= 2


PHASES = ("forward", "backward", "after")  # the compute phases communication hides behind (``COLLECTIVES``)


@dataclass(frozen=True)
class CommEstimate:
    """What one GPU sends and receives per optimizer step, and how long that takes.

    Attributes:
        paper_volume: elements moved per rank per optimizer step as a multiple of Ψ, the ZeRO paper's measure
            (2 for stages 0-2, 3 for stage 3 with one micro-step; the paper rounds (N - 1)/N to 1). Stage 3's
            gathers repeat at every micro-step, and so do the reductions where :func:`reduces_micro_steps`.
        bytes_sent: bytes each GPU sends per optimizer step: ``grad_bytes + param_bytes``.
        bytes_received: bytes each GPU receives (equal to ``bytes_sent`` on a ring).
        collectives: collective launches per optimizer step (buckets times collectives per bucket).
        bandwidth_s: ``bytes_sent`` over the link bandwidth.
        latency_s: ring steps of every launch times the per-step latency.
        time_s: ``bandwidth_s + latency_s``, per optimizer step.
        phase_s: seconds of communication per compute phase (``forward``, ``backward``, ``after``), summed over
            the optimizer step's micro-steps.
        grad_bytes: of ``bytes_sent``, the gradients' reductions (in the communication dtype).
        param_bytes: of ``bytes_sent``, the parameters' all-gathers (in the parameters' dtype).
        micro_steps: micro-steps per optimizer step (``gradient_accumulation_steps``).
        micro_phase_s: seconds per phase that every micro-step runs (stage 3's gathers; the reductions where
            :func:`reduces_micro_steps`); the rest of ``phase_s`` runs once per optimizer step.
    """

    paper_volume: int
    bytes_sent: int
    bytes_received: int
    collectives: int
    bandwidth_s: float
    latency_s: float
    time_s: float
    phase_s: dict[str, float]
    grad_bytes: int = 0
    param_bytes: int = 0
    micro_steps: int = 1
    micro_phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @property
    def micro_time_s(self) -> float:
        """Seconds of communication that every micro-step runs (``micro_phase_s`` summed)."""
        return sum(self.micro_phase_s.values())


def _ring_time(
    kind: str, bucket_bytes: list[int], world_size: int, gbps: float, lat_us: float
) -> tuple[int, float, float]:
    """Bytes sent, bandwidth seconds and latency seconds of one ring collective run bucket by bucket."""
    factor = _RING_VOLUME[kind]
    sent = sum(factor * (world_size - 1) * b // world_size for b in bucket_bytes)
    steps = factor * (world_size - 1) * len(bucket_bytes)
    return sent, sent / (gbps * 1e9), steps * lat_us * 1e-6


def estimate_comm(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    link_gbps: float,
    latency_us: float,
    comm_dtype: str | None = None,
    param_dtype: str = "bf16",
    bucket_elements: int = 500_000_000,
    gradient_accumulation_steps: int = 1,
) -> CommEstimate:
    """Bytes each GPU sends and receives per optimizer step at ``stage``, and the time on a ring at the given link.

    "2Ψ" in the ZeRO paper (section 7.2) is per-rank data movement in elements: a ring reduce-scatter
    of Ψ elements has every rank send (N - 1)/N * Ψ elements and receive as many, and so does a ring
    all-gather; the paper drops the (N - 1)/N. Stages 0-2 move 2Ψ (all-reduce = reduce-scatter +
    all-gather; stages 1 and 2 run the two halves separately), stage 3 moves 3Ψ (all-gather in forward,
    all-gather in backward, reduce-scatter of gradients). Here the ring factor is kept, so with N = 1
    nothing moves. The gradients' reductions cross the wire in ``comm_dtype`` (DeepSpeed's
    ``communication_data_type``), the parameters' all-gathers in ``param_dtype``: with fp32 communication in
    bf16 training stage 0 sends twice the bytes, stages 1-2 1.5 times, stage 3 4/3 times.

    With ``gradient_accumulation_steps`` K, stage 3 gathers the parameters at every micro-step (2K gathers per
    optimizer step); the gradients are reduced once per optimizer step at stages 0-1, at every micro-step at stages 2-3
    (:func:`reduces_micro_steps`: K reductions).

    Time is a bandwidth term plus a latency term: ``bytes_sent / link`` plus, for every collective
    launch, its ring steps (N - 1 for reduce-scatter and all-gather, 2(N - 1) for all-reduce) times
    ``latency_us``. Each collective runs over ``ceil(Ψ / bucket_elements)`` buckets.

    Args:
        num_params: Ψ (>= 1).
        world_size: N, the data-parallel ranks on the ring (>= 1).
        stage: ZeRO stage, 0 to 3.
        link_gbps: per-GPU, per-direction bandwidth of the slowest link on the ring, in GB/s
            (10^9 bytes per second, not gigabits).
        latency_us: latency of one ring step in microseconds (>= 0).
        comm_dtype: dtype the gradients are reduced in (``fp32``, ``bf16`` or ``fp16``); None: ``param_dtype``.
        param_dtype: dtype of the parameters (and their gradients): what the all-gathers carry.
        bucket_elements: elements per collective launch (DeepSpeed's ``reduce_bucket_size``; its
            default is 5e8).
        gradient_accumulation_steps: K, micro-steps per optimizer step (>= 1).

    Returns:
        A :class:`CommEstimate`.
    """
    check_count("num_params", num_params)
    check_count("world_size", world_size)
    check_stage(stage)
    check_positive("link_gbps", link_gbps)
    if isinstance(latency_us, bool) or not isinstance(latency_us, (int, float)) or not latency_us >= 0:
        raise ValueError(f"latency_us={latency_us!r}: must be a number >= 0")
    check_count("bucket_elements", bucket_elements)
    check_count("gradient_accumulation_steps", gradient_accumulation_steps)
    elem = {
        "params": dtype_bytes("param_dtype", param_dtype),
        "grads": dtype_bytes("comm_dtype", param_dtype if comm_dtype is None else comm_dtype),
    }
    every = "micro" if reduces_micro_steps(stage) else "step"
    buckets = -(-num_params // bucket_elements)
    counts = [bucket_elements] * (buckets - 1) + [num_params - (buckets - 1) * bucket_elements]
    sent = {"grads": 0, "params": 0}
    bw_s, lat_s, volume, launches = 0.0, 0.0, 0, 0
    phase_s, micro_phase_s = dict.fromkeys(PHASES, 0.0), dict.fromkeys(PHASES, 0.0)
    for kind, payload, phase, when in COLLECTIVES[stage]:
        repeats = (every if payload == "grads" else when) == "micro"
        runs = gradient_accumulation_steps if repeats else 1
        sizes = [n * elem[payload] for n in counts]
        c_sent, c_bw, c_lat = _ring_time(kind, sizes, world_size, link_gbps, latency_us)
        sent[payload] += runs * c_sent
        bw_s, lat_s = bw_s + runs * c_bw, lat_s + runs * c_lat
        phase_s[phase] += runs * (c_bw + c_lat)
        if repeats:
            micro_phase_s[phase] += c_bw + c_lat
        volume, launches = volume + runs * _RING_VOLUME[kind], launches + runs * buckets
    total = sent["grads"] + sent["params"]
    return CommEstimate(
        volume, total, total, launches, bw_s, lat_s, bw_s + lat_s, phase_s,
        sent["grads"], sent["params"], gradient_accumulation_steps, micro_phase_s,
    )  # fmt: skip
