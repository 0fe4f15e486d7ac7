"""Make ``deepspeed/loss_scale_traces.json``: DeepSpeed's fp16 dynamic loss scale, step by step.

``tests/optim/test_optim.py`` replays these overflow sequences through ``zero_kernels.precision.LossScaler``
and compares the scale and hysteresis after every step with DeepSpeed's. DeepSpeed's
``DynamicLossScaler`` is plain Python, so it runs here without a GPU (fp16 training itself does not
run on DeepSpeed's CPU accelerator). Needs deepspeed (see ``make_deepspeed_fixtures.py``)::

    /tmp/venv-ds/bin/python tests/data/make_loss_scale_traces.py tests/data/deepspeed/loss_scale_traces.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

# (initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale)
CONFIGS = [
    (4, 2, 2, False, 1.0),
    (4, 1, 1, False, 1.0),
    (6, 3, 2, True, 1.0),
    (5, 4, 3, False, 4.0),
    (3, 2, 1, True, 2.0),
    (16, 1000, 2, False, 1.0),
]
STEPS = 60


def _sequences(seed: int) -> list[list[bool]]:
    rng = random.Random(seed)
    runs = [[False] * STEPS, [True, True] + [False] * (STEPS - 2)]
    for p in (0.1, 0.3, 0.6):
        runs.append([rng.random() < p for _ in range(STEPS)])
    return runs


def _trace(config: tuple, overflows: list[bool]) -> dict:
    power, window, hysteresis, consecutive, min_scale = config
    scaler = DynamicLossScaler(init_scale=2.0**power, scale_window=window, min_scale=min_scale,
                               delayed_shift=hysteresis, consecutive_hysteresis=consecutive)  # fmt: skip
    scales, hysteresis_left, raised_at = [], [], None
    for step, overflow in enumerate(overflows):
        try:
            scaler.update_scale(overflow)
        except Exception:  # DeepSpeed raises a bare Exception at the minimum scale
            raised_at = step
            break
        scales.append(scaler.cur_scale)
        hysteresis_left.append(scaler.cur_hysteresis)
    return {"scales": scales, "hysteresis_left": hysteresis_left, "raised_at": raised_at}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_distributed(dist_backend="gloo", verbose=False)  # the scaler asks for the rank when it logs
    cases = []
    keys = ("initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis", "min_loss_scale")
    for c, config in enumerate(CONFIGS):
        for overflows in _sequences(c):
            cases.append({"fp16": dict(zip(keys, config)), "overflows": overflows, **_trace(config, overflows)})
    with open(args.out, "w") as f:
        json.dump({"deepspeed": deepspeed.__version__, "cases": cases}, f, indent=None, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
