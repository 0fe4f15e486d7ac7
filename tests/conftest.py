"""Shared test plumbing: seeds, hardware markers, interpreter set-up, rank spawning, the tiers' rules.

Tiers (tests/README.md): a test that starts ranks (``torch.multiprocessing.spawn``, torchrun on emulated
nodes) must be marked ``distributed``: unmarked, the spawn raises. A test that runs a compiler is marked
``ext``; cases parametrized with the C++ kernels (``impl="cpu"``) or the C++ comm engine
(``backend="cpp"``) get the mark here. A run that deselects ``ext`` tests (``-m "not ext"``) sets
``ZERO_KERNELS_NO_JIT=1``, so nothing it selected compiles or loads the extension behind its back: a
test that needs it and is not marked fails there.
"""

from __future__ import annotations

import functools
import os
import random
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch

# The Triton kernels run on the CPU through the interpreter; it must be chosen before import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers.dist import run_ranks  # noqa: E402
from tests.helpers.nodes import run_on_two_nodes  # noqa: E402


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def spawn():
    """``spawn(fn, world_size, *args)`` runs a module-level ``fn(rank, world_size, *args)`` on gloo ranks."""
    return run_ranks


@pytest.fixture(scope="session")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the two-node job (``tests.helpers.nodes``), run once for every test that reads it."""
    return run_on_two_nodes(tmp_path_factory.mktemp("two_nodes"))


EXT_PARAMS = {"impl": "cpu", "backend": "cpp"}  # parameters whose value runs the C++ extension


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        params = getattr(item, "callspec", None)
        if params is not None and any(params.params.get(k) == v for k, v in EXT_PARAMS.items()):
            item.add_marker(pytest.mark.ext)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


_deselected_ext = False


def pytest_deselected(items: list[pytest.Item]) -> None:
    global _deselected_ext
    _deselected_ext = _deselected_ext or any(item.get_closest_marker("ext") for item in items)


def pytest_collection_finish(session: pytest.Session) -> None:
    if _deselected_ext and not any(item.get_closest_marker("ext") for item in session.items):
        os.environ["ZERO_KERNELS_NO_JIT"] = "1"


_spawn_allowed = True  # outside a test (collection), and inside a test marked distributed


def _guarded(start: Callable[..., Any]) -> Callable[..., Any]:
    """``start`` (a way to start ranks), raising unless the running test is marked ``distributed``."""

    @functools.wraps(start)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if not _spawn_allowed:
            raise AssertionError("this test starts ranks: mark it @pytest.mark.distributed (tests/README.md, tiers)")
        return start(*args, **kwargs)

    guarded.tiers_guard = True  # type: ignore[attr-defined]
    return guarded


def _guard(module: Any, name: str) -> None:
    """Wrap ``module.name`` once, for the session (a test's own monkeypatch of it restores the wrapper)."""
    if not getattr(getattr(module, name), "tiers_guard", False):
        setattr(module, name, _guarded(getattr(module, name)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Optional[pytest.Item]) -> Iterator[None]:
    """While ``item`` sets up (module fixtures it needs count as its own), runs and tears down, starting
    ranks raises unless it is marked ``distributed``."""
    global _spawn_allowed
    _guard(torch.multiprocessing, "spawn")
    _guard(torch.multiprocessing, "start_processes")
    netns = sys.modules.get("benchmarks.netns")
    if netns is not None:
        _guard(netns, "torchrun_on_nodes")
    _spawn_allowed = item.get_closest_marker("distributed") is not None
    try:
        yield
    finally:
        _spawn_allowed = True
