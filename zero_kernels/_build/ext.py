"""Just-in-time build and load of the C++/CUDA extensions in ``csrc/``.

``load("ops")`` returns the compiled module, building it with ninja on first use (torch's
extension cache, ``TORCH_EXTENSIONS_DIR``, rebuilds when a source changes). A cached library newer than its
sources and headers, whose stamp (``STAMP``, written by the load that built or checked it) names the same
torch, Python, flags and files, is imported directly: running ninja to find nothing to do took about 0.5 s per
extension and process. A module prebuilt by
``ZERO_KERNELS_BUILD_OPS=1 pip install`` is used instead when present. Every failure raises
``ExtensionUnavailable`` with what to install; callers with a pure-PyTorch path catch it.

First use. A build takes minutes, so it is announced at WARNING (what is built, how long it
usually takes, where it is cached) and its duration logged when done. Builds of one extension are
serialised by ``_build.lock`` (a lock that dies with its holder): processes that load a cached
build share it and wait for nobody, a process that waits for another's build says so once the wait
is real, and a lock left by a killed build is removed instead of waited on.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from . import lock as _build_lock, spec as _build_spec
from ..env import settings

log = logging.getLogger("zero_kernels")


STAMP = "zero_kernels.build"  # in a build directory: what its library was built from (``_build_key``)


class ExtensionUnavailable(RuntimeError):
    """The C++ extension cannot be built or loaded here; the message says what is missing."""


def module_name(name: str) -> str:
    return f"zero_kernels_{name}"


def library_path(directory: str, name: str) -> Path:
    """Where torch's build puts the library of extension ``name`` in its build ``directory``."""
    from torch.utils import cpp_extension

    return Path(directory) / f"{module_name(name)}{getattr(cpp_extension, 'LIB_EXT', '.so')}"


def _up_to_date(directory: str, name: str, sources: list[str]) -> bool:
    """Whether a built library of ``name`` is newer than its sources and the headers they include (no build needed).

    Only the headers this extension's sources include count: a change to another extension's header
    does not rebuild this one.
    """
    library = library_path(directory, name)
    if not library.is_file():
        return False
    newest = max((Path(p).stat().st_mtime for p in [*sources, *_build_spec.headers(sources)]), default=0.0)
    return library.stat().st_mtime >= newest


def _build_key(sources: list[str], with_cuda: bool) -> str:
    """What a library is built from beyond its files' times: torch, Python, the flags and the file list."""
    what = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version,
        "with_cuda": with_cuda,
        "arch": os.environ.get("TORCH_CUDA_ARCH_LIST"),
        "sources": sources,
        "include": _build_spec.include_dirs(),
        "flags": [_build_spec.CXX_FLAGS, _build_spec.LD_FLAGS, _build_spec.NVCC_FLAGS],
    }
    return json.dumps(what, sort_keys=True)


def _load_cached(directory: str, name: str, key: str) -> ModuleType | None:
    """The library in ``directory`` imported without running ninja, when the stamp its last load left says it was
    built from ``key`` (the caller has checked that it is newer than its sources); None otherwise, or when it does
    not import."""
    try:
        if (Path(directory) / STAMP).read_text() != key:
            return None
    except OSError:
        return None
    spec = importlib.util.spec_from_file_location(module_name(name), library_path(directory, name))
    if spec is None or spec.loader is None:
        return None
    try:
        module = importlib.util.module_from_spec(spec)  # an extension module is loaded here
        spec.loader.exec_module(module)
    except (ImportError, OSError):
        return None
    return module


def _stamp(directory: str, key: str) -> None:
    """Record that the library in ``directory`` was built from ``key`` (replaced whole: readers never see half)."""
    staged = Path(directory) / f"{STAMP}.{os.getpid()}"
    staged.write_text(key)
    os.replace(staged, Path(directory) / STAMP)


def _missing_toolchain(with_cuda: bool) -> str | None:
    from torch.utils import cpp_extension

    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        return "ninja is not installed: `pip install ninja`"
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        return "no C++ compiler found (c++, g++ or clang++): install one, e.g. `apt-get install g++`"
    if with_cuda and cpp_extension.CUDA_HOME is None:
        return "torch has CUDA but no CUDA toolkit was found: install nvcc or set CUDA_HOME"
    if with_cuda and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        return (
            "torch has CUDA but no GPU is visible to choose the architectures to compile for: "
            "set TORCH_CUDA_ARCH_LIST (e.g. '8.0;9.0')"
        )
    return None


def _prebuilt(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"zero_kernels.{module_name(name)}")
    except ImportError:
        return None


def _build(name: str) -> ModuleType:
    prebuilt = _prebuilt(name)
    if prebuilt is not None:
        return prebuilt
    env = settings()
    if env.no_jit:
        raise ExtensionUnavailable(
            f"zero_kernels extension '{name}' is not prebuilt and ZERO_KERNELS_NO_JIT=1 forbids building it; "
            "unset it, or reinstall with `ZERO_KERNELS_BUILD_OPS=1 pip install --no-build-isolation .`"
        )
    with_cuda = torch.version.cuda is not None
    missing = _missing_toolchain(with_cuda)
    if missing:
        raise ExtensionUnavailable(f"cannot build zero_kernels extension '{name}': {missing}")
    from torch.utils import cpp_extension

    sources = _build_spec.sources(name, with_cuda=with_cuda)
    directory = cpp_extension._get_build_directory(module_name(name), verbose=False)
    key = _build_key(sources, with_cuda)
    start = time.perf_counter()
    try:

        def stale() -> bool:
            return not _up_to_date(directory, name, sources)

        with _build_lock.hold(directory, f"the C++ extension '{name}'", stale) as building:
            if building:
                log.warning(
                    "zero_kernels: building the C++ extension '%s' (first use, or its sources changed); this usually "
                    "takes %s%s. Later runs load it from %s (set TORCH_EXTENSIONS_DIR to move it; "
                    "ZERO_KERNELS_BUILD_OPS=1 pip install builds it at install time)",
                    name,
                    _build_lock.BUILD_TIME,
                    ", longer with CUDA sources" if with_cuda else "",
                    directory,
                )
            module = None if building else _load_cached(directory, name, key)
            if module is None:
                module = cpp_extension.load(
                    name=module_name(name),
                    sources=sources,
                    extra_include_paths=_build_spec.include_dirs(),
                    extra_cflags=_build_spec.CXX_FLAGS,
                    extra_ldflags=_build_spec.LD_FLAGS,
                    extra_cuda_cflags=_build_spec.NVCC_FLAGS,
                    with_cuda=with_cuda,
                    verbose=env.verbose_build,
                )
                _stamp(directory, key)
    except Exception as exc:  # compiler errors surface as RuntimeError/OSError/ImportError
        raise ExtensionUnavailable(
            f"building zero_kernels extension '{name}' failed: {exc}\n"
            "rerun with ZERO_KERNELS_VERBOSE_BUILD=1 to see the compiler output"
        ) from exc
    level = logging.WARNING if building else logging.INFO
    log.log(level, "zero_kernels: extension '%s' ready in %.1f s", name, time.perf_counter() - start)
    return module


_RESULTS: dict[str, ModuleType | ExtensionUnavailable] = {}


def load(name: str) -> ModuleType:
    """The compiled extension ``name`` ("ops", "comm" or "io"); raises ExtensionUnavailable.

    The outcome, module or failure, is remembered for the life of the process. A failure is raised anew each
    time: the remembered one, and the errors it came from, keep no traceback, whose frames (and the frames that
    called them) would keep the callers' objects (an optimizer being built, its model) alive for as long.
    """
    if name not in _RESULTS:
        try:
            _RESULTS[name] = _build(name)
        except ExtensionUnavailable as exc:
            _RESULTS[name] = _without_tracebacks(exc)
    result = _RESULTS[name]
    if isinstance(result, ExtensionUnavailable):
        raise ExtensionUnavailable(*result.args) from result.__cause__
    return result


def _without_tracebacks(exc: ExtensionUnavailable) -> ExtensionUnavailable:
    """``exc`` with the tracebacks of it and of the errors it came from (causes, contexts) dropped."""
    seen: set[int] = set()
    links: list[BaseException] = [exc]
    while links:
        link = links.pop()
        if id(link) not in seen:
            seen.add(id(link))
            link.__traceback__ = None
            links += [e for e in (link.__cause__, link.__context__) if e is not None]
    return exc


def available(name: str) -> bool:
    """True when ``load(name)`` succeeds; a failure is logged once and remembered."""
    try:
        load(name)
    except ExtensionUnavailable as exc:
        warn_once(f"{exc}; falling back to the pure-PyTorch path")
        return False
    return True


@functools.lru_cache(maxsize=None)
def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time it comes up in this process."""
    log.warning("%s", message)
