"""The shared-memory channel of the C++ engine (``csrc/comm/host_channel.h``): when every rank of a group
lives on one host, reduce-scatter and all-gather of CPU tensors go through one shared-memory segment
instead of gloo's loopback sockets (the ``*_shm`` primitives), and so do all-reduces (sum, max, min) of
floating-point and integer tensors: every exchange of the engine then carries the tags that tell ranks out
of step apart.

Whether a group may use it is decided once per engine, at its first exchange that could use it, by
every rank together (collective, on the caller's thread, in the group's order of operations):

- every rank must want it (``ZERO_KERNELS_SHM``, default on) and be on Linux;
- every rank must be on the same node by its launcher's word (``GROUP_RANK``, else the host name):
  nodes emulated on one machine stay apart, so their link is what the exchange crosses;
- rank 0 creates the segment and the others open it by name (which proves they share the host's
  shared memory), and each must see every peer's process alive (a shared process namespace), so a
  peer that dies is told as gloo tells it, by an error naming the rank.

Across nodes (the engine's two-level primitives, ``CppCommEngine.nodes``) each node has a channel of its own,
which its local rank 0 creates and its other ranks open: the level of those primitives within the node goes
through it (the node check above does not apply; everything else does).

Where any of this fails on any rank, every rank keeps the point-to-point primitives; the reason is
logged at INFO. The segment's name is unlinked once every rank has opened it, or when the decision fails:
it lives only as long as the processes that map it, even when they are killed later (the rank that created it
killed during the decision's few exchanges leaves it in /dev/shm).
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import sys
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from .cpp_engine import CppCommEngine

log = logging.getLogger("zero_kernels")

# The point-to-point primitive each shared-memory primitive replaces where the channel is open.
SHM_PRIMITIVES = {"reduce_scatter_p2p": "reduce_scatter_shm", "all_gather_p2p": "all_gather_shm"}
# What the shared-memory reduce-scatter sums (csrc/comm/host_channel.cpp); other dtypes keep the sockets.
SUMMED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# What its all-reduce reduces (sum, max, min); other dtypes (bool) keep the sockets.
REDUCED_DTYPES = SUMMED_DTYPES + (torch.int64, torch.int32, torch.uint8, torch.int8)
# Bytes of the segment's data at most, whatever the group's size: /dev/shm is small in some containers.
SEGMENT_BYTES = 16 << 20
# One destination's region of one half of a rank's slot, at most: a reduce-scatter and an all-gather of 8 MB on
# 2 ranks took 1.6-1.8 ms in chunks of 256 KiB, 2.2 ms in 1 MiB and 2.6-2.7 ms in 2 MiB (benchmarks/RESULTS.md).
CHUNK_BYTES = 256 << 10
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def chunk_bytes(world_size: int) -> int:
    """One destination's region of one half of a rank's slot: ``CHUNK_BYTES``, less where the segment (2 halves
    of ``world_size`` regions per rank) would pass ``SEGMENT_BYTES``; a multiple of 4 KiB."""
    return max(4096, min(CHUNK_BYTES, SEGMENT_BYTES // (2 * world_size * world_size)) // 4096 * 4096)


def _wanted() -> Optional[str]:
    """Why this rank will not use shared memory, or None."""
    from ..env import shared_memory

    if not shared_memory():
        return "ZERO_KERNELS_SHM=0"
    if not sys.platform.startswith("linux"):
        return f"not on Linux ({sys.platform})"
    return None


def _timeout(engine: "CppCommEngine") -> datetime.timedelta:
    """The process group's timeout, which bounds every wait for a peer as it bounds gloo's."""
    try:
        return engine.group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return DEFAULT_TIMEOUT


def open_channel(engine: "CppCommEngine") -> bool:
    """Open ``engine``'s shared-memory channel where every rank of its group can (module docstring): True
    on every rank alike, or False on every rank. Collective."""
    from .groups import _where
    from .objects import all_gather_objects

    name = f"/zero_kernels-{os.getpid()}-{secrets.token_hex(8)}"
    creator = _creator(engine)
    chunk = chunk_bytes(engine.world_size if engine.nodes is None else len(engine.nodes[0]))
    timeout_ms = int(_timeout(engine).total_seconds() * 1000)
    creates = engine.rank == creator and _wanted() is None
    created = name if creates and _attach(engine, name, True, chunk, timeout_ms) else None
    try:  # from here on the name is removed whatever fails (a peer that died before the handshake: it stayed)
        facts = all_gather_objects(engine, (_wanted(), _where()[0], created), name="shared_memory.facts")
        reason = _refusal(facts, [_creator(engine, r) for r in range(engine.world_size)], engine.nodes is None)
        opened = reason is None and (
            engine.rank == creator or _attach(engine, facts[creator][2], False, chunk, timeout_ms)
        )
        everyone = all_gather_objects(engine, opened, name="shared_memory.opened")
    except BaseException:
        engine._engine.close_host_channel()
        raise
    finally:
        if created is not None:
            engine._engine.unlink_host_channel(created)
    if reason is None and not all(everyone):
        reason = "a rank could not open the segment (see that rank's log)"
    if reason is None:
        visible = all_gather_objects(engine, engine._engine.host_channel_peers_visible(), name="shared_memory.peers")
        if not all(visible):
            reason = "a rank cannot see its peers' processes (another process namespace)"
    if reason is not None:
        engine._engine.close_host_channel()
        log.info("zero_kernels comm: rank %d keeps gloo's sockets for this group: %s", engine.rank, reason)
        return False
    if engine.nodes is not None:
        engine._engine.use_node_channel()
    log.info("zero_kernels comm: rank %d exchanges through shared memory (chunks of %d bytes)", engine.rank, chunk)
    return True


def _creator(engine: "CppCommEngine", rank: Optional[int] = None) -> int:
    """The rank that creates the segment ``rank`` (default: this one) opens: rank 0, or its node's local rank 0."""
    rank = engine.rank if rank is None else rank
    if engine.nodes is None:
        return 0
    return next(row[0] for row in engine.nodes if rank in row)


def _refusal(facts: list, creators: list[int], one_node: bool) -> Optional[str]:
    """Why the ranks (their ``(unwanted, node, segment)`` facts, in rank order; ``creators``: the rank whose
    segment each opens) cannot share memory, or None; ``one_node``: the channel is the whole group's."""
    for rank, (unwanted, _, _) in enumerate(facts):
        if unwanted is not None:
            return f"rank {rank}: {unwanted}"
    nodes = {node for _, node, _ in facts}
    if one_node and len(nodes) > 1:
        return f"the ranks are on {len(nodes)} nodes"
    for creator in sorted(set(creators)):
        if facts[creator][2] is None:
            return f"rank {creator} could not create the segment (see its log)"
    return None


def _attach(engine: "CppCommEngine", name: str, create: bool, chunk: int, timeout_ms: int) -> bool:
    """Create (``create``) or open the segment ``name`` as ``engine``'s channel; False, said at INFO, where it
    cannot."""
    try:
        engine._engine.open_host_channel(name, create, chunk, timeout_ms)
    except (RuntimeError, ValueError) as exc:
        how = "create a" if create else "open the"
        log.info("zero_kernels comm: rank %d could not %s shared-memory segment: %s", engine.rank, how, exc)
        return False
    return True
