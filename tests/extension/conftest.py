"""Fixtures of the extension build's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from zero_kernels import _build_lock, _ext


@pytest.fixture
def fake_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """``_ext.load`` with torch's build replaced by one that refuses to start while torch's lock exists."""
    from torch.utils import cpp_extension

    seen: dict[str, Any] = {"dir": tmp_path / "build", "loads": 0}
    monkeypatch.setattr(_ext, "_RESULTS", {})
    monkeypatch.setattr(_ext, "_prebuilt", lambda name: None)
    monkeypatch.setattr(_ext, "_missing_toolchain", lambda with_cuda: None)
    monkeypatch.setattr(_build_lock, "WAIT_LOG_S", 0.5)
    monkeypatch.setattr(_build_lock, "FIRST_WAIT_LOG_S", 0.5, raising=False)
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(seen["dir"]))

    def load(name: str, **kwargs: Any) -> str:
        assert not (seen["dir"] / "lock").exists(), "torch would wait forever on this lock"
        seen["loads"] += 1
        (seen["dir"] / f"{name}.so").write_bytes(b"")
        return name

    monkeypatch.setattr(cpp_extension, "load", load)
    return seen
