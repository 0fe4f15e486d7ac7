"""First use of the C++ build: the just-in-time build says at WARNING that it runs and for how long,
who it waits for, and removes a lock left by a killed build instead of waiting on it.

torch's build is replaced by a stand-in that refuses to start while torch's lock exists (no compiler
runs); other processes hold the lock or load slowly, started with ``subprocess``.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.paths import pythonpath
from zero_kernels import _build_lock, _ext


def hold_lock(directory: str, torch_lock: bool, seconds: float) -> None:
    """Hold the build lock for ``seconds`` (with torch's, as a build does, if ``torch_lock``), saying when."""
    with _build_lock.hold(directory, "a test build"):
        if torch_lock:
            Path(directory, "lock").touch()
        print("held", flush=True)
        time.sleep(seconds)
        Path(directory, "lock").unlink(missing_ok=True)


def _holder(directory: Path, torch_lock: bool, seconds: float) -> subprocess.Popen:
    code = f"import tests.extension.test_build_lock as t; t.hold_lock({str(directory)!r}, {torch_lock}, {seconds})"
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def load_slowly(directory: str, seconds: float) -> None:
    """In another process: load the (up-to-date) build of 'ops' in ``directory``, the load taking ``seconds``."""
    from torch.utils import cpp_extension

    _ext._prebuilt = lambda name: None
    _ext._missing_toolchain = lambda with_cuda: None
    cpp_extension._get_build_directory = lambda name, verbose: directory

    def load(name: str, **kwargs: Any) -> str:
        print("held", flush=True)
        time.sleep(seconds)
        return name

    cpp_extension.load = load
    _ext.load("ops")


def _loader(directory: Path, seconds: float) -> subprocess.Popen:
    code = f"import tests.extension.test_build_lock as t; t.load_slowly({str(directory)!r}, {seconds})"
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


@pytest.mark.ext  # the extension's build, with a stand-in compiler
def test_first_build_is_announced_and_a_cached_one_is_not(fake_build: dict, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        assert _ext.load("ops") == "zero_kernels_ops"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("building the C++ extension 'ops'" in m and "usually takes 1-6 minutes" in m for m in warnings), warnings
    assert any("extension 'ops' ready in" in m for m in warnings), warnings
    caplog.clear()
    _ext._RESULTS.clear()
    with caplog.at_level(logging.INFO, logger="zero_kernels"):
        _ext.load("ops")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "an up-to-date build is quiet"


@pytest.mark.ext  # the extension's build, with a stand-in compiler
def test_waiting_for_another_build_names_it(fake_build: dict, caplog) -> None:
    holder = _holder(fake_build["dir"], torch_lock=True, seconds=2.0)
    try:
        with caplog.at_level(logging.WARNING, logger="zero_kernels"):
            _ext.load("ops")  # waits until the holder finishes, then builds
    finally:
        holder.wait(timeout=60)
    assert fake_build["loads"] == 1
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert f"waiting for process {holder.pid} to finish building the C++ extension 'ops'" in messages, messages


@pytest.mark.ext  # the extension's build, with a stand-in compiler
def test_loading_a_cached_build_waits_for_no_one(fake_build: dict, caplog) -> None:
    """Every rank of a launch loads the cached build: none waits for another, none warns."""
    _ext.load("ops")  # the first build; cached from now on
    _ext._RESULTS.clear()
    caplog.clear()
    loader = _loader(fake_build["dir"], seconds=4.0)  # another process, in the middle of loading it
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="zero_kernels"):
            _ext.load("ops")
        took = time.monotonic() - start
    finally:
        loader.wait(timeout=60)
    assert took < 2.0, f"waited {took:.1f} s for another process that was only loading the cached build"
    assert not caplog.records, [r.getMessage() for r in caplog.records]


@pytest.mark.ext  # the extension's build, with a stand-in compiler
def test_a_real_wait_says_how_long(monkeypatch: pytest.MonkeyPatch, fake_build: dict, caplog) -> None:
    """A process that waits for a build says so only once the wait is real, with real durations."""
    monkeypatch.setattr(_build_lock, "FIRST_WAIT_LOG_S", 1.2, raising=False)
    holder = _holder(fake_build["dir"], torch_lock=False, seconds=3.0)
    try:
        with caplog.at_level(logging.WARNING, logger="zero_kernels"):
            _ext.load("ops")
    finally:
        holder.wait(timeout=60)
    waits = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
    assert waits, [r.getMessage() for r in caplog.records]
    found = re.search(r"building it for (\d+) s; waited (\d+) s so far", waits[0])
    assert found and int(found[1]) >= 1 and int(found[2]) >= 1, waits[0]


@pytest.mark.ext  # the extension's build, with a stand-in compiler
def test_lock_of_a_killed_build_is_removed_not_waited_on(fake_build: dict, caplog) -> None:
    holder = _holder(fake_build["dir"], torch_lock=True, seconds=120.0)
    holder.kill()  # SIGKILL mid-build: torch's lock and the holder's record stay behind
    holder.wait()
    assert (fake_build["dir"] / "lock").exists()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        _ext.load("comm")
    assert time.monotonic() - start < 30
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert f"process {holder.pid} was interrupted and is no longer running" in messages, messages


def test_interrupted_build_whose_pid_runs_again_is_not_waited_on(tmp_path: Path) -> None:
    """A build killed in a container as pid 1, or whose pid was reused: its record names a process that runs
    here, but it holds no lock, so its torch lock is removed, not waited on without end."""
    import socket

    Path(tmp_path, _build_lock.LOCK_NAME).write_text(f"1 {socket.gethostname()} {time.time():.0f}\n")
    Path(tmp_path, "lock").touch()
    code = f"from zero_kernels import _build_lock\nwith _build_lock.hold({str(tmp_path)!r}, 'x') as b: print(b)"
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout == "True\n" and not Path(tmp_path, "lock").exists(), done.stderr
    assert "process 1 was interrupted: it no longer holds the zero_kernels lock" in done.stderr, done.stderr


def test_torch_lock_is_judged_by_its_owner(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the zero_kernels lock held, torch's lock is stale unless its recorded owner may still build."""
    import socket

    host, now = socket.gethostname(), time.time()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    young, old = 60.0, _build_lock.STALE_LOCK_S + 60.0
    assert _build_lock._stale_because(None, young) is not None  # the last build finished: nobody owns it
    assert "no longer running" in _build_lock._stale_because((int(gone.stdout), host, now), young)
    assert _build_lock._stale_because((os.getpid(), host, now), old) is None  # alive: wait, however old
    # ... unless the lock is shown to exclude: then a running process with the recorded pid is another one
    assert "no longer holds the zero_kernels lock" in _build_lock._stale_because((os.getpid(), host, now), young, True)
    assert _build_lock._stale_because((1, "elsewhere", now), young, True) is None  # another host: by age only
    assert _build_lock._stale_because((1, "elsewhere", now), young) is None  # cannot be checked: young is kept
    assert "cannot be checked" in _build_lock._stale_because((1, "elsewhere", now), old)
    monkeypatch.setattr(_build_lock, "fcntl", None)  # no flock (Windows): age alone, for an unknown owner
    assert _build_lock._stale_because(None, young) is None and _build_lock._stale_because(None, old) is not None
