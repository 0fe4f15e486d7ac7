"""The planner's link model (``zero_kernels.planner.links``): bytes across node boundaries per algorithm,
what each stage's schedule can hide, the fit to a measured step, the stage 2 / stage 3 crossover.
Its predictions against measured steps are checked by ``python -m benchmarks links``, not here."""

from __future__ import annotations

import pytest

from zero_kernels.planner import links
from zero_kernels.planner.links import Cluster, Compute, stage_step

B = 8_000_000.0  # bytes of a buffer
PSI = 1_000_000


def gloo(**kw) -> Cluster:
    return Cluster(**{"nodes": 2, "ranks_per_node": 2, "link_Bps": 1e8, "intra_Bps": 1e12, "backend": "gloo", **kw})


def nccl(**kw) -> Cluster:
    return Cluster(**{"nodes": 2, "ranks_per_node": 2, "link_Bps": 1e8, "intra_Bps": 1e12, **kw})


@pytest.mark.parametrize(
    "cluster, kind, expected",
    [
        # ring through ranks 0-1 | 2-3: one edge per node and direction crosses, one stays inside
        (nccl(), "all_reduce", (1.5 * B, 1.5 * B, 1.5 * B)),
        # gloo across nodes of 2: a two-level reduce-scatter, then all-gather (one node: gloo's ring)
        (gloo(), "all_reduce", (B, B, 2 * B)),
        (gloo(nodes=1), "all_reduce", (0.0, B, B)),
        (nccl(), "all_gather", (0.75 * B, 0.75 * B, 0.75 * B)),
        # two levels: each rank sends its node-mate the mate's half, then each of a node's 2 ranks sends
        # one quarter (a node sum) to the other node
        (gloo(), "all_gather", (0.5 * B, 0.5 * B, B)),
        (gloo(), "reduce_scatter", (0.5 * B, 0.5 * B, B)),
        (gloo(nodes=4, ranks_per_node=4), "all_gather", (0.75 * B, 0.75 * B, 3 * B)),
        # pairwise on one node: 2 ranks, half the buffer each way; one rank per node: 3 quarters cross
        (gloo(nodes=1), "all_gather", (0.0, 0.5 * B, B)),
        (gloo(nodes=4, ranks_per_node=1), "reduce_scatter", (0.75 * B, 0.0, 0.0)),
        (gloo(ranks_per_node=1), "all_reduce", (B, 0.0, 0.0)),
        (gloo(nodes=1, ranks_per_node=1), "all_reduce", (0.0, 0.0, 0.0)),
    ],
    ids=[
        "nccl ring all-reduce",
        "gloo two-level all-reduce",
        "gloo ring all-reduce on one node",
        "nccl ring all-gather",
        "gloo two-level all-gather",
        "gloo two-level reduce-scatter",
        "4x4 two-level",
        "one node",
        "pairwise, one rank per node",
        "one rank per node",
        "one rank",
    ],  # fmt: skip
)
def test_bytes_that_cross_node_boundaries(cluster: Cluster, kind: str, expected: tuple) -> None:
    assert links.crossing_bytes(kind, B, cluster) == pytest.approx(expected)


def test_a_collective_takes_its_busiest_resource() -> None:
    # two-level all-gather, 2x2: 4 MB over a 100 MB/s link, then 4 MB per rank within the node
    assert links.collective_seconds("all_gather", B, gloo()) == pytest.approx(0.04 + 4e-6)
    assert links.collective_seconds("all_gather", B, gloo(payload_share=0.5)) == pytest.approx(0.08 + 4e-6)
    assert links.collective_seconds("all_gather", B, gloo(intra_Bps=1e6)) == pytest.approx(0.04 + 4.0)
    # a host that copies every byte itself, at 50 MB/s: 8 MB within the node, then 4 MB over the link
    assert links.collective_seconds("all_gather", B, gloo(host_Bps=5e7)) == pytest.approx(0.16 + 0.08)
    # one node, pairwise: the busiest resource alone (4 MB per rank at 1 MB/s)
    assert links.collective_seconds("all_gather", B, gloo(nodes=1, intra_Bps=1e6)) == pytest.approx(4.0)
    # ring all-reduce on 4 ranks: 2 x 3 steps of latency
    assert links.collective_seconds("all_reduce", B, nccl(latency_s=1e-3)) == pytest.approx(0.12 + 6e-3)
    # gloo across nodes: a two-level reduce-scatter, then all-gather (node, link, link, node)
    parts = links.collective_parts("all_reduce", B, gloo(intra_Bps=1e8))
    assert parts == [("node", 0.04), ("link", 0.04), ("link", 0.04), ("node", 0.04)]


@pytest.mark.parametrize(
    "cluster, per_rank_psi",
    [(gloo(), {0: 0.5, 1: 0.5, 2: 0.5, 3: 0.75}), (nccl(), {0: 0.75, 1: 0.75, 2: 0.75, 3: 1.125})],
    ids=["gloo", "nccl"],
)
def test_bytes_each_rank_sends_over_the_link_per_step(cluster: Cluster, per_rank_psi: dict) -> None:
    """Per rank: its node's link bytes / 2 ranks. gloo: stage 0 a two-level all-reduce (4 bytes x Ψ per node),
    stages 1-2 a two-level reduce-scatter and all-gather (Ψ/2 each), stage 3 two gathers and a reduce-scatter."""
    for stage, psi in per_rank_psi.items():
        step = stage_step(stage, PSI, cluster, Compute(0, 0, 0), units=[PSI // 4] * 4)
        assert step.link_bytes == pytest.approx(psi * 4 * PSI), stage


def test_without_compute_the_step_is_its_collectives() -> None:
    # the node parts of the two-level collectives (1e-4 of the link parts here) may overlap other collectives
    for stage in links.STAGES:
        step = stage_step(stage, PSI, gloo(), Compute(0, 0, 0), units=[PSI // 4] * 4)
        assert step.step_s == pytest.approx(step.comm_s, rel=1e-3)
        assert step.exposed_s == pytest.approx(step.comm_s, rel=1e-3)


def test_two_level_parts_run_beside_the_next_collective() -> None:
    """An all-gather crosses the link, then sends within the node: the next one's link part runs meanwhile."""
    cluster = gloo(intra_Bps=1e8)  # the node part (B/2 per rank) as long as the link part (B/2 per node)
    assert links.collective_parts("all_gather", B, cluster) == [("link", 0.04), ("node", 0.04)]
    assert links.collective_parts("reduce_scatter", B, cluster) == [("node", 0.04), ("link", 0.04)]
    step = stage_step(1, 2 * PSI, cluster, Compute(0, 0, 0), bucket_elements=PSI)  # 2 buckets of B / 2
    assert step.step_s == pytest.approx(3 * 0.04)  # each collective: node, link; the two overlap by one part


def test_what_each_stage_can_hide() -> None:
    cluster, long_backward = gloo(), Compute(0.0, 10.0, 0.0)  # backward outlasts every collective
    bucket = 250_000
    one = links.collective_seconds("all_reduce", 4 * bucket, cluster)
    # stage 0: every bucket but the last is reduced while backward goes on
    assert stage_step(0, PSI, cluster, long_backward, bucket_elements=bucket).exposed_s == pytest.approx(one)
    # stage 1 reduces after backward: nothing hidden; stage 2 hides its reduce-scatter, not the all-gather
    s1 = stage_step(1, PSI, cluster, long_backward, bucket_elements=bucket)
    assert s1.exposed_s == pytest.approx(s1.comm_s, rel=1e-3)
    s2 = stage_step(2, PSI, cluster, long_backward, bucket_elements=bucket)
    gather = 4 * links.collective_seconds("all_gather", 4 * bucket, cluster)
    reduce = links.collective_seconds("reduce_scatter", 4 * bucket, cluster)
    assert s2.exposed_s == pytest.approx(gather + reduce, rel=1e-3)  # node parts: 1e-4 of the link's
    # stage 3 with long forward and backward: only the first unit's gathers wait, and the last reduce-scatter
    units = [bucket] * 4
    s3 = stage_step(3, PSI, cluster, Compute(10.0, 10.0, 0.0), bucket_elements=bucket, units=units)
    unit = links.collective_seconds("all_gather", 4 * bucket, cluster)
    assert s3.exposed_s == pytest.approx(unit + unit + links.collective_seconds("reduce_scatter", 4 * bucket, cluster))


def test_stage3_persistent_parameters_are_gathered_after_the_step() -> None:
    cluster = gloo()
    with_persistent = stage_step(3, PSI, cluster, Compute(0, 0, 1.0), units=[PSI // 2])
    rest = 4 * (PSI - PSI // 2)
    after = links.collective_seconds("all_gather", rest, cluster)
    assert with_persistent.step_s > 1.0 + after  # the all-gather of the persistent half follows the step
    with pytest.raises(ValueError, match="add up to at most num_params"):
        stage_step(3, PSI, cluster, Compute(0, 0, 0), units=[PSI, 1])


def test_calibrate_fits_the_compute_to_a_measured_step() -> None:
    cluster, phases = gloo(), Compute(0.01, 0.02, 0.01)
    for stage in links.STAGES:
        comm_only = stage_step(stage, PSI, cluster, Compute(0, 0, 0)).step_s
        fitted = links.calibrate(stage, comm_only + 0.2, phases, PSI, cluster)
        assert stage_step(stage, PSI, cluster, fitted).step_s == pytest.approx(comm_only + 0.2, rel=1e-9)
        assert fitted.forward_s / fitted.backward_s == pytest.approx(0.5)
        assert links.calibrate(stage, comm_only / 2, phases, PSI, cluster).total_s == 0.0  # comm alone is longer


def test_crossover_where_stage3_stops_hiding_its_gathers() -> None:
    """Same compute for both stages, long enough to hide stage 3's gathers on a fast link: stage 3 wins
    there (stage 2's all-gather after the step is always exposed) and loses on a slow link (3Ψ vs 2Ψ)."""
    compute = Compute(0.05, 0.1, 0.0)
    rate, why = links.crossover_Bps(PSI, gloo(), {2: compute, 3: compute}, units=[PSI // 4] * 4)
    assert rate is not None, why

    def gap(r: float) -> float:
        at = gloo(link_Bps=r)
        return stage_step(3, PSI, at, compute, units=[PSI // 4] * 4).step_s - stage_step(2, PSI, at, compute).step_s

    assert gap(rate * 0.98) > 0 > gap(rate * 1.02)
    heavy = {2: compute, 3: Compute(0.5, 1.0, 0.0)}  # stage 3 slower even with no communication at all
    assert links.crossover_Bps(PSI, gloo(), heavy)[0] is None
    assert "slower than stage 2 at every link rate" in links.crossover_Bps(PSI, gloo(), heavy)[1]


def test_tcp_payload_share_and_bad_input() -> None:
    assert links.tcp_payload_share() == pytest.approx(1448 / (1514 + 33))
    assert links.tcp_payload_share(9000) > links.tcp_payload_share()
    with pytest.raises(ValueError, match="mtu=40"):
        links.tcp_payload_share(40)
    with pytest.raises(ValueError, match="link_Bps"):
        gloo(link_Bps=0)
    with pytest.raises(ValueError, match="payload_share"):
        gloo(payload_share=1.5)
    with pytest.raises(ValueError, match="kind='broadcast'"):
        links.crossing_bytes("broadcast", B, gloo())
    with pytest.raises(ValueError, match="stage=4"):
        stage_step(4, PSI, gloo(), Compute(0, 0, 0))
