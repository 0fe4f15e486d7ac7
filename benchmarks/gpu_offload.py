"""GPU check of offload: bytes over the bus per step, step time with and without offload, overlap.

``python benchmarks/gpu_offload.py [--device cpu] [--json DIR]`` initialises a world-size-1 process group
(NCCL on CUDA; gloo with ``--device cpu``, the smoke run for machines without a GPU, where the offload tier
is made to copy as from a GPU: ``HostTier.share_host`` off) and, at stages 2
and 3, trains a bf16 MLP on the same batches twice, each from a DeepSpeed config through
``zero_kernels.initialize``: without offload, and with ``"offload_optimizer": {"device": "cpu",
"pin_memory": true}`` (the optimizer state in page-locked host memory, updated by the C++ CPU Adam);
stage 3 once more with ``"offload_param": {"device": "cpu"}`` too (the HF ZeRO-3 template: the
parameter shards in host memory, copied up at each gather), and once with ``offload_param`` alone (the state on
the device, the shards in host memory: the device's update runs on a copy of each bucket's shard).

Checks (each guarded; the JSON is written after each):

- ``stageS offload cpu: bytes per step``: what the offload tier counted crossing the bus per step, each
  way between 2 and 2.01 bytes per parameter (bf16: the gradient shard down, the updated parameter shard
  up; the buckets' padding on top: the fingerprints that find edits are compared on the device and never
  cross), so at most ~4 bytes per parameter in all.
- ``stageS offload cpu: weights as without offload``: after the steps every parameter within one bf16
  ulp of its tensor's largest magnitude of the run without offload (the host runs the C++ Adam, the
  device Triton's: the same fp32 math, whose last bit may round apart).
- ``stage3 offload cpu+params: ...``: the same two checks with ``offload_param``: the gradient down as
  above, nothing up at the step but the persistent units' shards, and the gathers' copies up counted
  apart (``gather_up_bytes_per_param``: about 2 per gather, a forward and a backward gather per step).
- ``stage3 offload params: ...``: ``offload_param`` alone: 2 bytes per parameter of the sharded units up before
  the device's update and 2 down after it, and the weights as without offload.

Timings (the ``offload`` rows): the median training step without and with offload (wall clock, the
device synchronised after every step: the host's Adam is part of the step), ``bus_ms`` the same bytes
copied alone (page-locked, down then up), ``host_adam_ms`` the C++ Adam alone on a state of the shard's
size with the tier's threads, and ``hidden`` = (plain + bus + host Adam - offload) / (bus + host Adam):
the share of the offload's own work that did not lengthen the step (1: all of it hidden; 0: none; below
0: it slowed the rest down too).

Exit status: 0 every check passes, 1 a check failed, 2 CUDA asked for but absent (every check written as
skipped).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

from benchmarks.gpu_report import Report  # noqa: E402
from benchmarks.gpu_script import join_alone, main_with_smoke_run  # noqa: E402

VARIANTS = ((2, True, False), (3, True, False), (3, True, True), (3, False, True))  # (stage, optimizer, params)
LR = 1e-3
BF16_ULP = 2.0**-7  # bf16 keeps 8 significant bits: one ulp is at most 2^-7 of a value's magnitude
TRAFFIC_SLACK = 0.01  # bytes per parameter each way may exceed 2 by this (the buckets' padding)


@dataclass(frozen=True)
class Config:
    """Model and run sizes for one device."""

    device: str
    width: int
    depth: int
    rows: int
    steps: int
    warmup: int
    repeat: int


CONFIGS = {
    # about 76M parameters; three variants of 2 runs of 3 + 4 steps fit the step's time limit as two of 3 + 7 did;
    # the fourth, last (a limit that stops it keeps the others' results), runs no host Adam
    "cuda": Config("cuda", width=1536, depth=4, rows=256, steps=3, warmup=1, repeat=3),
    "cpu": Config("cpu", width=64, depth=2, rows=8, steps=3, warmup=1, repeat=3),
}


CHECKS = ("bytes per step", "weights as without offload")


def check_name(stage: int, what: str, params: bool = False, optimizer: bool = True) -> str:
    offloaded = "+".join(["cpu"] * optimizer + ["params"] * params)
    return f"stage{stage} offload {offloaded}: {what}"


def check_names() -> list[str]:
    return [check_name(s, what, params, optimizer) for s, optimizer, params in VARIANTS for what in CHECKS]


def make_model(cfg: Config) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(cfg.depth):
        layers += [nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(), nn.Linear(4 * cfg.width, cfg.width)]
    return nn.Sequential(*layers).to(cfg.device)


def ds_config(stage: int, offload: bool, cfg: Config, numel: int, params: bool = False) -> dict:
    """The DeepSpeed config of one run: bf16, AdamW, buckets of about 1/7 of the model."""
    zero = {"stage": stage, "reduce_bucket_size": numel // 7 + 1}
    if stage == 3:  # the biases persistent, every weight in a sharded unit (on the smoke run's small model too)
        zero["stage3_param_persistence_threshold"] = 4 * cfg.width + 1
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": cfg.rows,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": zero,
    }


def _sync(cfg: Config) -> None:
    if cfg.device == "cuda":
        torch.cuda.synchronize()


def _tier(opt) -> Optional[object]:
    """The optimizer's offload tier (its ``traffic()`` counts the bytes that crossed), or None."""
    return getattr(getattr(opt, "_pipeline", None), "tier", None)


def _host_params(opt) -> dict[str, int]:
    """Bytes stage 3's device update copied up and down for shards in host memory (``offload_param`` without all
    the state offloaded), else nothing."""
    host = getattr(getattr(opt, "_pipeline", None), "host_params", None)
    return {} if host is None else host.traffic()


def _moved(opt) -> dict[str, int]:
    """What crossed so far, each way (the tier's and the host shards' copies) and for the gathers."""
    tier = _tier(opt)
    moved = {way: 0 for way in ("down", "up")}
    for counted in (dict(tier.traffic()) if tier is not None else {}, _host_params(opt)):
        for way in moved:
            moved[way] += counted.get(way, 0)
    moved["gather_up"] = _gather_uploads(opt)
    return moved


def _gather_uploads(opt) -> int:
    """Bytes of host parameter shards stage 3 copied up for its gathers (``offload_param``), else 0."""
    gathers = getattr(getattr(opt, "_pipeline", None), "unit_gathers", None)
    return getattr(gathers, "uploaded", 0)


def _device_share(opt) -> float:
    """The share of the parameters whose shards stay on the device with ``offload_param`` (persistent units)."""
    buffers = opt._pipeline.buffers
    total = sum(buf.layout.shard_numel for buf in buffers)
    return sum(buf.layout.shard_numel for buf in buffers if buf.persistent) / total


class Run:
    """One model trained at ``stage``, with or without offload: its weights after ``cfg.steps`` steps, the
    bytes its tier moved per step, and its median step time."""

    def __init__(self, stage: int, offload: bool, cfg: Config, params: bool = False):
        import zero_kernels as zk

        model = make_model(cfg)
        self.numel = sum(p.numel() for p in model.parameters())
        self.model, self.opt = zk.initialize(model, ds_config(stage, offload, cfg, self.numel, params))
        self.cfg = cfg
        self.x = torch.randn(cfg.rows, cfg.width, generator=torch.Generator().manual_seed(1)).to(cfg.device)
        self.x = self.x.to(torch.bfloat16)

    def step(self) -> None:
        self.model(self.x).float().square().mean().backward()
        self.opt.step()
        self.opt.zero_grad()

    def train(self) -> dict[str, float]:
        """``cfg.steps`` steps; the bytes per step (``down``, ``up``, ``gather_up``: ``_moved``) over them."""
        before = _moved(self.opt)
        for _ in range(self.cfg.steps):
            self.step()
        _sync(self.cfg)
        return {k: (v - before[k]) / self.cfg.steps for k, v in _moved(self.opt).items()}

    def step_ms(self) -> float:
        times = []
        for i in range(self.cfg.warmup + self.cfg.repeat):
            _sync(self.cfg)
            start = time.perf_counter()
            self.step()
            _sync(self.cfg)
            if i >= self.cfg.warmup:
                times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)


def check_bytes(numel: int, moved: dict[str, float], up_share: float = 1.0, down_share: float = 1.0) -> list[str]:
    """2 bytes per parameter down for the ``down_share`` of the parameters, and up for the ``up_share`` the step
    sends up."""
    problems = []
    for way, share in (("down", down_share), ("up", up_share)):
        per_param, lo = moved.get(way, 0.0) / numel, 2.0 * share
        if not lo <= per_param <= lo + TRAFFIC_SLACK:
            problems.append(
                f"{way}: {per_param:.4f} bytes per parameter per step, expected {lo:.4f} to +{TRAFFIC_SLACK}"
            )
    return problems


def check_weights(ours: nn.Module, plain: nn.Module) -> list[str]:
    problems = []
    for (name, p), q in zip(ours.named_parameters(), plain.parameters()):
        a, b = p.detach().float(), q.detach().float()
        tol = BF16_ULP * float(b.abs().max())
        worst = float((a - b).abs().max()) if a.numel() else 0.0
        if not worst <= tol:  # NaN fails too
            problems.append(f"{name}: differs by {worst:.3g} from the run without offload (tolerance {tol:.3g})")
    return problems


def _compare(ours: Run, plain: Run) -> list[str]:
    """``check_weights`` on the full parameters (stage 3 gathers them inside the block)."""
    with ours.opt.gathered_params(), plain.opt.gathered_params():
        return check_weights(ours.model, plain.model)


def bus_ms(numel: int, cfg: Config) -> float:
    """The offload's bus traffic alone: 2 bytes per parameter down into page-locked memory, then 2 up."""
    pin = cfg.device == "cuda"
    device_side = torch.randn(numel, device=cfg.device).to(torch.bfloat16)
    host = torch.empty(numel, dtype=torch.bfloat16, pin_memory=pin)
    times = []
    for i in range(cfg.warmup + cfg.repeat):
        _sync(cfg)
        start = time.perf_counter()
        host.copy_(device_side, non_blocking=pin)
        _sync(cfg)
        device_side.copy_(host, non_blocking=pin)
        _sync(cfg)
        if i >= cfg.warmup:
            times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def host_adam_ms(numel: int, cfg: Config, threads: int) -> float:
    """The host tier's update alone: the C++ Adam over ``numel`` elements of fp32 state, bf16 in and out."""
    from zero_kernels.kernels import adam_step

    master, m, v = (torch.randn(numel) for _ in range(3))
    grad, out = torch.randn(numel).to(torch.bfloat16), torch.empty(numel, dtype=torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = []
        for i in range(cfg.warmup + cfg.repeat):
            start = time.perf_counter()
            adam_step(master, grad, m, v, lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1, out=out)
            if i >= cfg.warmup:
                times.append(1e3 * (time.perf_counter() - start))
    finally:
        torch.set_num_threads(before)
    return statistics.median(times)


def _shares(opt, optimizer: bool, params: bool) -> tuple[float, float]:
    """The shares of the parameters whose 2 bytes go (up, down) at the step: the tier's gradients down and
    parameters up; with ``offload_param`` too, only the persistent units' parameters up; alone, the sharded units'
    shards up and down around the device's update."""
    if not params:
        return 1.0, 1.0
    kept = _device_share(opt)
    return (kept, 1.0) if optimizer else (1.0 - kept, 1.0 - kept)


def run_stage(stage: int, cfg: Config, report: Report, params: bool = False, optimizer: bool = True) -> dict:
    """Check and time one stage (``optimizer``: ``offload_optimizer`` on, ``params``: ``offload_param``); its
    timing row."""
    plain, offloaded = Run(stage, False, cfg), Run(stage, optimizer, cfg, params)
    plain.train()
    moved = offloaded.train()
    up_share, down_share = _shares(offloaded.opt, optimizer, params)
    names = [check_name(stage, what, params, optimizer) for what in CHECKS]
    report.run(names[0], lambda: check_bytes(offloaded.numel, moved, up_share, down_share))
    report.run(names[1], lambda: _compare(offloaded, plain))
    row = {"stage": stage, "offload_optimizer": optimizer, "offload_param": params, "params": offloaded.numel}
    row.update(plain_ms=plain.step_ms(), offload_ms=offloaded.step_ms())
    row.update({f"{k}_bytes_per_param": v / offloaded.numel for k, v in moved.items()})
    threads = getattr(_tier(offloaded.opt), "threads", torch.get_num_threads())
    adam_ms = host_adam_ms(offloaded.numel, cfg, threads) if optimizer else 0.0  # alone: no host Adam runs
    row.update(bus_ms=bus_ms(offloaded.numel, cfg), host_adam_ms=adam_ms)
    work = row["bus_ms"] + row["host_adam_ms"]
    row["hidden"] = (row["plain_ms"] + work - row["offload_ms"]) / work
    return row


def run_all(cfg: Config, report: Report) -> int:
    if cfg.device == "cpu":
        from zero_kernels.offload import HostTier

        torch.set_num_threads(1)  # a smoke run on a small, possibly busy machine
        HostTier.share_host = False  # it stands in for a GPU: the tier copies, as it does from one
    backend = join_alone(cfg.device)
    rows: list[dict] = []
    try:
        where = torch.cuda.get_device_name() if cfg.device == "cuda" else "CPU"
        print(f"gpu_offload: {where}, {backend} world size 1, torch {torch.__version__}")
        for stage, optimizer, params in VARIANTS:
            try:
                rows.append(run_stage(stage, cfg, report, params, optimizer))
            except Exception as err:  # its checks not yet recorded fail; the next stage still runs
                done = {c["check"] for c in report.checks}
                for name in (check_name(stage, what, params, optimizer) for what in CHECKS):
                    if name not in done:
                        report.record(name, "FAIL", [f"raised: {type(err).__name__}: {err}"])
            report.set("offload", rows)
        for r in rows:
            print(
                f"  stage {r['stage']}{'' if r['offload_optimizer'] else ' (state on the device)'}"
                f"{' +offload_param' if r['offload_param'] else ''}: "
                f"{r['params'] / 1e6:.1f}M params, step {r['plain_ms']:.1f} ms without offload, "
                f"{r['offload_ms']:.1f} ms with; bus {r['bus_ms']:.1f} ms, host Adam {r['host_adam_ms']:.1f} ms alone; "
                f"hidden {r['hidden']:.2f}"
            )
    finally:
        dist.destroy_process_group()
    return report.exit_status()


def main(argv: Optional[list[str]] = None) -> int:
    return main_with_smoke_run("gpu_offload", CONFIGS, check_names, run_all, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
