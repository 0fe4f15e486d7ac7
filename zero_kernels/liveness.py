"""Whether a process of this host still runs: what a process left behind (a build lock, a directory of offloaded
state, a network namespace) is removed once its owner is gone, never while it runs."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (also when another user owns it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True
