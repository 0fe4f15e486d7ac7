"""The two-node job: worker modules under torchrun on two emulated nodes of two ranks each (``benchmarks.netns``).

Making the nodes and starting four fresh interpreters costs more than most checks run in them, so every test
that needs two nodes reads its results from one job (the session fixture ``two_nodes`` of ``conftest.py``):
each worker module of ``_two_nodes_worker.WORKERS`` runs in turn, in one gloo group, and writes to its own folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks import netns
from tests.helpers.dist import _prebuild_extensions
from tests.helpers.paths import pythonpath

WORKER = Path(__file__).resolve().parent / "_two_nodes_worker.py"


def run_on_two_nodes(out: Path, *, timeout_s: float = 400) -> Path:
    """Run every worker of ``_two_nodes_worker.WORKERS`` on two emulated nodes joined by an unlimited link (the
    C++ extensions built first); return ``out``, which holds a folder per worker. Skips, with the reason, where
    emulated nodes cannot be made (they need root)."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    _prebuild_extensions()
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    with netns.emulated_nodes() as nodes:
        netns.torchrun_on_nodes(nodes, [str(WORKER), str(out)], env=env, timeout_s=timeout_s)
    return out
