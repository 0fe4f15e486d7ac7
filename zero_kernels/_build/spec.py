"""Which C++/CUDA sources make up each extension module, and how to compile them.

Shared by the just-in-time builder (``ext.py``) and by ``setup.py`` for
``ZERO_KERNELS_BUILD_OPS=1``. Imports nothing but the standard library.
"""

from __future__ import annotations

import re
from pathlib import Path

CXX_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno"]  # no -std: the C++ standard torch itself requires
LD_FLAGS = ["-fopenmp"]
# No --use_fast_math: the CUDA sources are casts, which fast math does not speed up but does change (it
# flushes fp32 subnormals to zero in every float <-> double conversion: cvt.ftz).
NVCC_FLAGS = ["-O3", "-std=c++17"]

# extension name -> source directories (relative to csrc/). CUDA sources live in the same
# directories with the .cu suffix and are compiled only when torch was built with CUDA.
EXTENSIONS = {
    "ops": ["ops"],
    "comm": ["comm"],
    "io": ["io"],
}


def csrc_root() -> Path:
    """csrc/ of a source checkout (editable install) or the copy shipped inside the package."""
    here = Path(__file__).resolve().parent.parent  # the zero_kernels package
    for candidate in (here.parent / "csrc", here / "csrc"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"zero_kernels: C++ sources not found next to {here}")


def sources(name: str, *, with_cuda: bool, root: Path | None = None) -> list[str]:
    """Sorted source files of extension ``name``; ``.cu`` files only when ``with_cuda``."""
    if name not in EXTENSIONS:
        raise ValueError(f"unknown extension {name!r}; known: {', '.join(EXTENSIONS)}")
    root = root or csrc_root()
    suffixes = (".cpp", ".cu") if with_cuda else (".cpp",)
    files = [p for d in EXTENSIONS[name] for p in sorted((root / d).glob("*")) if p.suffix in suffixes]
    return [str(p) for p in files]


def include_dirs(root: Path | None = None) -> list[str]:
    return [str(root or csrc_root())]


_QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def headers(files: list[str]) -> list[str]:
    """Sorted project headers that ``files`` include, directly or through other headers.

    ``#include "x"`` is looked up as the compiler does: next to the including file, then in
    ``include_dirs``; system headers (``<x>``) and names found nowhere are not the project's.
    """
    search = [Path(d) for d in include_dirs()]
    found: set[Path] = set()
    todo = [Path(f) for f in files]
    while todo:
        including = todo.pop()
        for name in _QUOTED_INCLUDE.findall(including.read_text(encoding="utf-8", errors="replace")):
            header = next((d / name for d in (including.parent, *search) if (d / name).is_file()), None)
            if header is not None and header.resolve() not in found:
                found.add(header.resolve())
                todo.append(header)
    return sorted(str(h) for h in found)
