"""The CMake build of the C++ kernels and its ctest suite (csrc/tests), run as CI would run them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch.utils

from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.ext, pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")]


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"


def test_cmake_build_and_ctest(tmp_path: Path) -> None:
    build = str(tmp_path / "cmake")
    _run(["cmake", "-S", str(ROOT), "-B", build, f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"])
    _run(["cmake", "--build", build, "-j2"])
    _run(["ctest", "--test-dir", build, "--output-on-failure"])
