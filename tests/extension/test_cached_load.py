"""An up-to-date cached build is imported without running torch's build (ninja); one made from other inputs
(torch, Python, flags, files) goes through torch's build, which stamps what it was made from."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.paths import pythonpath
from zero_kernels import _build_spec, _ext

_REFUSE_BUILD = """
from torch.utils import cpp_extension

def refuse(*args, **kwargs):
    raise AssertionError("torch's build ran")

cpp_extension.load = refuse
from zero_kernels import _ext
module = _ext.load("io")
print(module.__name__, module.__file__)
"""


@pytest.mark.ext  # the real extension, built once for the session
def test_an_up_to_date_build_imports_without_torchs_build() -> None:
    _ext.load("io")  # built or loaded here first: its stamp is written
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    got = subprocess.run([sys.executable, "-c", _REFUSE_BUILD], env=env, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    name, path = got.stdout.split()
    assert name == "zero_kernels_io" and Path(path).parent.joinpath(_ext.STAMP).is_file()


def _key() -> str:
    return _ext._build_key(_build_spec.sources("ops", with_cuda=False), False)


@pytest.mark.ext  # the extension's build, with a stand-in compiler (``conftest.fake_build``)
def test_torchs_build_stamps_what_it_built_from(fake_build: dict) -> None:
    assert _ext.load("ops") == "zero_kernels_ops" and fake_build["loads"] == 1
    assert (fake_build["dir"] / _ext.STAMP).read_text() == _key()
    _ext._RESULTS.clear()
    assert _ext.load("ops") == "zero_kernels_ops"  # the stand-in library does not import: built again
    assert fake_build["loads"] == 2


@pytest.mark.parametrize("change", ["torch", "flags", "sources"])
def test_a_stamp_of_other_inputs_is_not_imported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, change: str) -> None:
    (tmp_path / _ext.STAMP).write_text(_key())
    if change == "torch":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    elif change == "flags":
        monkeypatch.setattr(_build_spec, "CXX_FLAGS", [*_build_spec.CXX_FLAGS, "-DOTHER"])
    else:
        monkeypatch.setattr(_build_spec, "sources", lambda name, with_cuda: ["other.cpp"])
    assert _key() != (tmp_path / _ext.STAMP).read_text()

    def refuse(*args: Any) -> None:
        raise AssertionError("a library of other inputs was imported")

    monkeypatch.setattr("importlib.util.spec_from_file_location", refuse)
    assert _ext._load_cached(str(tmp_path), "ops", _key()) is None
