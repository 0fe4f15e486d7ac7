"""Run a worker script under torchrun on two emulated nodes of two ranks each (``benchmarks.netns``)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from benchmarks import netns
from tests.helpers.dist import _prebuild_extensions
from tests.helpers.paths import pythonpath


@contextlib.contextmanager
def ran_on_two_nodes(worker: Path, *, timeout_s: float = 240) -> Iterator[Path]:
    """Run ``worker OUT`` on two emulated nodes joined by an unlimited link (the C++ extensions built first),
    then yield OUT, the folder its ranks wrote to (removed on exit). Skips the test, with the reason, where
    emulated nodes cannot be made (they need root)."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    _prebuild_extensions()
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    with tempfile.TemporaryDirectory() as out:
        with netns.emulated_nodes() as nodes:
            netns.torchrun_on_nodes(nodes, [str(worker), out], env=env, timeout_s=timeout_s)
        yield Path(out)
