"""Emulated nodes (``benchmarks.netns``) are always removed: on leaving, on an exception, on SIGINT and
SIGTERM, and when their creator is killed outright; and the ``links`` benchmark skips with the reason
where namespaces cannot be made. The cases that make namespaces need root and skip with the reason
elsewhere."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks import links, netns
from tests.helpers.paths import ROOT


def _need_namespaces() -> None:
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # a zombie: dead, not yet reaped


def _wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_rates_parse_and_print() -> None:
    assert netns.parse_rate("200mbit") == 2e8 and netns.parse_rate("1.5Gbit") == 1.5e9
    assert netns.format_rate(1e10) == "10gbit" and netns.format_rate(2e8) == "200mbit"
    with pytest.raises(ValueError, match="rate='fast'"):
        netns.parse_rate("fast")
    assert netns.tbf_burst_bytes(1e9) == 256 * 1024 and netns.tbf_burst_bytes(1e11) == 25_000_000


def test_unavailable_names_the_missing_tool(monkeypatch) -> None:
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    assert netns._probe() == "`tc` (iproute2) is not installed"


def test_links_benchmark_skips_with_the_reason(monkeypatch, capsys) -> None:
    monkeypatch.setattr(netns, "unavailable", lambda: "cannot create network namespaces (not root): denied")
    rows = links.run(quick=True)
    assert rows == [{"case": "-", "provider": "-", "skipped": "cannot create network namespaces (not root): denied"}]
    assert capsys.readouterr().err.strip() == "links: skipped: cannot create network namespaces (not root): denied"


@pytest.mark.netns
def test_nodes_and_their_processes_are_removed_on_an_exception() -> None:
    _need_namespaces()
    with pytest.raises(RuntimeError, match="boom"):
        with netns.emulated_nodes("1gbit") as nodes:
            names = {n.netns for n in nodes.nodes}
            assert names <= _namespaces()
            sleeper = nodes.launch(nodes.nodes[1], ["sleep", "600"])
            argv = [sys.executable, "-c", _CONNECT, nodes.nodes[1].address]
            ping = nodes.launch(nodes.nodes[0], argv, stdout=subprocess.PIPE, text=True)
            assert ping.communicate(timeout=30)[0].strip() == str(errno.ECONNREFUSED)  # node 1 answered node 0
            raise RuntimeError("boom")
    assert not names & _namespaces()
    assert _gone(sleeper.pid)


_CONNECT = "import socket, sys; s = socket.socket(); s.settimeout(5); print(s.connect_ex((sys.argv[1], 9)))"

_CREATOR = textwrap.dedent(
    """
    import signal, sys, time
    from benchmarks import netns
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as at a terminal, even if started ignoring it
    with netns.emulated_nodes() as nodes:
        sleeper = nodes.launch(nodes.nodes[0], ["sleep", "600"])
        print(nodes.nodes[0].netns, nodes.nodes[1].netns, sleeper.pid, flush=True)
        time.sleep(600)
    """
)


@pytest.mark.netns
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_nodes_are_removed_when_their_creator_is_interrupted_or_killed(how: signal.Signals) -> None:
    _need_namespaces()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    creator = subprocess.Popen([sys.executable, "-c", _CREATOR], stdout=subprocess.PIPE, text=True, env=env)
    try:
        first, second, sleeper = creator.stdout.readline().split()
        assert {first, second} <= _namespaces()
        creator.send_signal(how)
        creator.wait(timeout=30)
        assert _wait_for(lambda: not {first, second} & _namespaces()), f"{first}, {second} left after {how.name}"
        assert _wait_for(lambda: _gone(int(sleeper))), f"a process inside outlived its nodes after {how.name}"
    finally:
        creator.kill()
        creator.wait()


@pytest.mark.netns
def test_stale_namespaces_of_dead_creators_are_removed() -> None:
    _need_namespaces()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{netns.PREFIX}{dead.pid}s0a"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in netns.remove_stale()
        assert stale not in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
