"""Start N gloo ranks on a free loopback port and run a picklable function on each.

Ranks are forked from one server process that imported torch and the package, and loaded the C++
extensions, once for the session (``multiprocessing``'s ``forkserver``, ``PRELOAD``): a rank does not import
torch again. It starts from that server's state, never from the test process's, with the test process's
environment variables at the time of the call, as a spawned interpreter would have them (the extensions
were loaded as the settings were when the server started: the first start of ranks of the session).

Every rank runs under the collective-order audit (``tests.helpers.audit``): after every optimizer step its ranks
check that they issued the same collectives in the same order.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import socket
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import end_rank


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every rank imports, once, in the server the ranks are forked from (``tests.helpers.audit`` imports the package;
# ``torch.optim.Optimizer``'s constructor imports ``torch._dynamo``; ``tests.helpers.preload`` loads the C++
# extensions, each load a run of ninja: done in each rank instead, they cost seconds of CPU per start of ranks).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "tests.helpers.audit", "tests.helpers.preload"]


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    timeout_s: float,
    args: tuple,
    environ: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    from tests.helpers import audit  # imports zero_kernels: in the ranks only

    audit.install()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    end_rank()  # the test's outcome is decided in fn


def _prebuild_extensions() -> None:
    """Build, in the parent, the C++ extensions the ranks will load, so that they load from the cache.

    Without this every rank would race to build the same extension on first use.
    """
    from zero_kernels import _ext
    from zero_kernels.env import settings

    env = settings()
    if env.impl in ("auto", "cpu"):
        _ext.available("ops")
    if env.comm in ("auto", "cpp"):
        _ext.available("comm")


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; re-raises a rank's failure.

    ``fn`` must be a module-level function (it is pickled into the ranks). Starting ranks costs a rendezvous
    and the set-up of their process group (the first call of a session also starts the fork server, which
    imports torch): run many checks inside one call.
    """
    _prebuild_extensions()
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), timeout_s, args, dict(os.environ)),
        nprocs=world_size,
        join=True,
        start_method="forkserver",
    )


@contextlib.contextmanager
def watchdog(seconds: float) -> Iterator[None]:
    """Inside, a rank that is still there after ``seconds`` dumps its threads' stacks and exits: a test of a hang
    that came back fails instead of waiting for the process group's timeout."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def run_cases(rank: int, world_size: int, cases: list[tuple[str, Callable[..., Any], tuple]]) -> None:
    """Run ``case(rank, world_size, *args)`` for each ``(name, case, args)`` in order, on ranks already started
    (the ``fn`` of one ``run_ranks``: one spawn for several cases); a failure names its case."""
    for name, case, args in cases:
        try:
            case(rank, world_size, *args)
        except AssertionError as e:
            raise AssertionError(f"case {name!r}, rank {rank}: {e}") from e


def _report(rank: int, world_size: int, fn: Callable[..., list[str]], out: str, *args: Any) -> None:
    Path(out, str(rank)).write_text("\n".join(fn(rank, world_size, *args)) or "ok")


def run_ranks_checked(fn: Callable[..., list[str]], world_size: int, *args: Any, timeout_s: float = 120.0) -> None:
    """Run ``fn(rank, world_size, *args)``, which returns what it found wrong, on gloo ranks; assert that no
    rank found anything (every rank's findings are shown)."""
    with tempfile.TemporaryDirectory() as out:
        run_ranks(_report, world_size, fn, out, *args, timeout_s=timeout_s)
        results = {rank: Path(out, str(rank)).read_text() for rank in range(world_size)}
    assert all(r == "ok" for r in results.values()), results
