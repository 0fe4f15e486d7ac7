"""SuperOffload (``offload_optimizer.super_offload``): the host Adam of each bucket run during backward, against the
same step run after it, on one rank at stage 3 with the optimizer state in host memory (a bf16 MLP).

Two backward passes:

- ``host backward``: the model's own, on the host, as on this machine: backward and the speculative updates share
  its cores and memory bandwidth;
- ``device backward (emulated)``: each layer's backward also waits ``DEVICE_MS`` milliseconds with the host idle,
  as the host waits on a GPU's backward; the updates run during that wait.

torch runs on one intra-op thread (``benchmarks.common.join``): the updates get the other core. Per case, the two
providers (``super_offload`` off and on) run in interleaved rounds, each built afresh: warm-up steps, then the
median step. ``speedup`` is off over on (above 1: speculation is faster), with its spread over the rounds;
``kept`` is the share of the buckets updated during backward that the step kept (the others are updated again).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any, Optional

import torch
from torch import nn

import zero_kernels as zk

from .common import expect, finish_rank, free_port, join, provider_rounds, ratio_stats, spawn_ranks

DESCRIPTION = "super_offload: the host Adam during backward vs after it (stage 3, cpu tier, 1 rank)"
IN_DEFAULT_RUN = False
DEVICE_MS = 10.0
CASES = ("host backward", "device backward (emulated)")
PROVIDERS = ("zk-stage3-cpu", "zk-stage3-cpu-super_offload")


class DeviceWait(torch.autograd.Function):
    """Identity forward; its backward waits ``DEVICE_MS`` with the host idle (a device computing)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(DEVICE_MS / 1e3)
        return grad


class Layer(nn.Module):
    def __init__(self, width: int, wait: bool) -> None:
        super().__init__()
        self.linear, self.wait = nn.Linear(width, width), wait

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x))
        return DeviceWait.apply(y) if self.wait else y


def _config(speculate: bool, batch: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": batch, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 2_000_000, "stage3_param_persistence_threshold": 0,
                              "offload_optimizer": {"device": "cpu", "super_offload": speculate}},
    }  # fmt: skip


def _measure(provider: str, case: str, shape: tuple[int, int, int, int]) -> dict:
    """A fresh model: the median step (ms) after 2 warm-up steps, and what the speculation kept."""
    width, depth, batch, steps = shape
    torch.manual_seed(0)
    model = nn.Sequential(*[Layer(width, case != CASES[0]) for _ in range(depth)]).to(torch.bfloat16)
    model, opt = zk.initialize(model, _config(provider.endswith("super_offload"), batch))
    x = torch.randn(batch, width, dtype=torch.bfloat16)
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    spec = opt._pipeline.speculation
    return {"ms": 1e3 * statistics.median(times[2:]), "kept": spec.kept / spec.ran if spec and spec.ran else None}


def _rank(rank: int, rounds: int, port: int, shape: tuple[int, int, int, int], out: str) -> None:
    join(rank, 1, port, timeout_s=600)
    found = {}
    for case in CASES:
        found[case] = provider_rounds(rank, list(PROVIDERS), rounds, lambda p, c=case: _measure(p, c, shape))
    finish_rank(out, rank, found)


def run(quick: bool, shape: Optional[tuple[int, int, int, int]] = None, rounds: Optional[int] = None) -> list[dict]:
    """Both cases, both providers, interleaved rounds in one process."""
    shape = shape or ((1024, 8, 32, 5) if quick else (2048, 8, 64, 8))
    rounds = rounds or (3 if quick else 5)
    expect(len(CASES) * len(PROVIDERS) * rounds)
    with tempfile.TemporaryDirectory() as folder:
        found = spawn_ranks(_rank, (rounds, free_port(), shape), os.path.join(folder, "out"), 1)[0]
    params = shape[1] * (shape[0] * shape[0] + shape[0])
    rows = []
    for case in CASES:
        results = found.get(case, {p: [found.get("error", "not run")] for p in PROVIDERS})
        rows += _rows(f"{params / 1e6:.1f}M params bf16, {case}", results)
    return rows


def _rows(case: str, results: dict[str, list]) -> list[dict]:
    rows = []
    for provider in PROVIDERS:
        errors = [r for r in results[provider] if isinstance(r, str)]
        if errors:
            rows.append({"case": case, "provider": provider, "error": errors[0]})
            continue
        times = [r["ms"] for r in results[provider]]
        rows.append({"case": case, "provider": provider, "step_ms": statistics.median(times),
                     "rounds_ms": [round(t, 2) for t in times], "kept": results[provider][-1]["kept"]})  # fmt: skip
    if all("rounds_ms" in r for r in rows):
        stats = ratio_stats(rows[0]["rounds_ms"], rows[1]["rounds_ms"])
        rows[1].update(speedup=stats["speedup"], low=stats["low"], high=stats["high"], verdict=stats["verdict"])
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per case: speculation against the same step without it."""
    return [
        {"case": r["case"], "ours": r["provider"], "best_peer": PROVIDERS[0], "speedup": r["speedup"],
         "low": r["low"], "high": r["high"], "verdict": r["verdict"]}
        for r in rows if "speedup" in r
    ]  # fmt: skip
