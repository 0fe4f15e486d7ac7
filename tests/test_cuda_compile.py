"""The CUDA side of the comm engine compiles with nvcc, even where no GPU or CUDA torch is present.

The .cu sources include no torch headers (the engine hands them raw pointers, sizes and stream
handles), so a plain compile-only nvcc run checks them on any machine with the toolkit.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from zero_kernels import _build_spec

CU_SOURCES = sorted((_build_spec.csrc_root() / "comm").glob("*.cu"))


def test_comm_has_cuda_sources() -> None:
    assert [p.name for p in CU_SOURCES] == ["side_stream.cu"]


@pytest.mark.parametrize("source", CU_SOURCES, ids=lambda p: p.name)
def test_cu_source_compiles_with_nvcc(source: Path, tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    obj = tmp_path / f"{source.stem}.o"
    cmd = [nvcc, "-c", *_build_spec.NVCC_FLAGS, f"-I{_build_spec.csrc_root()}", "-o", str(obj), str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stderr}"
    assert obj.stat().st_size > 0
