"""The CUDA side of the comm engine compiles with nvcc, even where no GPU or CUDA torch is present.

The .cu sources include no torch headers (the engine hands them raw pointers, sizes and stream
handles), so a plain compile-only nvcc run checks them on any machine with the toolkit. The PTX
they compile to with the build's flags keeps subnormals: a cast must not flush them to zero.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from zero_kernels import _build_spec

CU_SOURCES = sorted((_build_spec.csrc_root() / "comm").glob("*.cu"))


def test_comm_has_cuda_sources() -> None:
    assert [p.name for p in CU_SOURCES] == ["side_stream.cu"]


@pytest.mark.ext
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


@pytest.mark.ext
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", CU_SOURCES, ids=lambda p: p.name)
def test_cu_source_keeps_subnormals(source: Path, arch: str, tmp_path: Path) -> None:
    """No flush-to-zero (``.ftz``) and no approximate math in the PTX built with the build's flags: the
    comm engine's casts must carry a subnormal value across (fast math flushes it in cvt.ftz)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    ptx = tmp_path / f"{source.stem}.ptx"
    cmd = [
        nvcc,
        "-ptx",
        f"-arch={arch}",
        *_build_spec.NVCC_FLAGS,
        f"-I{_build_spec.csrc_root()}",
        "-o",
        str(ptx),
        str(source),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stderr}"
    text = ptx.read_text()
    assert re.search(r"\bcvt\.", text), "no conversion found: the check would pass vacuously"
    lossy = sorted(set(re.findall(r"\b[a-z]+(?:\.[a-z0-9]+)*\.(?:ftz|approx)(?:\.[a-z0-9]+)*", text)))
    assert not lossy, f"{source.name} on {arch} flushes subnormals or approximates: {lossy}"
