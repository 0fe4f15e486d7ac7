"""Emulated nodes on one machine: two network namespaces joined by a veth pair, rate-limited with ``tc``.

Each namespace is a "node": its own loopback (so the ranks of one node talk to each other at memory
speed, unlimited) and one end of a veth pair, the only way to the other node. A token-bucket filter
(``tc qdisc ... tbf``) on both ends limits the rate each way. Processes started with
:meth:`EmulatedNodes.launch` run inside a node; :func:`torchrun_on_nodes` starts
``torchrun --nnodes 2 --node_rank K`` on both nodes with ``GLOO_SOCKET_IFNAME`` set to the node's
end, so a gloo job sees ``LOCAL_WORLD_SIZE < WORLD_SIZE`` and crosses a real (emulated) link.

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip`` and ``tc`` (iproute2); :func:`unavailable`
says in one line why not where they are missing.

Everything made is removed, whatever happens:
- on leaving :func:`emulated_nodes` (normally, on an exception, Ctrl-C, or SIGTERM/SIGHUP, which
  raise :class:`Terminated` in the main thread while inside), every process in the namespaces is
  killed and the namespaces are deleted (with them the veth pair and its qdiscs);
- if the creating process dies without that (SIGKILL), a janitor process it started, which waits on
  a pipe only the creator holds, wakes up on the pipe's end of file and does the same;
- names carry the creator's pid (``zk<pid>s<seq><node>``), and :func:`remove_stale` (run on every
  entry) deletes those whose creator is gone, should both have died.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

from zero_kernels.liveness import process_alive

PREFIX = "zk"
_NAME = re.compile(rf"^{PREFIX}(\d+)s(\d+)([ab])$")
SUBNET = "10.77.0"  # private to the two namespaces: it cannot clash with the host's networks
MASTER_PORT = 29500  # free by construction: each node's namespace is new
_seq = itertools.count()

# Ranks and launchers run inside the namespaces; the janitor removes them and the namespaces once the
# creator's end of its pipe closes (the creator exited, however it exited).
_JANITOR = """
read _ignored
for ns in "$@"; do
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null
    ip netns del "$ns" 2>/dev/null
    ip link del "$ns" 2>/dev/null
done
exit 0
"""


class Terminated(Exception):
    """SIGTERM or SIGHUP arrived while emulated nodes were up (raised so that they are removed)."""


@dataclass(frozen=True)
class Node:
    """One emulated node: its namespace, its end of the link (same name) and that end's address."""

    index: int
    netns: str
    ifname: str
    address: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip() or f'exit status {proc.returncode}'}")
    return proc


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["tc", *args], capture_output=True, text=True)
    if check and proc.returncode:
        raise RuntimeError(f"tc {' '.join(args)}: {proc.stderr.strip() or f'exit status {proc.returncode}'}")
    return proc


def _kill_and_delete(netns: str) -> None:
    """Kill every process in ``netns`` and delete it (its veth end, and so the pair, goes with it; an end of
    the same name still outside, a pair made but not yet moved, is deleted too)."""
    pids = _ip("netns", "pids", netns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", netns, check=False)
    _ip("link", "del", netns, check=False)


def remove_stale() -> list[str]:
    """Delete the namespaces and stray veth ends of earlier runs whose creating process is gone.

    Returns the names removed.
    """
    removed = []
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for name in (line.split()[0] for line in listed if line.strip()):
        match = _NAME.match(name)
        if match and not process_alive(int(match.group(1))):
            _kill_and_delete(name)
            removed.append(name)
    links = _ip("-o", "link", "show", check=False).stdout.split("\n")
    for line in links:
        fields = line.split(":")
        name = fields[1].strip().split("@")[0] if len(fields) > 1 else ""
        match = _NAME.match(name)
        if match and not process_alive(int(match.group(1))):  # a pair made but never moved into its namespaces
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


_probe_result: Optional[tuple[Optional[str]]] = None


def unavailable() -> Optional[str]:
    """None when this process can make emulated nodes, else why not (one line). Probed once."""
    global _probe_result
    if _probe_result is None:
        _probe_result = (_probe(),)
    return _probe_result[0]


def _probe() -> Optional[str]:
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    name = f"{PREFIX}{os.getpid()}s{next(_seq)}a"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode:
        why = made.stderr.strip().splitlines()[-1] if made.stderr.strip() else f"exit status {made.returncode}"
        root = "" if os.geteuid() == 0 else " (not root)"
        return f"cannot create network namespaces{root}: {why}"
    _ip("netns", "del", name, check=False)
    return None


def tbf_burst_bytes(rate_bits: float) -> int:
    """The token bucket's depth for ``rate_bits``: 256 KB, or 2 ms at that rate if more (a bucket must
    hold what the rate earns between two timer ticks, else the qdisc cannot reach its rate)."""
    return max(256 * 1024, int(rate_bits / 8 * 0.002))


def parse_rate(rate: str) -> float:
    """``tc``'s rate syntax (``10gbit``, ``200mbit``, ``1.5gbit``, ``800kbit``) in bits per second.

    Args:
        rate: a number with a unit among bit, kbit, mbit, gbit, tbit.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)bit\s*", rate.lower())
    if not match:
        raise ValueError(f"rate={rate!r}: expected a number and a unit such as 10gbit, 200mbit or 800kbit")
    value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[match.group(2)]
    if value <= 0:
        raise ValueError(f"rate={rate!r}: must be > 0")
    return value


def _qdisc_args(ifname: str, rate: Optional[str]) -> list[str]:
    """``tc`` arguments that limit ``ifname``'s egress to ``rate`` (None: remove the limit)."""
    if rate is None:
        return ["qdisc", "del", "dev", ifname, "root"]
    burst = tbf_burst_bytes(parse_rate(rate))
    return ["qdisc", "replace", "dev", ifname, "root", "tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]


def limit_here(ifname: str, rate: Optional[str]) -> None:
    """Limit the egress of ``ifname`` to ``rate`` (None: no limit), from a process inside its namespace:
    how a job changes the rate between phases without leaving its nodes (each node limits its own end)."""
    _tc(*_qdisc_args(ifname, rate), check=rate is not None)


def format_rate(bits: float) -> str:
    """Bits per second in ``tc``'s syntax, e.g. ``200mbit`` or ``1.5gbit``."""
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g}{unit}"
    return f"{bits:.3g}bit"


class EmulatedNodes:
    """Two nodes up and joined (made by :func:`emulated_nodes`, which also removes them)."""

    def __init__(self, names: tuple[str, str]):
        self.nodes = tuple(Node(i, name, name, f"{SUBNET}.{i + 1}") for i, name in enumerate(names))
        self.rate: Optional[str] = None
        self._procs: list[subprocess.Popen] = []

    def _build(self) -> None:
        a, b = self.nodes
        for node in self.nodes:
            _ip("netns", "add", node.netns)
        _ip("link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname)
        for node in self.nodes:
            _ip("link", "set", node.ifname, "netns", node.netns)
            _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.ifname)
            _ip("-n", node.netns, "link", "set", "lo", "up")
            _ip("-n", node.netns, "link", "set", node.ifname, "up")

    def set_rate(self, rate: Optional[str]) -> None:
        """Limit both directions of the link to ``rate`` (``tc`` syntax, e.g. ``1gbit``); None: no limit."""
        for node in self.nodes:
            _tc("-n", node.netns, *_qdisc_args(node.ifname, rate), check=rate is not None)
        self.rate = rate

    def launch(self, node: Node, argv: Sequence[str], env: Optional[dict] = None, **popen: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``node``'s namespace (``ip netns exec``); it is killed on exit at the latest."""
        proc = subprocess.Popen(["ip", "netns", "exec", node.netns, *argv], env=env, start_new_session=True, **popen)
        self._procs.append(proc)
        return proc

    def kill_processes(self) -> None:
        """Kill every process running inside the nodes (launched here or by those)."""
        for node in self.nodes:
            for pid in _ip("netns", "pids", node.netns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for proc in self._procs:
            if proc.poll() is None:  # not reaped yet: its process group is still this launch's
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self._procs = []


def _start_janitor(names: Sequence[str]) -> tuple[subprocess.Popen, int]:
    """The janitor, and the write end of its pipe (close it to let it clean up and exit)."""
    read_end, write_end = os.pipe()
    try:
        janitor = subprocess.Popen(
            ["sh", "-c", _JANITOR, "janitor", *names], stdin=read_end, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    return janitor, write_end


def _raise_terminated(signum: int, _frame: object) -> None:
    raise Terminated(f"signal {signal.Signals(signum).name}")


@contextlib.contextmanager
def _terminate_raises() -> Iterator[None]:
    """Inside, SIGTERM and SIGHUP raise ``Terminated`` (main thread only: elsewhere signals are not ours)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise_terminated) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def emulated_nodes(rate: Optional[str] = None) -> Iterator[EmulatedNodes]:
    """Two emulated nodes joined by a link limited to ``rate`` (None: unlimited), removed on exit.

    Args:
        rate: ``tc`` rate of each direction, e.g. ``1gbit`` or ``200mbit``; change it later with
            :meth:`EmulatedNodes.set_rate`.

    Raises:
        RuntimeError: when the namespaces cannot be made (:func:`unavailable` says why up front).
    """
    remove_stale()
    seq = next(_seq)
    names = (f"{PREFIX}{os.getpid()}s{seq}a", f"{PREFIX}{os.getpid()}s{seq}b")
    janitor, pipe = _start_janitor(names)
    nodes = EmulatedNodes(names)
    try:
        with _terminate_raises():
            nodes._build()
            nodes.set_rate(rate)
            yield nodes
    finally:
        nodes.kill_processes()
        for name in names:
            _kill_and_delete(name)
        os.close(pipe)
        janitor.wait()


def torchrun_argv(node: Node, master: Node, nnodes: int, nproc_per_node: int, target: Sequence[str]) -> list[str]:
    """``torchrun`` for ``node`` with a static rendezvous at ``master``'s address.

    Args:
        node: the node this launcher runs on (its index is ``--node_rank``).
        master: the node whose rank 0 hosts the rendezvous store.
        nnodes: number of nodes.
        nproc_per_node: ranks per node (``LOCAL_WORLD_SIZE``).
        target: the script and its arguments, or ``-m`` and a module and its arguments.
    """
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node_rank={node.index}",
        f"--nproc_per_node={nproc_per_node}", f"--master_addr={master.address}", f"--master_port={MASTER_PORT}",
        *target,
    ]  # fmt: skip


def torchrun_on_nodes(
    nodes: EmulatedNodes,
    target: Sequence[str],
    *,
    nproc_per_node: int = 2,
    env: Optional[dict] = None,
    timeout_s: float = 300.0,
    echo: Callable[[str], bool] = lambda line: False,
) -> list[str]:
    """Run ``target`` under torchrun on every node, ranks joined across the link; return each node's output.

    Each launcher gets ``env`` (default: this process's) plus ``GLOO_SOCKET_IFNAME`` = its end of the
    link. Raises ``RuntimeError`` with the tail of the output of a node whose launcher failed, or of
    every node when the job outlived ``timeout_s`` (its processes are killed then).

    Args:
        nodes: the emulated nodes.
        target: the script and its arguments (or ``-m module ...``).
        nproc_per_node: ranks per node.
        env: the environment of the launchers.
        timeout_s: seconds the whole job may take.
        echo: which lines of the output to copy to this process's stderr as they come (progress).
    """
    master = nodes.nodes[0]
    procs = []
    for node in nodes.nodes:
        node_env = {**(os.environ if env is None else env), "GLOO_SOCKET_IFNAME": node.ifname}
        argv = torchrun_argv(node, master, len(nodes.nodes), nproc_per_node, target)
        procs.append(
            nodes.launch(node, argv, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outputs: list[str] = [""] * len(procs)
    readers = [threading.Thread(target=_drain, args=(p, outputs, i, echo), daemon=True) for i, p in enumerate(procs)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout_s
    timed_out = False
    while any(p.poll() is None for p in procs) and not any(p.returncode for p in procs):
        if time.monotonic() > deadline:
            timed_out = True
            break
        time.sleep(0.05)
    failed = [i for i, p in enumerate(procs) if p.returncode]
    if timed_out or failed:
        nodes.kill_processes()
    for reader in readers:
        reader.join(timeout=5)
    if timed_out or failed:
        which = f"timed out after {timeout_s:g} s" if timed_out else f"failed on node {failed[0]}"
        tails = "\n".join(f"--- node {i} ---\n{out[-4000:]}" for i, out in enumerate(outputs))
        raise RuntimeError(f"torchrun {which}:\n{tails}")
    return outputs


def _drain(proc: subprocess.Popen, outputs: list[str], index: int, echo: Callable[[str], bool]) -> None:
    for line in proc.stdout:
        outputs[index] += line
        if echo(line):
            sys.stderr.write(line)
            sys.stderr.flush()


def link_bytes(ifname: str) -> tuple[int, int]:
    """(bytes sent, bytes received) by ``ifname`` so far, read from ``/sys/class/net`` by a process inside
    its namespace (a rank: ``ip netns exec`` mounts that namespace's ``/sys``)."""
    base = f"/sys/class/net/{ifname}/statistics"
    with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
        return int(tx.read()), int(rx.read())
