"""Two emulated nodes of two ranks each (``benchmarks.netns``): ``torchrun --nnodes 2`` in two network
namespaces joined by a veth pair, no rate limit. Every stage trains in lock-step with single-process
``torch.optim.AdamW`` across the node boundary, and the node groups built from torchrun's environment
(``zero_kernels.comm_groups``) hold the right ranks, keep intra-node traffic off the link and add up
to the flat all-reduce. Needs root (network namespaces); skipped with the reason elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from zero_kernels.comm_groups import grid


@pytest.mark.distributed
@pytest.mark.netns
def test_stages_on_two_nodes_match_torch_adamw(two_nodes: Path) -> None:
    """The checks of ``_multinode_worker.py``, in the two-node job."""
    results = {rank: (two_nodes / "node_groups" / str(rank)).read_text() for rank in range(4)}
    assert all(r == "ok" for r in results.values()), results


def test_grid_orders_nodes_and_local_ranks() -> None:
    places = [("node 1", 1, 2), ("node 0", 0, 2), ("node 1", 0, 2), ("node 0", 1, 2)]
    assert grid(places) == [[2, 0], [1, 3]]  # nodes by their lowest rank; ranks by LOCAL_RANK
    assert grid([("host a", None, None), ("host b", None, None)] * 2) == [[0, 2], [1, 3]]


@pytest.mark.parametrize(
    "places, words",
    [
        ([("node 0", 0, 2), ("node 0", 1, 2), ("node 1", 0, 2)], "LOCAL_WORLD_SIZE=2 each"),
        ([("node 0", 0, 2), ("node 0", 1, 3)], "disagree on LOCAL_WORLD_SIZE"),
        ([("node 0", 0, 2), ("node 0", 0, 2)], "not 0..1"),
        ([("host a", None, None), ("host a", None, None), ("host b", None, None)], "equal sizes"),
    ],
    ids=["short node", "sizes disagree", "local rank twice", "unequal hosts"],
)
def test_grid_names_what_is_irregular(places, words) -> None:
    with pytest.raises(ValueError, match=words):
        grid(places)
