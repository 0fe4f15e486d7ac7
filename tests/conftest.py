"""Shared test plumbing: seeds, hardware markers, interpreter set-up, rank spawning."""

from __future__ import annotations

import os
import random

import pytest
import torch

# The Triton kernels run on the CPU through the interpreter; it must be chosen before import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _dist import run_ranks  # noqa: E402


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def spawn():
    """``spawn(fn, world_size, *args)`` runs a module-level ``fn(rank, world_size, *args)`` on gloo ranks."""
    return run_ranks


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
