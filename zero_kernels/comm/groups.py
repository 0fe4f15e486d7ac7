"""Process groups along the node boundary: the ranks of this node, and this rank's peers on other nodes.

A multi-node job (``torchrun --nnodes M --nproc_per_node L``) has ``LOCAL_WORLD_SIZE`` = L ranks on
each node. Hierarchical schemes (ZeRO++'s secondary partitions, a two-level all-reduce) talk within a
node over its fast links and across nodes over the slow one; ``node_groups()`` gives them both groups:

- ``intra``: the ranks of this node (size L);
- ``inter``: the ranks that have this rank's local rank, one per node (size M), in node order.

Where a rank lives comes from its launcher's environment: the node is ``GROUP_RANK`` (torchrun's node
rank) or, without it, the host name; the local rank is ``LOCAL_RANK`` and the node's size
``LOCAL_WORLD_SIZE`` (when set, every node must have that many ranks). Every rank tells every other
where it lives (one all-gather), so every rank checks the same facts and raises the same error when
they do not make a regular grid (nodes of unequal size, local ranks missing or repeated): no rank is
left waiting. The groups are built once per default process group: the first call is collective
(every rank must make it), later calls return the same groups until the default group is destroyed.
``node_layout()`` gives the grid without the groups, or None (on every rank alike) where it is irregular.
"""

from __future__ import annotations

import os
import socket
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch.distributed as dist

from ..wording import plural
from .control import ControlLink
from .engines import TorchCommEngine
from .objects import all_gather_objects


@dataclass(frozen=True)
class NodeGroups:
    """This rank's place in the grid of nodes and local ranks, and the groups along it.

    Attributes:
        node: this rank's node, from 0 (nodes are ordered by their lowest global rank).
        nodes: number of nodes.
        local_rank: this rank's place on its node, from 0.
        local_world_size: ranks per node.
        intra_ranks: the global ranks of this node, by local rank.
        inter_ranks: the global ranks with this local rank, by node.
        intra: the process group of ``intra_ranks``.
        inter: the process group of ``inter_ranks``.
    """

    node: int
    nodes: int
    local_rank: int
    local_world_size: int
    intra_ranks: tuple[int, ...]
    inter_ranks: tuple[int, ...]
    intra: Any
    inter: Any


# a rank's (node key, LOCAL_RANK, LOCAL_WORLD_SIZE): None where unset, the text where not an integer
Place = tuple[str, Union[int, str, None], Union[int, str, None]]
# (the default group, its node groups, every node's ranks, the subgroups made by size)
_cache: Optional[tuple[weakref.ReferenceType, NodeGroups, list[list[int]], dict[int, Any]]] = None
# (the default group, every rank's place: ``_where()`` of each rank)
_places_cache: Optional[tuple[weakref.ReferenceType, list["Place"]]] = None


def _where() -> Place:
    """(node key, local rank, local world size) of this process, from its launcher's environment; a value that is not
    an integer is kept as written, for ``grid`` to refuse on every rank alike (this rank must not fail alone before
    the exchange: the others would pair their exchange with its next one)."""
    node = os.environ.get("GROUP_RANK")
    key = f"node {node}" if node is not None else f"host {socket.gethostname()}"
    return key, _integer(os.environ.get("LOCAL_RANK")), _integer(os.environ.get("LOCAL_WORLD_SIZE"))


def _integer(value: Optional[str]) -> Union[int, str, None]:
    try:
        return None if value is None else int(value)
    except ValueError:
        return value


def _check_integers(places: list[Place]) -> None:
    for rank, (_, local, size) in enumerate(places):
        for name, value in (("LOCAL_RANK", local), ("LOCAL_WORLD_SIZE", size)):
            if isinstance(value, str):
                raise ValueError(f"rank {rank}: {name}={value!r} is not an integer")


def grid(places: list[Place]) -> list[list[int]]:
    """The global ranks of each node, by local rank, from every rank's ``(node key, local rank, local world
    size)``; a ValueError says what is irregular. Pure: every rank computes the same result or error.

    Args:
        places: per global rank, its node key, its ``LOCAL_RANK`` (None: its order on its node) and its
            ``LOCAL_WORLD_SIZE`` (None: unknown), each as ``_where()`` gives it (a string: not an integer).
    """
    _check_integers(places)
    nodes: dict[str, list[int]] = {}
    for rank, (key, _, _) in enumerate(places):
        nodes.setdefault(key, []).append(rank)
    sizes = {size for _, _, size in places}
    if len(sizes) > 1:
        raise ValueError(f"ranks disagree on LOCAL_WORLD_SIZE: {sorted(sizes, key=str)}")
    counts = {key: len(ranks) for key, ranks in nodes.items()}
    expected = sizes.pop()
    if len(set(counts.values())) > 1 or (expected is not None and set(counts.values()) != {expected}):
        want = f"LOCAL_WORLD_SIZE={expected} each" if expected is not None else "equal sizes"
        raise ValueError(f"nodes must have {want}; ranks per node: {counts}")
    rows = []
    for key, ranks in nodes.items():
        locals_ = [places[r][1] for r in ranks]
        if all(lr is None for lr in locals_):
            rows.append(ranks)
            continue
        if sorted(lr for lr in locals_ if lr is not None) != list(range(len(ranks))):
            raise ValueError(f"{key}: LOCAL_RANK values {locals_} are not 0..{len(ranks) - 1}, once each")
        rows.append([r for _, r in sorted(zip(locals_, ranks))])
    return rows


def _places() -> list[Place]:
    """Every rank's ``_where()``, in rank order: one exchange over the default group's ranks (on a host group
    where the default one is NCCL) on the first call per default group, which every rank must make."""
    global _places_cache
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("the node layout needs torch.distributed initialised (init_process_group)")
    world = dist.group.WORLD
    if _places_cache is None or _places_cache[0]() is not world:
        host = ControlLink(TorchCommEngine()).get()
        _places_cache = (weakref.ref(world), all_gather_objects(host, _where(), name="node_groups"))
    return _places_cache[1]


def node_layout() -> Optional[list[list[int]]]:
    """The global ranks of each node, by local rank (``grid``), or None where the ranks do not make a regular
    grid; the same on every rank. Collective on the first call per default group, as ``node_groups()``."""
    try:
        return grid(_places())
    except ValueError:
        return None


def node_groups() -> NodeGroups:
    """The intra-node and inter-node process groups of this rank (built on the first call: collective).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: (on every rank) the ranks do not form nodes of equal size with local ranks 0..L-1.
    """
    global _cache
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("node_groups() needs torch.distributed initialised (init_process_group)")
    world = dist.group.WORLD
    if _cache is not None and _cache[0]() is world:
        return _cache[1]
    rows = grid(_places())
    rank = dist.get_rank()
    intra = [dist.new_group(ranks=row) for row in rows]  # every rank creates every group, in the same order
    inter = [dist.new_group(ranks=[row[i] for row in rows]) for i in range(len(rows[0]))]
    node = next(n for n, row in enumerate(rows) if rank in row)
    local = rows[node].index(rank)
    groups = NodeGroups(
        node=node,
        nodes=len(rows),
        local_rank=local,
        local_world_size=len(rows[0]),
        intra_ranks=tuple(rows[node]),
        inter_ranks=tuple(row[local] for row in rows),
        intra=intra[node],
        inter=inter[local],
    )
    _cache = (weakref.ref(world), groups, rows, {})
    return groups


def node_subgroup(size: int, what: str = "node_subgroup") -> Any:
    """The process group of this rank and the ``size`` - 1 ranks beside it on its node (its node's ranks cut,
    by local rank, into runs of ``size``): ``node_groups().intra`` when ``size`` is the ranks per node.
    The first call for a size is collective (every rank makes every such group, in the same order); later
    calls return the same group until the default group is destroyed.

    Raises:
        ValueError: (on every rank alike) ``size`` does not divide the ranks per node; ``what`` names the setting.
    """
    groups = node_groups()
    if size < 1 or groups.local_world_size % size:
        raise ValueError(
            f"{what}={size} must be the number of ranks per node or a divisor of it; this job has "
            f"{plural(groups.nodes, 'node')} of {plural(groups.local_world_size, 'rank')} (LOCAL_WORLD_SIZE)"
        )
    if size == groups.local_world_size:
        return groups.intra
    assert _cache is not None
    made = _cache[3]
    if size not in made:
        rank = dist.get_rank()
        for row in _cache[2]:
            for start in range(0, len(row), size):
                ranks = list(row[start : start + size])
                group = dist.new_group(ranks=ranks)
                if rank in ranks:
                    made[size] = group
    return made[size]
