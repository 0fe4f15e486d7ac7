"""One just-in-time build per extension at a time, and never a wait on a build that is no longer running.

torch's ``cpp_extension.load`` guards a build directory with a bare ``lock`` file (``FileBaton``:
created with ``O_EXCL``, removed when the build ends, no owner recorded) and waits for it silently
and without limit. A build that is killed leaves it behind, and every later process would wait
forever. So zero_kernels first takes its own lock, ``zero_kernels.lock`` beside torch's:

- an ``fcntl.flock``, which the kernel releases when its holder exits or is killed: a held lock
  always belongs to a live process. Loading a build that is up to date takes it shared, so the
  ranks of a launch load the cached build side by side without waiting for each other; a build
  (or a leftover torch lock to judge) takes it exclusive, once no process is loading;
- the exclusive holder writes ``pid host start-time`` into the file and clears it when done, so a
  record found by the next holder names a build that was interrupted;
- a waiter says at WARNING which process it waits for, how long that one has been building and how
  long it has itself waited, once it has waited ``FIRST_WAIT_LOG_S`` (a short wait says nothing),
  then every minute;
- once a process holds the lock, torch's ``lock`` is judged by its owner: with no record left
  (the last build finished) or a recorded process of this host that is gone, it is removed with a
  warning. A recorded pid of this host that names a running process is no proof (the pid reused, or
  recorded in another PID namespace: a build killed in a container as pid 1): where a second open of
  the lock file cannot take the lock while this process holds it (the file system's locks work), the
  recorded build no longer holds it, so it was interrupted and the file is removed; otherwise it is
  waited for. One on another host, whose liveness cannot be checked, is waited for until the file is
  ``STALE_LOCK_S`` old.

Without ``fcntl`` (Windows) only that age rule applies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from typing import Callable, Iterator, Optional

from ..liveness import process_alive

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

log = logging.getLogger("zero_kernels")

LOCK_NAME = "zero_kernels.lock"
TORCH_LOCK_NAME = "lock"
# torch's lock with an owner that cannot be checked (another host, no fcntl) is stale after this long.
STALE_LOCK_S = 20 * 60
FIRST_WAIT_LOG_S = 5.0  # a waiter says so once it has waited this long
WAIT_LOG_S = 60.0  # then repeats its message this often
POLL_S = 0.25
BUILD_TIME = "1-6 minutes on 2 CPU cores"


def _record() -> str:
    return f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n"


def _parse(record: str) -> Optional[tuple[int, str, float]]:
    parts = record.split()
    try:
        return int(parts[0]), parts[1], float(parts[2])
    except (IndexError, ValueError):
        return None


def _describe(holder: Optional[tuple[int, str, float]]) -> str:
    if holder is None:
        return "another process"
    pid, host, _ = holder
    return f"process {pid}" + ("" if host == socket.gethostname() else f" on {host}")


def alive(holder: Optional[tuple[int, str, float]]) -> Optional[bool]:
    """Whether the recorded holder still runs: None when that cannot be told (no record, another host)."""
    if holder is None or holder[1] != socket.gethostname():
        return None
    return process_alive(holder[0])


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 256).decode(errors="replace")


def _age(holder: tuple[int, str, float]) -> float:
    """Seconds since the holder started (never negative: the record's clock is rounded to the second)."""
    return max(0.0, time.time() - holder[2])


def _wait_for_flock(fd: int, path: str, what: str, mode: int) -> None:
    """Take the flock on ``fd`` in ``mode``; past ``FIRST_WAIT_LOG_S`` say at WARNING whom this process waits
    for, then every ``WAIT_LOG_S``."""
    start = time.monotonic()
    next_log = start + FIRST_WAIT_LOG_S
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        now = time.monotonic()
        if now >= next_log:
            holder = _parse(_read(fd))
            since = "" if holder is None else f", which has been building it for {_age(holder):.0f} s"
            log.warning(
                "zero_kernels: waiting for %s to finish building %s%s; waited %.0f s so far (lock %s; a build "
                "usually takes %s)",
                _describe(holder),
                what,
                since,
                now - start,
                path,
                BUILD_TIME,
            )
            next_log = now + WAIT_LOG_S
        time.sleep(POLL_S)


def _excludes(path: str) -> bool:
    """Whether the file system's flocks exclude: while this process holds ``path``'s lock exclusive, another open
    file of it cannot take it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no flock on this file system
        return False
    finally:
        os.close(fd)
    return False


def _stale_because(previous: Optional[tuple[int, str, float]], age: float, excludes: bool = False) -> Optional[str]:
    """Why torch's lock belongs to no running build, or None when its owner may still be building; ``excludes``:
    the zero_kernels lock, held by this process, is shown to exclude others (``_excludes``)."""
    if fcntl is not None and previous is None:
        return "no build is running: every build holds the zero_kernels lock, and the last one finished"
    state = alive(previous)
    if state is False:
        return f"{_describe(previous)} was interrupted and is no longer running"
    if state is True and excludes:
        return (
            f"{_describe(previous)} was interrupted: it no longer holds the zero_kernels lock (a process with its "
            "pid runs here: the pid reused, or recorded in another PID namespace)"
        )
    if state is None and age > STALE_LOCK_S:
        return f"it is {age / 60:.0f} min old and its owner cannot be checked from here"
    return None


def _clear_torch_lock(
    directory: str, previous: Optional[tuple[int, str, float]], what: str, excludes: bool = False
) -> None:
    """Remove torch's lock when no running build owns it; wait while its owner may still be building
    (``excludes``: as for ``_stale_because``)."""
    lock = os.path.join(directory, TORCH_LOCK_NAME)
    warned = False
    while True:
        try:
            age = time.time() - os.path.getmtime(lock)
        except FileNotFoundError:
            return
        reason = _stale_because(previous, age, excludes)
        if reason is not None:
            log.warning("zero_kernels: removing the build lock %s of %s: %s", lock, what, reason)
            with contextlib.suppress(FileNotFoundError):
                os.remove(lock)
            return
        if not warned:
            log.warning(
                "zero_kernels: waiting for %s, which holds the build lock %s of %s", _describe(previous), lock, what
            )
            warned = True
        time.sleep(POLL_S)


@contextlib.contextmanager
def hold(directory: str, what: str, needs_build: Optional[Callable[[], bool]] = None) -> Iterator[bool]:
    """Hold the build lock of ``directory`` (an extension's build directory) for the block.

    Yields whether a build is needed. When ``needs_build()`` says none is (the cached build is up to
    date) and torch's lock is absent, the lock is held shared: other loaders do not wait. Otherwise
    it is held exclusive, and ``needs_build()`` is asked again once held (another process may have
    built meanwhile).

    Args:
        directory: the build directory (created if missing).
        what: the extension, for messages (e.g. "extension 'ops'").
        needs_build: whether the extension must be (re)built; None: always (exclusive).
    """
    needs_build = needs_build if needs_build is not None else (lambda: True)
    os.makedirs(directory, exist_ok=True)
    if fcntl is None:
        _clear_torch_lock(directory, None, what)
        yield needs_build()
        return
    path = os.path.join(directory, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _wait_for_flock(fd, path, what, fcntl.LOCK_SH)
        if not os.path.exists(os.path.join(directory, TORCH_LOCK_NAME)) and not needs_build():
            yield False
            return
        fcntl.flock(fd, fcntl.LOCK_UN)
        _wait_for_flock(fd, path, what, fcntl.LOCK_EX)
        previous = _parse(_read(fd))
        os.ftruncate(fd, 0)
        os.pwrite(fd, _record().encode(), 0)
        _clear_torch_lock(directory, previous, what, _excludes(path))
        try:
            yield needs_build()
        finally:
            os.ftruncate(fd, 0)  # a record left behind marks an interrupted build
    finally:
        os.close(fd)  # releases the flock
