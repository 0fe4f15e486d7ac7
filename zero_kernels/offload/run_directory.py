"""This rank's run directory under ``nvme_path``, from its start to its removal, and the disk space reserved in it.

Files. ``<nvme_path>/zero_kernels/<run>/rank<R>``, ``<run>`` being ``<host>-<pid>-<token>``; its owner holds an
exclusive ``flock`` on ``<run>/owner.lock`` while it lives (``RunDirectory``). A new run first removes the run
directories of this host whose owner is gone (a killed run's files): those whose lock it can take, never one whose
lock is held (a run in another PID namespace, whose pid means nothing here, included); a directory without the lock
file (an older version's) by its pid. Its own directory is removed by ``remove`` or, at the latest, when the object
is collected, the interpreter exits or a process multiprocessing started ends (finalizers); the kernel releases the
lock when the process ends, however. ``<nvme_path>/zero_kernels`` goes with the last run in it (only when empty:
``nvme_path`` itself and anything else in it stay).

Start. ``nvme_path`` is made absolute (``~`` expanded) against the working directory at start, so a later
``os.chdir`` moves nothing. The constructor makes its directory and writes, reads back and removes a small file: a
missing or unwritable ``nvme_path`` raises ``OSError`` naming it and the config key before anything else is set up.
``reserve`` makes a file with its bytes reserved on the disk (``allocate``: ``posix_fallocate`` where the file
system has it), so a disk without room fails there, naming the path and the bytes it needed.

The disk tier's state files (``disk``), stage 3's parameter shards (``param_files``) and its gradient shards
(``stages.stage3.disk_grads``, in the disk tier's directory) live in such directories.
"""

from __future__ import annotations

import multiprocessing.util
import os
import shutil
import socket
import uuid
import weakref
from pathlib import Path
from typing import Optional

from ..liveness import process_alive, try_lock

_PROBE_BYTES = 4096
OWNER_LOCK = "owner.lock"  # in each run directory, locked by its owner while it lives


def remove_stale_runs(base: Path) -> list[Path]:
    """Remove the run directories under ``base`` of this host whose owner is gone; returns them."""
    host = socket.gethostname()
    removed = []
    try:
        runs = list(base.iterdir()) if base.is_dir() else []
    except FileNotFoundError:  # removed just now by the last run out (``_remove_run``)
        runs = []
    for run in runs:
        name, _, _ = run.name.rpartition("-")
        owner, _, pid = name.rpartition("-")
        if owner == host and pid.isdigit() and run.is_dir() and _remove_if_gone(run, int(pid)):
            removed.append(run)
    return removed


def _remove_if_gone(run: Path, pid: int) -> bool:
    """Remove run directory ``run`` if its owner is gone: its lock free (taken, and held while the files go), or,
    without a lock to take (a directory of an older version, a file system without ``flock``), process ``pid``
    gone. Returns whether it was removed."""
    try:
        fd: Optional[int] = os.open(run / OWNER_LOCK, os.O_RDONLY)
    except FileNotFoundError:
        fd = None
    except OSError:  # not ours to judge (another user's)
        return False
    try:
        taken = None if fd is None else try_lock(fd)
        if taken is False or (taken is None and process_alive(pid)) or not run.is_dir():
            return False
        shutil.rmtree(run, ignore_errors=True)
        return True
    finally:
        if fd is not None:
            os.close(fd)


def _make_run(run: Path) -> Optional[int]:
    """Make directory ``run`` with its owner lock held; returns the lock's descriptor (None where locks cannot be
    taken: the directory has no lock file, and its pid is all that tells its owner). It is made under a name no
    cleaner reads (``.new-<run>``) and renamed once locked: a run directory is never seen without its lock."""
    fresh = run.with_name(f".new-{run.name}")
    _make_fresh(fresh)
    try:
        fd: Optional[int] = os.open(fresh / OWNER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        if not try_lock(fd):  # None: no locks here (False cannot be: nobody else knows the file)
            os.close(fd)
            (fresh / OWNER_LOCK).unlink()
            fd = None
        fresh.rename(run)
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    return fd


def _make_fresh(fresh: Path, tries: int = 3) -> None:
    """``fresh.mkdir(parents=True)``, again if its parent went in between (``_remove_run`` of another process)."""
    for attempt in range(tries):
        try:
            fresh.mkdir(parents=True)
            return
        except FileNotFoundError:
            if attempt == tries - 1:
                raise


def _remove_run(run: str, fd: Optional[int], owner: int) -> None:
    """Remove a run directory, then release its lock. The ``zero_kernels`` directory it is in goes too once empty
    (the last run out removes it: ``os.rmdir`` takes only an empty directory, never another run's). In a process
    forked from the ``owner`` pid (``os.fork()``: the child shares the lock and runs this finalizer at its exit or
    when it drops its copy) nothing is removed: the directory is the parent's; only the child's copy of the lock's
    descriptor is closed, which leaves the parent's lock held."""
    if os.getpid() != owner:
        if fd is not None:
            os.close(fd)
        return
    try:
        shutil.rmtree(run, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(run))
        except OSError:  # another run's directory is there, or it is gone already
            pass
    finally:
        if fd is not None:
            os.close(fd)


def probe(directory: Path, given: str, key: str = "offload_optimizer.nvme_path") -> None:
    """Create ``directory`` and write, read back and remove a small file in it; raise ``OSError`` naming it and
    ``given`` (the ``nvme_path`` it is under, ``key`` in the config)."""
    path = directory / ".probe"
    data = os.urandom(_PROBE_BYTES)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        if path.read_bytes() != data:
            raise OSError(5, "a file written there did not read back the same")
        path.unlink()
    except OSError as err:
        raise _unwritable(err, directory, given, key) from None


def _unwritable(err: OSError, directory: Path, given: str, key: str) -> OSError:
    return OSError(
        err.errno, f"{key}={given!r}: cannot write and read back files in {str(directory)!r}: {err.strerror or err}"
    )


def absolute(nvme_path: str, key: str) -> Path:
    """``nvme_path`` as an absolute path (``~`` expanded, from the working directory now); ``OSError`` naming
    ``key`` when it is not an existing directory."""
    root = Path(os.path.abspath(os.path.expanduser(nvme_path)))
    if not root.is_dir():
        resolved = "" if str(root) == nvme_path else f"; from the working directory {os.getcwd()!r}: {str(root)!r}"
        raise OSError(2, f"{key}={nvme_path!r} is not a directory (it must exist{resolved})")
    return root


def allocate(path: "Path | str", nbytes: int) -> None:
    """Make file ``path`` hold ``nbytes`` whose blocks exist on the disk (``posix_fallocate`` where the file system
    has it), so that writing them allocates nothing and a disk without room fails here. An empty file (a unit
    of zero-element parameters) reserves nothing: ``posix_fallocate`` refuses a length of 0."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if hasattr(os, "posix_fallocate") and nbytes > 0:
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


class RunDirectory:
    """This rank's scratch directory under ``nvme_path``: ``<nvme_path>/zero_kernels/<host>-<pid>-<token>/rank<R>``.

    The constructor makes ``nvme_path`` absolute and checks that it is a directory (``absolute``), removes the run
    directories of this host whose owner is gone (``remove_stale_runs``), makes its own holding its lock
    (``OWNER_LOCK``) and probes it (``probe``): every error is an ``OSError`` naming ``key`` and the path.
    ``remove`` (or, at the latest, the collection of the object or the interpreter's exit) removes the run and
    releases its lock.
    """

    def __init__(self, nvme_path: str, key: str, rank: int):
        base = absolute(nvme_path, key) / "zero_kernels"
        remove_stale_runs(base)
        self.run = base / f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.root = self.run / f"rank{rank}"
        self.key = key
        try:
            lock = _make_run(self.run)
        except OSError as err:
            raise _unwritable(err, base, nvme_path, key) from None
        self._finalizer = weakref.finalize(self, _remove_run, str(self.run), lock, os.getpid())
        # also where a process multiprocessing forked ends (os._exit: no interpreter exit runs weakref's finalizers;
        # Accelerate's notebook_launcher starts its ranks so)
        multiprocessing.util.Finalize(self, self._finalizer, exitpriority=0)
        try:
            probe(self.root, nvme_path, key)
        except OSError:
            self.remove()
            raise

    def reserve(self, path: Path, nbytes: int, needed: str) -> None:
        """Make file ``path`` with ``nbytes`` reserved on the disk; a disk without room raises ``OSError`` naming
        the key, the path and ``needed`` (what the caller needs in all, in words)."""
        try:
            allocate(path, nbytes)
        except OSError as err:
            raise OSError(
                err.errno,
                f"{self.key}: cannot reserve {nbytes} bytes in {str(path)!r} ({needed}): {err.strerror or err}",
            ) from None

    def disk_bytes(self) -> int:
        """Bytes of the files in this rank's directory."""
        if not self.root.is_dir():
            return 0
        return sum(p.stat().st_size for p in self.root.iterdir() if p.name != ".probe")

    def remove(self) -> None:
        self._finalizer()
