"""Which c10d primitive carries out each operation, per backend and bucket size, and the error every
operation raises.

Each operation is carried out by the fastest correct c10d primitive for its backend and size, as
measured by ``python -m benchmarks comm`` (``PRIMITIVES``); ``primitive=`` overrides the choice.
"""

from __future__ import annotations

import os
from typing import Optional

import torch.distributed as dist

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

REDUCE_SCATTER_PRIMITIVES = ("all_reduce_slice", "reduce_scatter_list", "reduce_scatter_tensor", "reduce_scatter_p2p")
ALL_GATHER_PRIMITIVES = ("all_gather_list", "all_gather_tensor", "all_gather_p2p")
# The *_p2p primitives are sends and receives between every pair of ranks (CPU tensors only): each
# chunk crosses one link once, which on gloo beats its collectives (see PRIMITIVES). Their tags come
# from a range of their own, one per operation in issue order and kind (``P2P_KINDS``: a reduce-scatter that meets
# a peer's all-gather of the same size waits for its own tag, and fails at the group's timeout, instead of taking
# the all-gather's bytes).
P2P_TAG_BASE, P2P_TAG_SPAN = 1 << 30, 1 << 29
P2P_KINDS = ("reduce_scatter", "all_gather")
# Across nodes (``LOCAL_WORLD_SIZE`` below the world size, more than one rank per node) the C++ engine
# runs the point-to-point forms in two levels along the nodes: a reduce-scatter first sums within each
# node and then sends each node's sums across, an all-gather crosses first and then fans out within the
# node. A node's link then carries (M-1)/M of the buffer each way (M nodes) instead of L(N-L)/N (L ranks
# per node, N ranks): half instead of all of it at 2 nodes of 2 ranks, where gloo's ring carries 3/4.
NODES_PRIMITIVES = {"reduce_scatter_p2p": "reduce_scatter_nodes", "all_gather_p2p": "all_gather_nodes"}
# A sum all-reduce of at least this many bytes runs as those two, one after the other (stage 0's buckets): a node's
# link carries 2(M-1)/M of it each way, against 3/2 for gloo's ring at 2 x 2. Smaller ones (norms, flags: a few
# messages either way) keep gloo's all-reduce.
NODES_ALL_REDUCE_BYTES = 1 << 16
MAX_HELD = 16  # operations an engine holds at most (the C++ engine's Engine::kMaxHeld)

# (backend, operation) -> rows (largest bucket in bytes or None for any size, primitive); the first
# row whose bound holds wins. The gloo rows come from `python -m benchmarks comm --full` and a probe
# on 2 and 3 ranks (256 KiB to 16 MiB) on a 2-core machine: the point-to-point forms were the
# fastest at every size (reduce-scatter 1.3x to 12x faster than all_reduce + slice, which beat
# gloo's own reduce_scatter; all-gather 1.06x to 2x faster than the better collective form). CUDA
# tensors on gloo use DEFAULT_PRIMITIVES, as do backends not listed.
PRIMITIVES: dict[tuple[str, str], list[tuple[Optional[int], str]]] = {
    ("gloo", "reduce_scatter"): [(None, "reduce_scatter_p2p")],
    ("gloo", "all_gather"): [(None, "all_gather_p2p")],
}
DEFAULT_PRIMITIVES = {"reduce_scatter": "reduce_scatter_tensor", "all_gather": "all_gather_tensor"}
# The C++ engine replaces the *_p2p rows by its shared-memory primitives where every rank of the group is
# on one host (``shared_memory.SHM_PRIMITIVES``), and by the two-level ones across nodes (``NODES_PRIMITIVES``).

# torch >= 2.13 names the flat collectives *_single and deprecates the older names.
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CommError(RuntimeError):
    """A collective failed or timed out; the message names the operation, bucket and rank."""


def forked_message(what: str, pid: int) -> str:
    """Why a collective cannot run, or be waited for, in a process forked from the one that runs the engine (process
    ``pid``)."""
    return (
        f"{what}: called in process {os.getpid()}, a child forked from process {pid}, which runs this optimizer "
        "(a DataLoader worker, a multiprocessing.Process): the other ranks are not in it, and the collective "
        "would wait for ever. Run the model (at stage 3 its forward all-gathers the parameters), backward and "
        "step() in the training process only; to use the model in a worker, give it a copy made inside "
        "opt.gathered_params() (copy.deepcopy(model) there is a plain module with the full weights)"
    )


def choose_primitive(backend: str, operation: str, nbytes: int) -> str:
    """The c10d primitive that carries out ``operation`` ("reduce_scatter" or "all_gather")."""
    for bound, primitive in PRIMITIVES.get((backend, operation), []):
        if bound is None or nbytes <= bound:
            return primitive
    return DEFAULT_PRIMITIVES[operation]


def describe_choices(backend: str) -> str:
    parts = []
    for operation in DEFAULT_PRIMITIVES:
        rows = PRIMITIVES.get((backend, operation), [(None, DEFAULT_PRIMITIVES[operation])])
        parts.append(f"{operation}=" + ",".join(p if b is None else f"{p}(<={b}B)" for b, p in rows))
    return " ".join(parts)
