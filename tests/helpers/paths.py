"""Where things are, for tests that read files or start subprocesses (wherever the test file lives)."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent  # the checkout: README.md, benchmarks/, examples/, csrc/
DATA = TESTS / "data"


def pythonpath(*first: Path) -> str:
    """A PYTHONPATH that makes ``tests.*``, ``benchmarks.*`` and this checkout's ``zero_kernels`` importable in a
    subprocess, after ``first`` and before the inherited one."""
    return os.pathsep.join(filter(None, [*map(str, first), str(ROOT), os.environ.get("PYTHONPATH")]))
