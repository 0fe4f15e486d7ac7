"""The step time of each ZeRO stage on nodes joined by a link: which bytes cross, and what hides them.

A cluster here is ``nodes`` machines of ``ranks_per_node`` ranks each (torchrun's
``LOCAL_WORLD_SIZE``), ranks numbered node by node as launchers number them. Each node has one link to
the others, ``link_Bps`` bytes per second each way for all its ranks together (its NICs together),
of which ``payload_share`` is left for payload once packet headers and acknowledgements are paid;
ranks of one node talk at ``intra_Bps`` each way per rank.

Which bytes cross a node boundary depends on the collective's algorithm (``ALGORITHMS``), for a
collective over a buffer of ``B`` bytes (the full buffer: all-reduce's input, reduce-scatter's input,
all-gather's output) on ``N`` ranks, ``L`` per node:

- ``ring`` (gloo's all-reduce on one node, NCCL's rings): the ring visits the ranks in rank order, so it leaves
  each node once: per node and direction the link carries one ring edge, ``2(N-1)/N·B`` for an
  all-reduce and ``(N-1)/N·B`` for a reduce-scatter or all-gather; every rank sends as much to its
  successor, a node neighbour for ``L - 1`` of a node's ``L`` ranks.
- ``pairwise`` (zero_kernels' reduce-scatter and all-gather on gloo, ``comm.PRIMITIVES``: each rank
  sends each other rank its chunk directly): on one node (or with one rank per node) every rank sends
  ``B/N`` to each of the others, ``(L-1)/N·B`` per rank within the node (and ``(N-1)/N·B`` per node over the
  link with one rank per node). Across nodes of several ranks the C++ engine runs it in two levels
  (``comm.NODES_PRIMITIVES``): a reduce-scatter first sums within each node, every rank sending each
  node-mate that mate's ``M`` chunks (``(L-1)/L·B`` per rank), then sends each node sum to its owner
  elsewhere; an all-gather does the same in reverse. A node's link then carries ``(M-1)/M·B`` per
  direction (``M`` nodes): ``0.5·B`` at 2 nodes of 2 ranks, against a ring's ``0.75·B`` and the ``B`` of
  a direct exchange between every pair. There an all-reduce (stage 0's buckets) is a two-level reduce-scatter and
  all-gather, one after the other: ``B`` per direction against a ring's ``1.5·B``.

A collective takes as long as its busiest resource needs, plus a latency per ring step: the link
(``link bytes / (link_Bps·payload_share)``), a rank's intra-node sends (``/ intra_Bps``) and, when the
host moves every byte itself (TCP on a few CPU cores: ``host_Bps``), all the bytes a node sends, over
the link or within the node (``/ host_Bps``). In two levels the node's part comes first and the link's
after it (a reduce-scatter; an all-gather the other way round), each as long as its busiest resource needs:
one collective takes both, and a collective's node part runs beside another's link part.

A step is scheduled on the rank's compute, the link and the node's own sends (a part of a two-level
collective), each working through its tasks in the order the pipeline issues them (``stage_step``):
stage 0 all-reduces each gradient bucket as backward fills it; stage 1 reduce-scatters after backward
and all-gathers after the optimizer step; stage 2 reduce-scatters during backward and all-gathers after
the step; stage 3 gathers every unit before forward (prefetched: the default window covers a small
model), gathers again before backward and reduce-scatters each unit's gradients as backward finishes it.
Whatever compute runs while the link works hides that communication; the rest is exposed.

Compute is an input (:class:`Compute`): measured, or fitted to a measured step with
:func:`calibrate` (the ``links`` benchmark fits it to its run without a rate limit and predicts the
limited rates from there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from .models import STAGES, check_count, check_positive, check_stage

# (backend, collective) -> algorithm; other backends use "ring" (NCCL's rings; its trees are not modelled).
ALGORITHMS = {
    ("gloo", "all_reduce"): "ring",
    ("gloo", "reduce_scatter"): "pairwise",
    ("gloo", "all_gather"): "pairwise",
}
_RING_VOLUME = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}


def tcp_payload_share(mtu: int = 1500) -> float:
    """Share of an Ethernet link's rate that carries TCP payload (IPv4, TCP timestamps, one ACK per two
    segments on the reverse direction, which carries data too): 0.936 at the usual MTU of 1500.

    Args:
        mtu: the interface's MTU in bytes.
    """
    check_count("mtu", mtu)
    payload, frame, ack = mtu - 52, mtu + 14, 66  # IPv4 20 + TCP 32; Ethernet 14; a bare ACK frame
    if payload <= 0:
        raise ValueError(f"mtu={mtu}: too small for TCP/IPv4 headers")
    return payload / (frame + ack / 2)


@dataclass(frozen=True)
class Cluster:
    """Nodes, ranks per node and the links between and within them.

    Attributes:
        nodes: machines.
        ranks_per_node: ranks on each (``LOCAL_WORLD_SIZE``).
        link_Bps: a node's link to the others, bytes per second each way (its NICs together).
        intra_Bps: bytes per second each way between two ranks of one node.
        latency_s: seconds per ring step of a collective.
        backend: ``gloo`` or ``nccl``: picks the algorithms (``ALGORITHMS``).
        payload_share: share of ``link_Bps`` left for payload (``tcp_payload_share()`` for TCP).
        host_Bps: bytes per second a node's host moves in all, over the link and within the node, when
            its CPUs copy every byte (gloo's TCP transport); None when transfers do not share a
            bottleneck (RDMA, NVLink).
    """

    nodes: int
    ranks_per_node: int
    link_Bps: float
    intra_Bps: float
    latency_s: float = 0.0
    backend: str = "nccl"
    payload_share: float = 1.0
    host_Bps: Optional[float] = None

    def __post_init__(self) -> None:
        check_count("nodes", self.nodes)
        check_count("ranks_per_node", self.ranks_per_node)
        check_positive("link_Bps", self.link_Bps)
        check_positive("intra_Bps", self.intra_Bps)
        if not 0 < self.payload_share <= 1:
            raise ValueError(f"payload_share={self.payload_share!r}: must be in (0, 1]")
        if not self.latency_s >= 0:
            raise ValueError(f"latency_s={self.latency_s!r}: must be >= 0")
        if self.host_Bps is not None:
            check_positive("host_Bps", self.host_Bps)

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


def algorithm(backend: str, kind: str) -> str:
    """The algorithm ``backend`` runs ``kind`` (all_reduce, reduce_scatter, all_gather) with."""
    if kind not in _RING_VOLUME:
        raise ValueError(f"kind={kind!r}: allowed collectives are {', '.join(_RING_VOLUME)}")
    return ALGORITHMS.get((backend, kind), "ring")


def two_levels(kind: str, cluster: Cluster) -> bool:
    """Whether ``kind`` runs in two levels along the nodes on ``cluster`` (gloo's pairwise exchange across nodes of
    several ranks: ``comm.NODES_PRIMITIVES``; there an all-reduce is a reduce-scatter and an all-gather so, as the
    engine sums one of over 64 KiB, ``comm.NODES_ALL_REDUCE_BYTES``: stage 0's buckets)."""
    pairwise = algorithm(cluster.backend, "reduce_scatter" if kind == "all_reduce" else kind) == "pairwise"
    return pairwise and cluster.nodes > 1 and cluster.ranks_per_node > 1


def crossing_bytes(kind: str, buffer_bytes: float, cluster: Cluster) -> tuple[float, float, float]:
    """(bytes a node sends over its link, bytes its busiest rank sends within the node, bytes all its ranks
    send within the node) for one collective.

    Args:
        kind: all_reduce, reduce_scatter or all_gather.
        buffer_bytes: the full buffer's bytes.
        cluster: the cluster.
    """
    n, local = cluster.world, cluster.ranks_per_node
    if n == 1:
        return 0.0, 0.0, 0.0
    if kind == "all_reduce" and two_levels(kind, cluster):
        link, intra_rank, intra_node = crossing_bytes("reduce_scatter", buffer_bytes, cluster)
        return 2 * link, 2 * intra_rank, 2 * intra_node
    if algorithm(cluster.backend, kind) == "ring":
        edge = _RING_VOLUME[kind] * (n - 1) / n * buffer_bytes
        return (edge if cluster.nodes > 1 else 0.0), (edge if local > 1 else 0.0), (local - 1) * edge
    if two_levels(kind, cluster):
        return (
            (cluster.nodes - 1) / cluster.nodes * buffer_bytes,
            (local - 1) / local * buffer_bytes,
            (local - 1) * buffer_bytes,
        )
    chunk = buffer_bytes / n
    return local * (n - local) * chunk, (local - 1) * chunk, local * (local - 1) * chunk


def collective_parts(kind: str, buffer_bytes: float, cluster: Cluster) -> list[tuple[str, float]]:
    """The parts of one collective over ``buffer_bytes`` in the order they run, as (resource, seconds): one part on
    ``link`` (which also bounds the node's own sends), or in two levels a ``node`` part (the sends within the node)
    and a ``link`` part, a reduce-scatter's node part first and an all-gather's last, each as long as its busiest
    resource needs. The latency of the collective's steps is added to its last part."""
    if kind == "all_reduce" and two_levels(kind, cluster):
        return [
            *collective_parts("reduce_scatter", buffer_bytes, cluster),
            *collective_parts("all_gather", buffer_bytes, cluster),
        ]
    link, intra_rank, intra_node = crossing_bytes(kind, buffer_bytes, cluster)
    host = cluster.host_Bps or math.inf
    over_link = link / (cluster.link_Bps * cluster.payload_share)
    within = intra_rank / cluster.intra_Bps
    latency = (0 if cluster.world == 1 else _RING_VOLUME[kind] * (cluster.world - 1)) * cluster.latency_s
    if not two_levels(kind, cluster):
        return [("link", max(over_link, within, (link + intra_node) / host) + latency)]
    parts = [("node", max(within, intra_node / host)), ("link", max(over_link, link / host))]
    if kind == "all_gather":
        parts.reverse()
    return [*parts[:-1], (parts[-1][0], parts[-1][1] + latency)]


def collective_seconds(kind: str, buffer_bytes: float, cluster: Cluster) -> float:
    """Seconds one collective over ``buffer_bytes`` takes on ``cluster`` on its own (bandwidth and latency)."""
    return sum(seconds for _, seconds in collective_parts(kind, buffer_bytes, cluster))


@dataclass(frozen=True)
class Compute:
    """Seconds of work per step on one rank outside communication: forward, backward, optimizer step."""

    forward_s: float
    backward_s: float
    step_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.step_s

    def scaled(self, factor: float) -> "Compute":
        return Compute(self.forward_s * factor, self.backward_s * factor, self.step_s * factor)


@dataclass(frozen=True)
class LinkStep:
    """One stage's step on a cluster.

    Attributes:
        stage: ZeRO stage.
        step_s: the step: compute and the communication it could not hide.
        comm_s: the step's collectives back to back.
        exposed_s: ``step_s - compute.total_s``.
        link_bytes: payload bytes each rank sends over its node's link per step (its node's share).
    """

    stage: int
    step_s: float
    comm_s: float
    exposed_s: float
    link_bytes: float


class _Schedule:
    """Tasks on serial resources, the rank's compute, the link and (for two-level collectives) the sends within
    the node, each run in the order issued and once its inputs are done; collectives count their time and the
    bytes they send over the link."""

    def __init__(self, cluster: Cluster, elem_bytes: int) -> None:
        self.cluster, self.elem_bytes = cluster, elem_bytes
        self.free = {"compute": 0.0, "link": 0.0, "node": 0.0}
        self.comm_s = self.link_bytes = 0.0

    def _run(self, resource: str, seconds: float, after: Sequence[float]) -> float:
        start = max([self.free[resource], *after])
        self.free[resource] = start + seconds
        return start + seconds

    def compute(self, seconds: float, after: Sequence[float] = ()) -> float:
        """Run ``seconds`` of compute; returns when it ends."""
        return self._run("compute", seconds, after)

    def collective(self, kind: str, elements: int, after: Sequence[float] = ()) -> float:
        """Run one collective over ``elements``; returns when it ends."""
        nbytes = elements * self.elem_bytes
        self.link_bytes += crossing_bytes(kind, nbytes, self.cluster)[0]
        for resource, seconds in collective_parts(kind, nbytes, self.cluster):
            self.comm_s += seconds
            after = [self._run(resource, seconds, after)]
        return after[0]


def _pieces(total: int, size: int) -> list[int]:
    """``total`` elements in pieces of ``size`` (the last one shorter)."""
    return [min(size, total - start) for start in range(0, total, size)]


def _stages_0_to_2(s: _Schedule, stage: int, buckets: list[int], compute: Compute) -> float:
    forward = s.compute(compute.forward_s)
    if stage == 1:  # reduce-scatter at the step, after backward
        backward = s.compute(compute.backward_s, [forward])
        reduced = [s.collective("reduce_scatter", b, [backward]) for b in buckets]
    else:  # each bucket's collective issued as soon as backward has filled it
        kind = "all_reduce" if stage == 0 else "reduce_scatter"
        total = sum(buckets)
        reduced = [s.collective(kind, b, [s.compute(compute.backward_s * b / total)]) for b in buckets]
    end = s.compute(compute.step_s, reduced)
    if stage:
        end = max(s.collective("all_gather", b, [end]) for b in buckets)
    return end


def _stage3(s: _Schedule, units: list[int], persistent: int, compute: Compute, bucket: int) -> float:
    total = sum(units)
    gathered = [s.collective("all_gather", u) for u in units]  # prefetched before forward
    done = [s.compute(compute.forward_s * u / total, [g]) for u, g in zip(units, gathered)]
    regathered = [s.collective("all_gather", u, [done[-1]]) for u in reversed(units)]
    reduced = []
    for u, g in zip(reversed(units), regathered):
        finished = s.compute(compute.backward_s * u / total, [g])
        reduced += [s.collective("reduce_scatter", b, [finished]) for b in _pieces(u, bucket)]
    if persistent:  # small parameters stay gathered: reduced after backward, gathered after the step
        reduced += [s.collective("reduce_scatter", b, reduced[-1:]) for b in _pieces(persistent, bucket)]
    end = s.compute(compute.step_s, reduced)
    if persistent:
        end = max(s.collective("all_gather", b, [end]) for b in _pieces(persistent, bucket))
    return end


def stage_step(
    stage: int,
    num_params: int,
    cluster: Cluster,
    compute: Compute,
    *,
    elem_bytes: int = 4,
    bucket_elements: int = 2_000_000,
    units: Optional[Sequence[int]] = None,
) -> LinkStep:
    """The step of ``stage`` on ``cluster``: compute, collectives, and what the compute hides.

    Args:
        stage: ZeRO stage, 0 to 3.
        num_params: Ψ, parameters trained (>= 1).
        cluster: nodes, ranks per node, links, backend.
        compute: the rank's forward, backward and optimizer-step seconds.
        elem_bytes: bytes per element on the wire (4: fp32, 2: bf16/fp16).
        bucket_elements: ``reduce_bucket_size``: elements per gradient collective and per parameter
            all-gather.
        units: stage 3: parameters of each unit gathered and freed together (one module's own
            parameters), in forward order; parameters in no unit are persistent (kept gathered, as
            those under ``stage3_param_persistence_threshold``). Default: one unit per bucket.
    """
    check_stage(stage)
    check_count("num_params", num_params)
    check_count("bucket_elements", bucket_elements)
    s = _Schedule(cluster, elem_bytes)
    buckets = _pieces(num_params, bucket_elements)
    if stage < 3:
        end = _stages_0_to_2(s, stage, buckets, compute)
    else:
        plan = list(units) if units is not None else buckets
        if not plan or min(plan) < 1 or sum(plan) > num_params:
            raise ValueError(f"units={units!r}: must be positive and add up to at most num_params={num_params}")
        end = _stage3(s, plan, num_params - sum(plan), compute, bucket_elements)
    return LinkStep(stage, end, s.comm_s, end - compute.total_s, s.link_bytes / cluster.ranks_per_node)


def calibrate(
    stage: int, measured_s: float, phases: Compute, num_params: int, cluster: Cluster, **options: Any
) -> Compute:
    """The compute that makes :func:`stage_step` on ``cluster`` match a measured step.

    ``phases`` (e.g. the measured forward, backward and step times, which include waiting) fixes the
    split between the three; their sum is fitted (bisection) so that the modelled step equals
    ``measured_s``. When the communication alone outlasts ``measured_s``, compute is zero.

    Args:
        stage: ZeRO stage.
        measured_s: the measured step on ``cluster``.
        phases: the split of compute between forward, backward and the optimizer step.
        num_params: Ψ.
        cluster: the cluster the step was measured on.
        options: ``stage_step``'s keyword arguments.
    """
    check_positive("measured_s", measured_s)
    if phases.total_s <= 0:
        raise ValueError(f"phases={phases!r}: their sum must be > 0")
    low, high = 0.0, measured_s / phases.total_s
    if stage_step(stage, num_params, cluster, phases.scaled(low), **options).step_s >= measured_s:
        return phases.scaled(0.0)
    for _ in range(60):
        mid = (low + high) / 2
        if stage_step(stage, num_params, cluster, phases.scaled(mid), **options).step_s < measured_s:
            low = mid
        else:
            high = mid
    return phases.scaled(low)


def crossover_Bps(
    num_params: int,
    cluster: Cluster,
    compute: dict[int, Compute],
    *,
    low: float = 1e5,
    high: float = 1e12,
    **options: Any,
) -> tuple[Optional[float], str]:
    """The link rate (bytes per second each way) below which stage 3's step is longer than stage 2's.

    Returns (rate, why): the rate where the two steps are equal, or None with why there is none in
    ``[low, high]`` (stage 3 slower everywhere, or faster everywhere). Stage 3 moves more bytes than
    stage 2 (3Ψ against 2Ψ), so the gap grows as the link slows; the search assumes one crossing.

    Args:
        num_params: Ψ.
        cluster: the cluster; its ``link_Bps`` is varied.
        compute: stage -> its compute (stages 2 and 3).
        low: slowest rate considered.
        high: fastest rate considered.
        options: ``stage_step``'s keyword arguments.
    """

    def gap(rate: float) -> float:
        on = replace(cluster, link_Bps=rate)
        return (
            stage_step(3, num_params, on, compute[3], **options).step_s
            - stage_step(2, num_params, on, compute[2], **options).step_s
        )

    if gap(high) > 0:
        return None, f"stage 3 is slower than stage 2 at every link rate from {low:.3g} to {high:.3g} B/s"
    if gap(low) <= 0:
        return None, f"stage 3 is as fast as stage 2 or faster at every link rate from {low:.3g} to {high:.3g} B/s"
    lo, hi = math.log(low), math.log(high)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gap(math.exp(mid)) > 0 else (lo, mid)
    rate = math.exp(hi)
    return rate, f"stage 3 is slower than stage 2 below {rate:.3g} B/s"


__all__ = [
    "ALGORITHMS",
    "STAGES",
    "Cluster",
    "Compute",
    "LinkStep",
    "algorithm",
    "calibrate",
    "collective_parts",
    "collective_seconds",
    "crossing_bytes",
    "crossover_Bps",
    "stage_step",
    "tcp_payload_share",
    "two_levels",
]
