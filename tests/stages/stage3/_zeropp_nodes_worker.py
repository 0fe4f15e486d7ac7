"""One rank's runs of ``test_zeropp_nodes.py``, run by the two-node job (``tests.helpers.nodes``) under torchrun on
an emulated node (``benchmarks.netns``).

``run(OUT_DIR)``: trains the same model with plain stage 3 and with ZeRO++ options,
counts the bytes its node sent over the link per step (``tx_bytes`` of its end, the mean over the steps after
the first: a gather issued near a step's end, a prefetch, may fall into either step), and writes per run the
losses and those bytes to ``OUT_DIR/<rank>.json`` (or the traceback).
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zero_kernels as zk
from benchmarks.netns import link_bytes

RUNS = {
    "plain": {},
    "hpz": {"zero_hpz_partition_size": 2},
    "qwz+hpz": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2},
    "zero++": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True},
}
STEPS, WIDTH = 5, 128


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.Linear(WIDTH, 8))


def _run(rank: int, options: dict) -> dict:
    model = _model()
    opt = zk.ShardedFusedAdam(model, lr=1e-3, stage=3, stage3_param_persistence_threshold=0, **options)
    torch.manual_seed(rank)
    x = torch.randn(8, WIDTH)
    losses, sent = [], 0
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    for step in range(STEPS):
        dist.barrier()
        before = link_bytes(ifname)[0]
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if step > 0:  # the first step also checks and sets up
            sent += link_bytes(ifname)[0] - before
        losses.append(loss.item())
    return {"losses": losses, "tx_bytes": sent / (STEPS - 1), "params": sum(p.ds_numel for p in model.parameters())}


def run(out: str) -> None:
    rank = dist.get_rank()
    try:
        result = {name: _run(rank, options) for name, options in RUNS.items()}
    except Exception:
        result = {"error": traceback.format_exc()}
    Path(out, f"{rank}.json").write_text(json.dumps(result))
