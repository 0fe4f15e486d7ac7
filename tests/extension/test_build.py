"""The package imports without a toolchain, the JIT builder explains what is missing, env is validated."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT
from zero_kernels import _ext, env


@pytest.fixture
def fresh_results(monkeypatch: pytest.MonkeyPatch) -> dict:
    """Forget remembered build outcomes for the duration of a test."""
    results: dict = {}
    monkeypatch.setattr(_ext, "_RESULTS", results)
    monkeypatch.delenv("ZERO_KERNELS_NO_JIT", raising=False)  # set by a run without ext tests: these build nothing
    return results


@pytest.mark.slow  # a fresh interpreter that trains
def test_import_needs_no_compiler_or_ninja(tmp_path) -> None:
    """With nothing on PATH the package imports, says what is missing, and trains on the torch path."""
    empty = tmp_path / "bin"
    empty.mkdir()
    environ = dict(os.environ, PATH=str(empty), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    environ.pop("ZERO_KERNELS_IMPL", None)
    environ.pop("ZERO_KERNELS_NO_JIT", None)
    code = (
        "import torch, zero_kernels as zk\n"
        "from zero_kernels import _ext\n"
        "assert not _ext.available('ops')\n"
        "ours = torch.nn.Parameter(torch.linspace(-1, 1, 5)); ref = torch.nn.Parameter(ours.detach().clone())\n"
        "opt = zk.ShardedFusedAdam([ours], lr=0.1, stage=0); ref_opt = torch.optim.AdamW([ref], lr=0.1)\n"
        "for step in range(3):\n"
        "    g = torch.randn(5); ours.grad = g.clone(); ref.grad = g.clone()\n"
        "    opt.step(); ref_opt.step()\n"
        "torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-5, atol=1e-7)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "no C++ compiler found" in done.stderr or "ninja is not installed" in done.stderr, done.stderr


def test_missing_ninja_is_named(monkeypatch: pytest.MonkeyPatch, fresh_results: dict) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setattr(_ext, "_prebuilt", lambda name: None)

    def no_ninja() -> None:
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", no_ninja)
    with pytest.raises(_ext.ExtensionUnavailable, match="pip install ninja"):
        _ext.load("ops")
    assert isinstance(fresh_results["ops"], _ext.ExtensionUnavailable)


def test_missing_compiler_is_named(monkeypatch: pytest.MonkeyPatch, fresh_results: dict) -> None:
    monkeypatch.setattr(_ext, "_prebuilt", lambda name: None)
    monkeypatch.setattr(_ext.shutil, "which", lambda exe: None)
    with pytest.raises(_ext.ExtensionUnavailable, match="no C\\+\\+ compiler"):
        _ext.load("comm")


def test_no_jit_refuses_to_build(monkeypatch: pytest.MonkeyPatch, fresh_results: dict) -> None:
    monkeypatch.setattr(_ext, "_prebuilt", lambda name: None)
    monkeypatch.setenv("ZERO_KERNELS_NO_JIT", "1")
    with pytest.raises(_ext.ExtensionUnavailable, match="ZERO_KERNELS_NO_JIT=1"):
        _ext.load("ops")
    assert not _ext.available("ops")


def test_unknown_extension_is_refused() -> None:
    from zero_kernels import _build_spec

    with pytest.raises(ValueError, match="unknown extension 'nope'; known: ops, comm"):
        _build_spec.sources("nope", with_cuda=False)


def test_cpu_build_compiles_no_cuda_sources() -> None:
    from zero_kernels import _build_spec

    for name in _build_spec.EXTENSIONS:
        cpu = _build_spec.sources(name, with_cuda=False)
        assert cpu and all(s.endswith(".cpp") for s in cpu)
        assert set(cpu) <= set(_build_spec.sources(name, with_cuda=True))


@pytest.fixture
def built_copy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of csrc/ taken as the sources, and a build directory whose library of 'ops' is newer than all of it."""
    from zero_kernels import _build_spec

    root = tmp_path / "csrc"
    shutil.copytree(_build_spec.csrc_root(), root)
    monkeypatch.setattr(_build_spec, "csrc_root", lambda: root)
    directory = tmp_path / "build"
    directory.mkdir()
    library = _ext.library_path(str(directory), "ops")
    library.write_bytes(b"")
    newest = max(p.stat().st_mtime for p in root.rglob("*") if p.is_file())
    os.utime(library, (newest + 10, newest + 10))
    return root, directory


def _touched_later(path: Path) -> None:
    """Make ``path`` newer than every file of the copied tree and than the build ``built_copy`` made (whose time
    is the tree's newest file's plus 10 s), whatever times the checkout gave the files."""
    root = next(parent for parent in path.parents if parent.name == "csrc")
    later = max(p.stat().st_mtime for p in root.rglob("*") if p.is_file()) + 100
    os.utime(path, (later, later))


def _ops_up_to_date(root: Path, directory: Path) -> bool:
    from zero_kernels import _build_spec

    return _ext._up_to_date(str(directory), "ops", _build_spec.sources("ops", with_cuda=False, root=root))


def test_headers_are_the_ones_each_extension_includes() -> None:
    from zero_kernels import _build_spec

    root = _build_spec.csrc_root()
    for name in _build_spec.EXTENSIONS:
        included = _build_spec.headers(_build_spec.sources(name, with_cuda=True))
        assert included and all(Path(h).relative_to(root).parts[0] == name for h in included), (name, included)
    ops = _build_spec.headers(_build_spec.sources("ops", with_cuda=False))
    assert str(root / "ops" / "loops_cpu.h") in ops  # included by the kernels' sources, not by the bindings


def test_a_header_of_another_extension_leaves_ops_up_to_date(built_copy: tuple[Path, Path]) -> None:
    root, directory = built_copy
    assert _ops_up_to_date(root, directory)
    _touched_later(root / "io" / "engine.h")
    _touched_later(root / "comm" / "side_stream.h")
    assert _ops_up_to_date(root, directory)


@pytest.mark.parametrize("header", ["adam_cpu.h", "loops_cpu.h"])
def test_a_header_of_ops_makes_ops_stale(built_copy: tuple[Path, Path], header: str) -> None:
    root, directory = built_copy
    _touched_later(root / "ops" / header)
    assert not _ops_up_to_date(root, directory)


def test_a_source_of_ops_makes_ops_stale(built_copy: tuple[Path, Path]) -> None:
    root, directory = built_copy
    _touched_later(root / "ops" / "quant_cpu.cpp")
    assert not _ops_up_to_date(root, directory)


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("ZERO_KERNELS_IMPL", "cuda", "allowed values are auto, triton, cpu, torch"),
        ("ZERO_KERNELS_COMM", "nccl", "allowed values are auto, cpp, torch"),
        ("ZERO_KERNELS_NO_JIT", "maybe", "expected 0 or 1"),
        ("ZERO_KERNELS_LOG_LEVEL", "loud", "allowed values are DEBUG, INFO, WARNING, ERROR"),
    ],
)
def test_bad_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch, variable, value, message) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=message) as info:
        env.settings()
    assert variable in str(info.value)


def test_readme_lists_every_environment_variable() -> None:
    readme = (ROOT / "README.md").read_text()
    for variable in env.VARIABLES:
        assert f"`{variable}`" in readme, variable


def test_a_remembered_failure_keeps_no_optimizer_alive(monkeypatch: pytest.MonkeyPatch, fresh_results: dict) -> None:
    """Where an extension cannot be built, each optimizer built falls back to the torch path; the failure kept
    for the next one holds no traceback, whose frames would keep every optimizer built (and its model) alive."""
    import gc
    import weakref

    import torch

    import zero_kernels as zk

    def unavailable(name: str) -> None:  # as a compiler error surfaces: raised from the error of the build
        try:
            raise RuntimeError("c++ exited with 1")
        except RuntimeError as exc:
            raise _ext.ExtensionUnavailable(f"extension {name!r}: no compiler here") from exc

    monkeypatch.setattr(_ext, "_build", unavailable)
    for _ in range(2):  # the first build fails and is remembered; the second finds the failure
        model = torch.nn.Linear(4, 4)
        opt = zk.ShardedFusedAdam(model.parameters(), lr=0.1, stage=1)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        gone = [weakref.ref(x) for x in (opt, model)]
        del model, opt
        gc.collect()
        assert [ref() for ref in gone] == [None, None]
    assert set(fresh_results) >= {"comm"}
    with pytest.raises(_ext.ExtensionUnavailable, match="no compiler here") as raised:
        _ext.load("comm")
    assert raised.value is not fresh_results["comm"] and "c++ exited" in str(raised.value.__cause__)
