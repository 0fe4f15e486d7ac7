"""One rank of the ``links`` benchmark, started by torchrun inside an emulated node (``benchmarks.netns``).

``python -m benchmarks._links_rank OUT_DIR CONFIG_JSON``: joins the gloo group torchrun describes and
goes through the config's phases in order; a phase is a link rate and the providers to measure at
it. Local rank 0 of each node limits its node's end of the link to the rate, every rank probes the
link and the host (``_probe``), then trains each
provider on the e2e model. Writes ``OUT_DIR/rank<R>.json``: per phase the probe, and per provider
the median step, its parts (forward, backward, optimizer step) and the bytes that crossed this
node's end of the link per step, divided among the node's ranks (``LOCAL_WORLD_SIZE``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from . import e2e, e2e_deepspeed
from .common import end_rank, progress
from .netns import limit_here, link_bytes


def _node_bytes() -> tuple[int, int]:
    return link_bytes(os.environ["GLOO_SOCKET_IFNAME"])


def _exchange(peers: list[int], numel: int, repeat: int) -> float:
    """Seconds for this rank to send ``numel`` fp32 to each of ``peers`` and receive as many from each, while
    every rank does the same with its own peers (receives posted first, as ``comm._exchange`` does)."""
    out, into = torch.ones(numel), [torch.empty(numel) for _ in peers]
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeat):
        works = [dist.irecv(buf, peer) for buf, peer in zip(into, peers)]
        works += [dist.isend(out, peer) for peer in peers]
        for w in works:
            w.wait()
    dist.barrier()
    return (time.perf_counter() - start) / repeat


def _probe(numel: int) -> dict:
    """What the link and the host carry, in bytes per second per node and direction: ``link_Bps`` with
    every rank exchanging with its partner on the other node (the link alone), ``host_Bps`` with every
    rank exchanging with every other (all a node's transfers, over the link and within the node); and
    ``latency_us``, the round trip of a 4-byte exchange across the link."""
    rank, world, local = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    partner = [(rank + local) % world]
    everyone = [r for r in range(world) if r != rank]
    return {
        "link_Bps": local * numel * 4 / _exchange(partner, numel, 2),
        "host_Bps": local * len(everyone) * numel * 4 / _exchange(everyone, numel, 2),
        "latency_us": 1e6 * _exchange(partner, 1, 50),
    }


def _phased_step(provider: str, model: torch.nn.Module, x: torch.Tensor) -> Callable[[], tuple[float, float, float]]:
    """One training step that returns (forward, backward, step) seconds; DeepSpeed's in one piece (step)."""
    if provider.startswith(e2e_deepspeed.PREFIX):
        whole, _ = e2e._train_step(provider, model, x)

        def ds_step() -> tuple[float, float, float]:
            start = time.perf_counter()
            whole()
            return 0.0, 0.0, time.perf_counter() - start

        return ds_step
    module, opt, _ = e2e._build(provider, model)

    def step() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        loss = module(x).square().mean()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    return step


def _step_count(step: Callable[[], tuple], config: dict) -> int:
    """Warm up, then the number of steps to time: enough for ``config["seconds"]`` at the slowest rank's
    warm-up pace, within ``config["steps"]`` (the fewest) and 4 times that; the same on every rank."""
    paces = []
    for _ in range(config["warmup"]):
        start = time.perf_counter()
        step()
        paces.append(time.perf_counter() - start)
    pace = torch.tensor([min(paces)], dtype=torch.float64)
    dist.all_reduce(pace, op=dist.ReduceOp.MAX)
    return max(config["steps"], min(4 * config["steps"], int(config["seconds"] / pace.item())))


def _measure(provider: str, config: dict, local_rank: int) -> dict:
    model = e2e._model(config["width"], config["depth"])
    x = torch.randn(config["rows"], config["width"])
    step = _phased_step(provider, model, x)
    steps = _step_count(step, config)
    dist.barrier()
    before = _node_bytes() if local_rank == 0 else (0, 0)
    totals, phases = [], []
    for _ in range(steps):
        start = time.perf_counter()
        phases.append(step())
        dist.barrier()
        totals.append(time.perf_counter() - start)
    row = {"step_ms": 1e3 * statistics.median(totals), "steps": steps}
    row.update({f"{k}_ms": 1e3 * statistics.median(p[i] for p in phases) for i, k in enumerate(("fwd", "bwd", "opt"))})
    if local_rank == 0:
        after = _node_bytes()
        share = steps * int(os.environ["LOCAL_WORLD_SIZE"])
        row.update(tx_bytes=(after[0] - before[0]) / share, rx_bytes=(after[1] - before[1]) / share)
    return row


def _at_rate(rate: str, providers: list[str], config: dict, local_rank: int, warm: bool) -> dict:
    """Limit this node's end of the link to ``rate`` (``none``: no limit), probe it, measure ``providers``
    (after an unrecorded pass over them if ``warm``)."""
    dist.barrier()
    if local_rank == 0:
        limit_here(os.environ["GLOO_SOCKET_IFNAME"], None if rate == "none" else rate)
    dist.barrier()
    result = {"probe": _probe(config["probe_numel"]), "providers": {}}
    if warm:  # the first measurements of a process run cold (allocations, first calls): not the rate's doing
        for provider in providers:
            _measure(provider, {**config, "warmup": 2, "steps": 1, "seconds": 0}, local_rank)
    for provider in providers:
        if dist.get_rank() == 0:
            progress(rate, provider)
        try:
            result["providers"][provider] = _measure(provider, config, local_rank)
        except Exception as err:  # a provider that does not run here is reported, not fatal
            result["providers"][provider] = {"error": f"{type(err).__name__}: {err}"[:160]}
    return result


def main(out_dir: str, config: dict) -> None:
    """Run ``config["plan"]``, a list of (rate, providers) in order, and write this rank's results."""
    torch.set_num_threads(1)
    local_rank = int(os.environ["LOCAL_RANK"])  # DeepSpeed's wiring rewrites it: read it first
    dist.init_process_group("gloo", timeout=timedelta(seconds=config["timeout_s"]))
    rank = dist.get_rank()
    phases, seen = [], set()
    for rate, providers in config["plan"]:
        phases.append({"rate": rate, **_at_rate(rate, providers, config, local_rank, tuple(providers) not in seen)})
        seen.add(tuple(providers))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "node": int(os.environ["GROUP_RANK"]), "phases": phases}, f)
    dist.destroy_process_group()
    end_rank()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
