"""One rank's checks of ``test_multinode.py``, run by the two-node job (``tests.helpers.nodes``) under torchrun on
an emulated node (``benchmarks.netns``).

``run(OUT_DIR)``: checks the node groups made from torchrun's environment (membership, which traffic stays on
the node, a two-level all-reduce against the flat one, the C++ engine's two-level reduce-scatter), then trains
every stage in lock-step with single-process ``torch.optim.AdamW`` (``tests.helpers.lockstep``), and writes what
it found wrong, or ``ok``, to ``OUT_DIR/<rank>``.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.netns import link_bytes
from tests.helpers.lockstep import STAGES, run_lockstep
from zero_kernels.comm import make_engine
from zero_kernels.comm_groups import node_groups

MB = 1 << 20


def _sent(collective) -> int:
    """Bytes this node sent over the link while ``collective`` ran on every rank (read once every rank is done: a
    rank can finish before its node-mates' last sends)."""
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    dist.barrier()
    before = link_bytes(ifname)[0]
    collective()
    dist.barrier()
    return link_bytes(ifname)[0] - before


def check_groups(rank: int, world: int) -> list[str]:
    problems = []
    node, local, local_world = (int(os.environ[k]) for k in ("GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    if not local_world < world:
        problems.append(f"LOCAL_WORLD_SIZE={local_world} is not smaller than WORLD_SIZE={world}")
    g = node_groups()
    expect = (node, world // local_world, local, local_world)
    if (g.node, g.nodes, g.local_rank, g.local_world_size) != expect:
        problems.append(f"node_groups() {g} does not match torchrun's (node, nodes, local rank, size) {expect}")
    if g.intra_ranks != tuple(range(node * local_world, (node + 1) * local_world)):
        problems.append(f"intra ranks {g.intra_ranks} are not node {node}'s")
    if g.inter_ranks != tuple(range(local, world, local_world)):
        problems.append(f"inter ranks {g.inter_ranks} are not local rank {local}'s")
    for name in ("intra", "inter"):
        members = tuple(dist.get_process_group_ranks(getattr(g, name)))
        if members != getattr(g, f"{name}_ranks"):
            problems.append(f"the {name} group holds ranks {members}, not {getattr(g, f'{name}_ranks')}")
    if node_groups() is not g:
        problems.append("node_groups() built its groups again")
    if problems:
        return problems  # collectives on wrong groups would hang
    payload = torch.ones(MB)  # 4 MiB
    within = _sent(lambda: dist.all_reduce(payload, group=g.intra))
    across = _sent(lambda: dist.all_reduce(payload, group=g.inter))
    if within > MB // 4:
        problems.append(f"an all-reduce within the node sent {within} bytes over the link")
    if across < 4 * MB:
        problems.append(f"an all-reduce across the nodes sent only {across} bytes over the link")
    return problems + check_two_level(rank, g) + check_engine(world, g)


def check_two_level(rank: int, g) -> list[str]:
    """Reduce within the node, all-reduce across nodes, broadcast within the node: the flat sum, exactly."""
    x = torch.arange(1000, dtype=torch.float64) * (rank + 1)
    flat = x.clone()
    dist.all_reduce(flat)
    dist.reduce(x, dst=g.intra_ranks[0], group=g.intra)
    if g.local_rank == 0:
        dist.all_reduce(x, group=g.inter)
    dist.broadcast(x, src=g.intra_ranks[0], group=g.intra)
    return [] if torch.equal(x, flat) else [f"two-level all-reduce differs from the flat one: {x[:4]} vs {flat[:4]}"]


def check_engine(world: int, g) -> list[str]:
    """The C++ engine reduce-scatters in two levels along the nodes: a node sends half of the buffer over the link
    (the direct exchange between every pair would send all of it), the level within the node goes through the node's
    shared memory, and the sums are right."""
    engine = make_engine()
    if engine.kind != "cpp":
        return []
    rows = [list(range(n * g.local_world_size, (n + 1) * g.local_world_size)) for n in range(g.nodes)]
    if engine.nodes != rows:
        return [f"the C++ engine's nodes are {engine.nodes}, not {rows}"]
    full, shard = torch.full((MB,), float(dist.get_rank() + 1)), torch.empty(MB // world)
    sent = _sent(lambda: engine.reduce_scatter(shard, full, name="two levels").wait())
    problems = (
        [] if 0.45 * 4 * MB < sent < 0.65 * 4 * MB else [f"a 4 MiB reduce-scatter sent {sent} bytes over the link"]
    )
    if not torch.equal(shard, torch.full_like(shard, world * (world + 1) / 2)):
        problems.append(f"the two-level reduce-scatter summed to {shard[:4]}")
    if not engine.shares_memory():
        problems.append("the ranks of a node did not open its shared-memory channel for the level within it")
    return problems


def run(out: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        problems = check_groups(rank, world)
        for stage in STAGES:
            try:
                run_lockstep(rank, world, f"2 nodes x {world // 2} ranks, stage {stage}", stage=stage)
            except AssertionError as exc:
                problems.append(str(exc))
    except Exception:
        problems = [traceback.format_exc()]
    Path(out, str(rank)).write_text("\n".join(problems) or "ok")
