"""Whether a process of this host still runs: what a process left behind (a build lock, a directory of offloaded
state, a network namespace) is removed once its owner is gone, never while it runs.

Two tests. ``process_alive`` asks whether a pid names a process; a pid recorded by a process of another PID
namespace (a container sharing the host's name) names none here, or another one. ``try_lock`` takes an exclusive
``flock`` without waiting: the kernel releases one when its holder closes it or ends however (SIGKILL too), so a
lock that is held always belongs to a live process, in whatever PID namespace it runs.
"""

from __future__ import annotations

import os
from typing import Optional

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (also when another user owns it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def try_lock(fd: int) -> Optional[bool]:
    """Take an exclusive ``flock`` on open file ``fd`` without waiting: True when taken (held until ``fd`` is
    closed), False when another open file holds it, None when locks cannot be taken here (no ``fcntl``, or a file
    system without ``flock``)."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # ENOLCK, ENOSYS, EOPNOTSUPP: the file system does not lock
        return None
    return True
