"""Offload in the plan: where the optimizer state (and stage 3's parameters) live, what crosses the bus and
the disk per step, and how long the host's part of a step takes.

``offload_optimizer`` moves this rank's shard of the optimizer state (fp32 master, Adam m and v: K bytes
per element) off the device: to host memory (``cpu``) or to files on a disk (``nvme``), where the CPU
Adam updates it. Per optimizer step the reduced gradient shard goes down the host link once, in the update,
bucket by bucket (in the gradient dtype: 2 bytes per element in bf16 training; micro-steps are added up on the
device until then, in ``p.grad`` or, where every micro-step reduces, in the device's shard), and the updated
16-bit parameter shard comes back up (2 bytes): 4 bytes per parameter of the shard in bf16 training. The host
keeps a copy of the gradient shard it receives and of the parameter shard it sends (as the host tier does: 16
bytes per element with the state in bf16). The gradient shard goes down and is kept in the dtype the stage
reduces it into (``models.reduced_grad_dtype``: 4 bytes with ``communication_data_type`` or, at stages 2 and 3,
``grad_accum_dtype`` ``fp32``). Where the device is the host (``device_is_host``: a machine without GPU) the host
tier makes no copies and nothing crosses (``offload.HostTier.shares``): the host holds the state alone, and the
parameter shards stay where the device keeps them (``offload_param`` ``cpu`` moves nothing). With ``nvme`` the
state is written back once per step (K bytes per element of the shard) through ``buffer_count`` pinned
buffers of ``sub_group_size`` elements (the pool); read-ahead and write-behind run the CPU Adam of one sub-group
while the next is read and the previous written, so the update takes the longer of the Adam and the disk, not
their sum. The pool keeps its sub-groups between steps: a state that fits in it is never read again, and a
larger one is read once per step, the pool's worth of it (the next step's first sub-groups)
beside the forward, the rest in the update.

``ratio`` (``offload_optimizer.ratio``, in (0, 1]) offloads only that share of the state: the rest stays on
the device with its gradients and parameters (the pipeline cuts at whole buckets; the plan takes the share
itself), so the state, the host copies, the bus traffic, the disk and the CPU Adam count that share only.

``offload_param`` (stage 3 only) moves the 16-bit parameter shard off the device too: every gather of a unit
uploads its shard (forward and backward: twice per micro-step), and the host Adam writes its offloaded share in
place on the host (nothing goes up after the step). The rest of the shard, whose state is on the device (all of it
without ``offload_optimizer``, ``1 - ratio`` below ``ratio`` 1), is updated on the device on a copy: up before
the update and down after it (``staged``). ``nvme`` reads the shard from the disk for those gathers and the update
writes it back (the device's part of it read first: the host Adam overwrites its part without reading it).

Stage 3 with the state on ``nvme`` (``ratio`` 1) keeps the reduced gradient shard in files (``grads_in_files``,
as the pipeline does): not on the device nor as a host copy; each reduction sends it down and writes it, beside
backward, and the update reads it (a later micro-step's reduction reads it back to add): ``g`` bytes per element
on the disk, written and read at every reduction: once per micro-step (stage 3 reduces every micro-step,
``models.reduces_micro_steps``).

Devices, hosts and disks: ``ranks_per_node`` ranks share a node's host memory, its disk (capacity and
bandwidth) and its CPU cores (the CPU Adam's rate is the node's, divided among them); each rank has its
own host link (one PCIe x16 per GPU, as in DGX and HGX nodes). Offload needs ZeRO stage 1 or more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from .models import MemoryEstimate, check_count, check_positive, dtype_bytes, reduces_micro_steps, shard_elements

OFFLOAD_DEVICES = ("none", "cpu", "nvme")

# DeepSpeed 0.19's defaults for the keys the plan writes (its offload and aio config classes).
OPTIMIZER_BUFFERS = 4  # offload_optimizer.buffer_count
PARAM_BUFFERS = 5  # offload_param.buffer_count
PARAM_BUFFER_SIZE = 100_000_000  # offload_param.buffer_size, elements
PARAM_MAX_IN_CPU = 1_000_000_000  # offload_param.max_in_cpu, elements
MAX_SUB_GROUP = 1_000_000_000  # sub_group_size
AIO = {"block_size": 1_048_576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
       "overlap_events": True}  # fmt: skip

# A shard swapped through the disk is cut into at least this many sub-groups (the pipeline reads one, updates
# one and writes one at a time), of at least one MiB of elements each.
_SUB_GROUPS = 32
_MIN_SUB_GROUP = 1 << 20


@dataclass(frozen=True)
class DeviceKind:
    """The link between one device and its host.

    Attributes:
        name: the kind's name (``--device-kind``).
        gbytes_per_s: bytes per second each way, in GB/s; None: the device is the host, the rate is its
            memory's copy bandwidth (measured).
        description: where the figure comes from.
    """

    name: str
    gbytes_per_s: Optional[float]
    description: str


def _kinds() -> dict[str, DeviceKind]:
    """Device kinds and their host link, per direction (datasheet figures, halved from bidirectional)."""
    kinds = (
        DeviceKind("a100", 32.0, "PCIe 4.0 x16: 64 GB/s bidirectional (NVIDIA A100 PCIe datasheet)"),
        DeviceKind("h100", 64.0, "PCIe 5.0 x16: 128 GB/s bidirectional (NVIDIA H100 datasheet)"),
        DeviceKind("h200", 64.0, "PCIe 5.0 x16: 128 GB/s bidirectional (NVIDIA H200 datasheet)"),
        DeviceKind("gh200", 450.0, "NVLink-C2C: 900 GB/s bidirectional (NVIDIA GH200 datasheet)"),
        DeviceKind("cpu", None, "the device is the host: a copy within its memory, bandwidth measured"),
    )
    return {k.name: k for k in kinds}


DEVICE_KINDS = _kinds()


def check_device(name: str, value: str) -> str:
    """``value`` if it is an offload device (``none``, ``cpu``, ``nvme``), else a ValueError naming ``name``."""
    if value not in OFFLOAD_DEVICES:
        raise ValueError(f"{name}={value!r}: allowed devices are {', '.join(OFFLOAD_DEVICES)}")
    return value


@dataclass(frozen=True)
class OffloadSetup:
    """The offload to plan and the machine it runs on.

    Attributes:
        optimizer: ``offload_optimizer.device``: ``none``, ``cpu`` or ``nvme``.
        param: ``offload_param.device`` (stage 3 only): ``none``, ``cpu`` or ``nvme``.
        bus_gbps: host link of one rank, GB/s each way.
        adam_gbps: the node's CPU Adam rate, GB of optimizer state updated per second (all its cores).
        host_memory: bytes of host memory per node.
        ranks_per_node: ranks (devices) on each node.
        disk_gbps: the node's disk, GB/s for reads or writes (needed with ``nvme``).
        disk_space: bytes free on that disk (needed with ``nvme``).
        nvme_path: the folder for the files (needed with ``nvme``).
        grad_accum: micro-steps per optimizer step.
        ratio: ``offload_optimizer.ratio``: the share of the optimizer state offloaded, in (0, 1].
        device_is_host: the device is the host itself (no GPU): no host copies, nothing crosses the host link.
    """

    optimizer: str
    param: str
    bus_gbps: float
    adam_gbps: float
    host_memory: float
    ranks_per_node: int = 1
    disk_gbps: Optional[float] = None
    disk_space: Optional[float] = None
    nvme_path: Optional[str] = None
    grad_accum: int = 1
    ratio: float = 1.0
    device_is_host: bool = False

    def __post_init__(self) -> None:
        check_device("offload", self.optimizer)
        check_device("offload_param", self.param)
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio={self.ratio!r}: the offloaded share must be in (0, 1] (plan --offload-ratio)")
        for name in ("bus_gbps", "adam_gbps", "host_memory"):
            check_positive(name, getattr(self, name))
        check_count("ranks_per_node", self.ranks_per_node)
        check_count("grad_accum", self.grad_accum)
        if self.uses_disk:
            for name in ("disk_gbps", "disk_space", "nvme_path"):
                if getattr(self, name) is None:
                    raise ValueError(f"{name}=None: offload to nvme needs it (plan --{name.replace('_', '-')})")
            check_positive("disk_gbps", self.disk_gbps)
            check_positive("disk_space", self.disk_space)

    @property
    def uses_disk(self) -> bool:
        return "nvme" in (self.optimizer, self.param)

    @property
    def active(self) -> bool:
        return self.optimizer != "none" or self.param != "none"


@dataclass(frozen=True)
class OffloadEstimate:
    """One rank's offload at one stage: what it holds where, what it moves per step, and how long that takes.

    Attributes:
        host_bytes: host memory this rank holds (state, gradient shard, parameters, pinned buffers).
        disk_bytes: bytes of this rank's files.
        host_fits: whether the node's ranks together fit in its host memory.
        disk_fits: whether the node's ranks' files fit on its disk.
        bus_down: bytes down the host link per step (gradients).
        bus_up: bytes up per step (parameters: after the update, or at every stage-3 gather).
        disk_read: bytes read from the disk per step.
        disk_write: bytes written per step.
        adam_s: the CPU Adam's seconds per step (this rank's share of the node's cores).
        phase_s: offload seconds that run beside each compute phase (``forward``, ``backward``) and after
            backward (``after``: the update, and the parameters going up).
        sub_group_size: elements per swapped sub-group (the ``sub_group_size`` the config gets).
    """

    host_bytes: int
    disk_bytes: int
    host_fits: bool
    disk_fits: bool
    bus_down: int
    bus_up: int
    disk_read: int
    disk_write: int
    adam_s: float
    phase_s: dict[str, float]
    sub_group_size: int

    @property
    def fits(self) -> bool:
        return self.host_fits and self.disk_fits


def sub_group_elements(shard: int) -> int:
    """Elements per sub-group of a shard swapped through the disk: about 1/32 of the shard, a multiple of
    2^20 elements, between 2^20 and DeepSpeed's default of 1e9."""
    wanted = -(-shard // _SUB_GROUPS)
    return int(min(MAX_SUB_GROUP, max(_MIN_SUB_GROUP, -(-wanted // _MIN_SUB_GROUP) * _MIN_SUB_GROUP)))


def grads_in_files(stage: int, setup: OffloadSetup) -> bool:
    """Whether the reduced gradient shard lives in files (stage 3, all the state on ``nvme``)."""
    return stage == 3 and setup.optimizer == "nvme" and setup.ratio == 1.0


def device_memory(memory: MemoryEstimate, setup: OffloadSetup, *, stage: int) -> MemoryEstimate:
    """What stays on the device: the estimate without the offloaded share of the optimizer state (and stage 3's
    parameter shard with ``offload_param``, unless the device is the host and the shard is kept in memory; and its
    reduced gradient shard where it is in files, ``grads_in_files``). ZeRO++'s copies
    (``secondary``) are gathered from the shard onto the device, so they stay."""
    kept = setup.param == "none" or (setup.device_is_host and setup.param == "cpu")
    params = memory.params if kept else 0
    grads = 0 if grads_in_files(stage, setup) else memory.grads
    optimizer = round(memory.optimizer * (1 - setup.ratio)) if setup.optimizer != "none" else memory.optimizer
    total = params + grads + optimizer + memory.working_set + memory.secondary + memory.buffers
    return MemoryEstimate(params, grads, optimizer, memory.working_set, total, memory.secondary, memory.buffers)


def estimate_offload(
    num_params: int,
    world_size: int,
    stage: int,
    setup: OffloadSetup,
    *,
    param_dtype: str = "bf16",
    master_weights: bool = True,
    grad_dtype: Optional[str] = None,
) -> OffloadEstimate:
    """One rank's offload at ``stage`` (1 to 3; ``offload_param`` counts at stage 3 only).

    Args:
        num_params: Ψ.
        world_size: data-parallel ranks N.
        stage: ZeRO stage.
        setup: the offload and the machine.
        param_dtype: parameter dtype (and the gradients', unless ``grad_dtype``).
        master_weights: whether the state holds an fp32 master copy (K = 12 bytes per element, else 8).
        grad_dtype: the dtype of the reduced gradient shard (``models.reduced_grad_dtype``); None: ``param_dtype``.
    """
    if stage < 1:
        raise ValueError(f"stage={stage}: offload needs ZeRO stage 1, 2 or 3")
    elem = dtype_bytes("param_dtype", param_dtype)
    g_elem = elem if grad_dtype is None else dtype_bytes("grad_dtype", grad_dtype)
    k_bytes = 12 if master_weights else 8
    shard = shard_elements(num_params, world_size)
    moved = round(shard * setup.ratio)  # elements of the shard whose state is offloaded
    state = k_bytes * moved if setup.optimizer != "none" else 0
    param_off = setup.param if stage == 3 else "none"
    gathers = 2 * setup.grad_accum  # stage 3: forward and backward of every micro-step
    sub = sub_group_elements(moved)
    crosses = not setup.device_is_host  # on a host device the tier shares the device's tensors
    files = grads_in_files(stage, setup)  # no host copy of the gradient shard: it is in files
    copies = _copies(setup, elem, 0 if files else g_elem, moved, shard if param_off == "cpu" else 0) if crosses else 0
    device_part = elem * (shard - (moved if setup.optimizer != "none" else 0)) if param_off != "none" else 0
    staged = device_part if crosses else 0  # the device's update of its part of a shard off the device
    host = copies + (state if setup.optimizer == "cpu" else 0)
    host += OPTIMIZER_BUFFERS * sub * k_bytes if setup.optimizer == "nvme" else 0
    host += PARAM_BUFFERS * PARAM_BUFFER_SIZE * elem if param_off == "nvme" else 0
    in_files = elem * shard if param_off == "nvme" else 0  # parameter shards in files
    grad_file = g_elem * shard if files else 0
    reductions = setup.grad_accum if reduces_micro_steps(stage) else 1
    grad_io = grad_file * reductions  # written at every reduction; read back by the later ones and by the update
    disk = (state if setup.optimizer == "nvme" else 0) + in_files + grad_file
    downs = reductions if files else 1  # to its file at every reduction, else to the host copy in the update
    down = (g_elem * moved * downs if setup.optimizer != "none" and crosses else 0) + staged
    up_after = (elem * moved if setup.optimizer != "none" and param_off == "none" and crosses else 0) + staged
    up_gather = elem * shard * gathers if param_off != "none" and crosses else 0
    state_io = state if setup.optimizer == "nvme" else 0
    state_read, early = _state_reads(state_io, k_bytes * OPTIMIZER_BUFFERS * sub)
    gather_reads = in_files * gathers
    update_reads = device_part if param_off == "nvme" else 0  # the device's update reads its part of the shard
    read = state_read + gather_reads + grad_io + update_reads  # the shards are read for every gather; the host Adam
    write = state_io + in_files + grad_io  # overwrites its part (it reads it only where it keeps some elements)
    return OffloadEstimate(
        host_bytes=host,
        disk_bytes=disk,
        host_fits=host * setup.ranks_per_node <= setup.host_memory,
        disk_fits=not disk or disk * setup.ranks_per_node <= (setup.disk_space or 0),
        bus_down=down,
        bus_up=up_after + up_gather,
        disk_read=read,
        disk_write=write,
        adam_s=state * setup.ranks_per_node / (setup.adam_gbps * 1e9),
        phase_s=_phases(
            setup,
            state,
            (state_read - early, early),
            down,
            up_after,
            up_gather,
            gather_reads,
            in_files + update_reads,
            grad_file,
            reductions,
        ),
        sub_group_size=sub,
    )


def _state_reads(state: int, pool: int) -> tuple[int, int]:
    """(bytes of the state read per step, of which read beside the next forward) with ``state`` bytes on the
    disk and a pool of ``pool`` bytes: nothing where the pool holds it all."""
    if state <= pool:
        return 0, 0
    return state, pool


def _copies(setup: OffloadSetup, elem: int, g_elem: int, moved: int, param_shard: int) -> int:
    """Bytes of the host copies of the gradient and parameter shards (with ``offload_param`` on cpu the parameter
    copy is the whole shard itself, ``param_shard`` elements)."""
    if setup.optimizer != "none":
        return g_elem * moved + elem * max(moved, param_shard)
    return elem * param_shard


def _phases(
    setup: OffloadSetup,
    state: int,
    state_reads: tuple[int, int],
    down: int,
    up_after: int,
    up_gather: int,
    gather_reads: int,
    in_files: int,
    grad_file: int,
    reductions: int,
) -> dict[str, float]:
    """Offload seconds beside forward and backward and after backward.

    Gathers of offloaded parameters split evenly between forward and backward (each the longer of its
    uploads and its disk reads, ``gather_reads``); a node's disk serves its ranks one after another (its
    bandwidth divided among them); the bus is per rank and full duplex; on the disk the state is written by the
    update and read (``state_reads``: bytes read in the update, and beside the next forward), and parameter shards
    in files are written (and the device's part read) by the update (``in_files`` bytes, after backward). The
    gradients go down in the update, bucket by bucket before its Adam (``down``, after backward); a gradient shard
    in files (``grad_file`` bytes) goes down and is written by each of the step's ``reductions`` beside backward,
    read back by every one after the first, and read by the update.
    """
    bus = setup.bus_gbps * 1e9
    disk = (setup.disk_gbps or math.inf) * 1e9 / setup.ranks_per_node
    gather_s = max(up_gather / bus, gather_reads / disk) / 2
    adam_s = state * setup.ranks_per_node / (setup.adam_gbps * 1e9)
    read_after, read_early = state_reads
    state_io_s = (read_after + state) / disk if setup.optimizer == "nvme" else 0.0
    down_after = 0 if grad_file else down
    return {
        "forward": max(up_gather / bus / 2, (gather_reads / 2 + read_early) / disk),
        "backward": max(gather_s, down / bus, (2 * reductions - 1) * grad_file / disk) if grad_file else gather_s,
        "after": max(adam_s, state_io_s + (in_files + grad_file) / disk) + (up_after + down_after) / bus,
    }


def offload_keys(
    setup: OffloadSetup, stage: int, *, sub_group_size: int, largest_layer_params: Optional[int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``zero_optimization`` keys, top-level keys) of the offload in a DeepSpeed config.

    Args:
        setup: the offload.
        stage: the ZeRO stage the config selects (``offload_param`` is written at stage 3 only).
        sub_group_size: elements per swapped sub-group.
        largest_layer_params: the largest unit stage 3 gathers; ``offload_param.buffer_size`` must hold it.
    """
    zero: dict[str, Any] = {}
    if setup.optimizer != "none":
        zero["offload_optimizer"] = {"device": setup.optimizer, "pin_memory": True}
        if setup.ratio != 1:
            zero["offload_optimizer"]["ratio"] = setup.ratio
        if setup.optimizer == "nvme":
            zero["offload_optimizer"].update(
                nvme_path=setup.nvme_path, buffer_count=OPTIMIZER_BUFFERS, pipeline_read=True, pipeline_write=True
            )
    if stage == 3 and setup.param != "none":
        zero["offload_param"] = {"device": setup.param, "pin_memory": True}
        if setup.param == "nvme":
            size = max(PARAM_BUFFER_SIZE, largest_layer_params or 0)
            zero["offload_param"].update(
                nvme_path=setup.nvme_path, buffer_count=PARAM_BUFFERS, buffer_size=size, max_in_cpu=PARAM_MAX_IN_CPU
            )
    zero["sub_group_size"] = sub_group_size if setup.optimizer == "nvme" else MAX_SUB_GROUP
    top = {"aio": dict(AIO)} if setup.uses_disk and (setup.optimizer == "nvme" or stage == 3) else {}
    return zero, top
