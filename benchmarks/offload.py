"""Offload on 2 gloo ranks: the optimizer state on the device, in host memory or on disk, ours next to
DeepSpeed's own offload; and, with ``--big``, a model whose state is several times the memory it runs in.

Every provider is built from the same DeepSpeed JSON (``config``): ours through ``zero_kernels.initialize``,
DeepSpeed through ``deepspeed.initialize``, on the same bf16 MLP and the same batches. Stages 2 and 3:

- ``zk-stageS`` (no offload), ``zk-stageS-cpu`` (``offload_optimizer`` to host memory), ``zk-stageS-nvme``
  (to files under the run's folder, ``--offload-dir``);
- ``deepspeed-stageS-cpu`` (its ``DeepSpeedCPUAdam``, JIT-built with ninja on first use, minutes) and
  ``deepspeed-stage3-nvme`` (its ``async_io`` op, built against ``libaio``); DeepSpeed reads NVMe offload of
  the optimizer only at stage 3. When DeepSpeed is absent, or an op cannot build, its rows say why.

NVMe runs read ahead and write behind (``pipeline_read``/``pipeline_write``) through ``BUFFERS`` host
buffers of ``SUB_GROUP`` elements, for both.

One pair of processes times every provider in interleaved rounds (each round every provider in turn, the
order alternating, each built afresh: warm-up steps, then the median of the timed ones). ``step_ms`` is the
median over the rounds; ``vs_deepspeed`` is DeepSpeed's step with the same offload at the same stage over
ours, the median of the per-round ratios, with ``low``/``high`` and a ``verdict``.

Bytes per step (ours, counted by the offload tier over the timed steps): ``down_MB``/``up_MB`` across the
host link (none where the device is host memory: the tier then uses the shards in place), ``read_MB``/
``written_MB`` of state files; ``grads_read_MB``/``grads_written_MB`` of gradient files (stage 3 with the state
on disk keeps its gradient shards in files; not in ``read_MB``/``written_MB`` nor ``io_of_disk``). The disk's
bandwidth is measured in the same run, in the same folder, before the ranks start, by the offload's own I/O
engine streaming with the run's ``aio`` knobs (``disk_probe``: ``disk_write_GBps``, ``disk_read_GBps`` and
``disk_mixed_GBps``, a read and a write together as the state swap does); ``io_of_disk`` is our state I/O per
step over the step time, as a share of ``disk_mixed_GBps``. ``host_MB``/``disk_MB`` are ``memory_report()``'s
tiers.

``--big``: one rank trains a bf16 model of ``--big-params`` parameters at stage 3 with its optimizer
state on disk (12 bytes per parameter), three times, each in a fresh process: with the parameter shards in
memory, and with them on disk too (``params_on_disk``: ``offload_param`` on nvme with ``max_in_cpu`` 0, since
DeepSpeed's default 1e9 would keep every shard of a model this size in host memory), the latter again with
glibc's ``MALLOC_MMAP_THRESHOLD_`` at 1 MiB (``malloc_mmap_threshold``, as the rank saw it). It reports its peak
resident memory (``VmHWM``; ``steps_peak``: since the optimizer was built), the state's bytes on disk (the
parameter shards' files too), the optimizer state's I/O rate against the disk's over the whole step
(``io_of_disk``) and over the update alone (``update_io_of_disk``: the I/O runs there), and the step against
(state bytes moved / disk bandwidth) (``step_over_io_bound``); the parameter shards' bytes read and written per
step apart (``params_read_GB``, ``params_written_GB``), and the gradient shards' (in files at stage 3 with the
state on disk: ``grads_read_GB``, ``grads_written_GB``); and the same two ratios over every byte the step moves
to and from the disk, the state's and the parameter and gradient shards' (``disk_io_of_disk``,
``step_over_disk_bound``). The disk is measured before and after each case (``disk_probe``); the ratios use the
faster of the two (``disk_mixed_GBps``; ``disk_mixed_GBps_low``: the slower).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from . import disk_probe, e2e_deepspeed
from .common import (
    expect,
    finish_rank,
    free_port,
    join,
    load_average,
    progress,
    provider_rounds,
    ratio_stats,
    rounds_by_provider,
    spawn_ranks,
)

DESCRIPTION = "offload on 2 gloo ranks, stages 2 and 3: none, cpu, nvme (ours) vs DeepSpeed's cpu and nvme"
# Not in the default run: DeepSpeed's CPU Adam and async_io ops build on first use (minutes), and the
# quick form alone takes over a minute on 2 cores. ``python -m benchmarks offload`` runs it.
IN_DEFAULT_RUN = False
WORLD = 2
STAGES = (2, 3)
LR = 1e-4
BUCKET_ELEMENTS = 2_000_000
SUB_GROUP = 1 << 18  # elements per swapped sub-group (DeepSpeed's and ours): 1 MiB of fp32, 16+ per rank
# offload_optimizer.buffer_count: DeepSpeed's pipelined swapper (pipeline_read/write) runs out of swap buffers
# at stage 3 with 4 or 8 here ("try increasing 'buffer_count'"); 16 lets it run.
BUFFERS = 16
AIO = {"block_size": 1_048_576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
       "overlap_events": True}  # fmt: skip
NOTES = [
    "io_of_disk: our state I/O per step (read + written) over the step time, as a share of the disk's bandwidth "
    "measured in this run (disk_mixed_GBps: the same engine streaming a read and a write together, disk_probe)",
]

# glibc raises its mmap threshold (up to 32 MiB) as mmapped blocks are freed, and blocks below it come from the
# heap: bucket-sized blocks freed there once per bucket left the capacity case's steps' peak varying by up to
# 1.2 GB between runs, until backward stopped making them (``offload.mapped``, the scratch pool); the third case
# of ``run_big`` fixes the threshold at 1 MiB (as a user would, with the same variable) to show it is not needed.
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
MMAP_THRESHOLD = 1 << 20

DISK = "disk (this run's folder, the engine streaming)"  # the row of the disk's measured bandwidth
_options: dict[str, Any] = {"dir": None, "big": False, "big_params": 400_000_000}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--offload-dir", metavar="DIR", help="offload: folder for the state files (default: a temp dir)"
    )
    parser.add_argument("--big", action="store_true", help="offload: the capacity case instead (1 rank, NVMe)")
    parser.add_argument("--big-params", type=float, default=4e8, help="offload --big: parameters (default 4e8)")


def configure(args: argparse.Namespace) -> None:
    _options.update(dir=args.offload_dir, big=args.big, big_params=int(args.big_params))


# ---------------------------------------------------------------- the JSON every provider runs
def config(stage: int, device: str, nvme_path: Optional[str], *, micro_batch: int) -> dict:
    """The DeepSpeed config of a run at ``stage`` with the optimizer state on ``device`` (none, cpu, nvme)."""
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": BUCKET_ELEMENTS, "sub_group_size": SUB_GROUP}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
    }
    if device != "none":
        zero["offload_optimizer"] = {"device": device, "pin_memory": True}
    if device == "nvme":
        zero["offload_optimizer"].update(
            nvme_path=nvme_path, buffer_count=BUFFERS, pipeline_read=True, pipeline_write=True
        )
        cfg["aio"] = dict(AIO)
    return cfg


def providers(deepspeed: bool) -> list[str]:
    """Ours at every offload and stage; DeepSpeed's cpu at stages 2 and 3 and nvme at stage 3 when installed."""
    out = [f"zk-stage{s}{suffix}" for s in STAGES for suffix in ("", "-cpu", "-nvme")]
    if deepspeed:
        out += [f"{e2e_deepspeed.PREFIX}{s}-cpu" for s in STAGES] + [f"{e2e_deepspeed.PREFIX}3-nvme"]
    return out


def _parse(provider: str) -> tuple[str, int, str]:
    """``deepspeed-stage3-nvme`` -> (``deepspeed``, 3, ``nvme``); ``zk-stage2`` -> (``zk``, 2, ``none``)."""
    who, _, rest = provider.partition("-stage")
    stage, _, device = rest.partition("-")
    return who, int(stage), device or "none"


def peer_of(provider: str) -> Optional[str]:
    """DeepSpeed's provider with the same offload at the same stage, if it runs one."""
    who, stage, device = _parse(provider)
    if who != "zk" or device == "none" or (device == "nvme" and stage != 3):
        return None
    return f"{e2e_deepspeed.PREFIX}{stage}-{device}"


# ---------------------------------------------------------------- the disk, measured here
# ---------------------------------------------------------------- one provider on one rank
def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
    return nn.Sequential(*layers)


def _tier(opt: Any) -> Any:
    """The optimizer's offload tier, whose ``traffic()`` counts the bytes it moved (None without offload)."""
    return getattr(getattr(opt, "_pipeline", None), "tier", None)


def _traffic(opt: Any) -> dict[str, int]:
    tier = _tier(opt)
    return dict(tier.traffic()) if tier is not None else {}


def _param_traffic(opt: Any) -> dict[str, int]:
    """Bytes of stage 3's parameter shards read from and written to their files (``offload_param`` on nvme)."""
    disk = getattr(getattr(opt, "_pipeline", None), "disk_params", None)
    return dict(disk.files.traffic()) if disk is not None else {}


def _grad_traffic(opt: Any) -> dict[str, int]:
    """Bytes of stage 3's gradient shards read from and written to their files (the state on disk)."""
    disk = getattr(getattr(opt, "_pipeline", None), "disk_grads", None)
    return dict(disk.files.traffic()) if disk is not None else {}


def _build(provider: str, model: nn.Module, x: torch.Tensor, folder: str) -> tuple[Callable[[], None], Any]:
    """(one training step, the optimizer or engine) of ``provider`` on the gloo group already joined."""
    who, stage, device = _parse(provider)
    path = os.path.join(folder, provider) if device == "nvme" else None
    if path:
        os.makedirs(path, exist_ok=True)
    cfg = config(stage, device, path, micro_batch=x.shape[0])
    if who == "zk":
        import zero_kernels as zk

        module, opt = zk.initialize(model, cfg)
        xb = x.to(torch.bfloat16)

        def step() -> None:
            module(xb).float().square().mean().backward()
            opt.step()
            opt.zero_grad()

        return step, opt
    engine = e2e_deepspeed.engine(model, cfg)
    xb = x.to(torch.bfloat16)

    def ds_step() -> None:
        engine.backward(engine(xb).float().square().mean())
        engine.step()

    return ds_step, engine


def _measure(provider: str, width: int, depth: int, steps: int, folder: str) -> dict:
    """A fresh model under ``provider``: the median step (ms) after 2 warm-up steps, bytes per timed step,
    and the offload tiers of ``memory_report()``."""
    model = _model(width, depth)
    step, handle = _build(provider, model, torch.randn(8, width), folder)
    times = []
    before: dict[str, int] = {}
    grads_before: dict[str, int] = {}
    for i in range(steps + 2):
        if i == 2:
            before, grads_before = _traffic(handle), _grad_traffic(handle)
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    moved = {f"{k}_MB": (v - before.get(k, 0)) / steps / 1e6 for k, v in _traffic(handle).items() if k != "init"}
    grads = _grad_traffic(handle).items()
    moved.update({f"grads_{k}_MB": (v - grads_before.get(k, 0)) / steps / 1e6 for k, v in grads})
    report = handle.memory_report() if hasattr(handle, "memory_report") else {}
    tiers = {f"{k}_MB": report[k] / 1e6 for k in ("host", "disk") if k in report}
    return {"ms": 1e3 * statistics.median(times[2:]), **moved, **tiers}


def _timing_rank(rank: int, names: list[str], rounds: int, port: int, shape: tuple[int, int, int], folder: str,
                 out: str) -> None:  # fmt: skip
    """Every provider in interleaved rounds in these processes: provider -> its result per round (or error)."""
    join(rank, WORLD, port, timeout_s=600)
    width, depth, steps = shape
    results = provider_rounds(rank, names, rounds, lambda provider: _measure(provider, width, depth, steps, folder))
    finish_rank(out, rank, results)


# ---------------------------------------------------------------- rows
def _row(results: list) -> dict:
    """One rank's row of a provider: its median step, every round's, and the rest of its last round."""
    errors = [r for r in results if isinstance(r, str)]
    if errors:
        return {"error": errors[0]}
    last = {k: v for k, v in results[-1].items() if k != "ms"}
    times = [r["ms"] for r in results]
    return {"step_ms": statistics.median(times), "rounds_ms": [round(t, 3) for t in times], **last}


def _with_ratios(rows: list[dict], disk: dict) -> list[dict]:
    """Add ``vs_deepspeed`` (DeepSpeed's step with the same offload over ours) and ``io_of_disk`` (the state
    I/O of all ranks, which share the disk, per step over the step time, as a share of the disk's bandwidth)."""
    rounds = rounds_by_provider(rows)
    disk_Bps = disk["disk_mixed_GBps"] * 1e9
    io_MB: dict[str, float] = {}
    for r in rows:
        io_MB[r["provider"]] = io_MB.get(r["provider"], 0.0) + r.get("read_MB", 0) + r.get("written_MB", 0)
    for r in rows:
        peer = peer_of(r["provider"])
        if peer in rounds and r["provider"] in rounds:
            stats = ratio_stats(rounds[peer], rounds[r["provider"]])
            r.update(peer=peer, vs_deepspeed=stats["speedup"], low=stats["low"], high=stats["high"])
            r["verdict"] = stats["verdict"]
        if io_MB[r["provider"]] and r.get("step_ms"):
            r["io_of_disk"] = io_MB[r["provider"]] * 1e6 / (r["step_ms"] / 1e3) / disk_Bps
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per offloaded provider of ours with a DeepSpeed peer: ours against it."""
    rounds = rounds_by_provider(rows)
    out = []
    for ours in dict.fromkeys(r["provider"] for r in rows if "rank" in r):
        peer = peer_of(ours)
        if peer is None:
            continue
        line: dict[str, Any] = {"case": rows[0]["case"], "ours": ours, "best_peer": peer}
        if ours in rounds and peer in rounds:
            line.update(ours_ms=statistics.median(rounds[ours]), peer_ms=statistics.median(rounds[peer]))
            line.update(ratio_stats(rounds[peer], rounds[ours]))
        out.append(line)
    return out


def _folder() -> str:
    base = _options["dir"]
    if base:
        os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix="zk-offload-bench-", dir=base)


def run(quick: bool, shape: Optional[tuple[int, int, int]] = None, rounds: Optional[int] = None) -> list[dict]:
    """The offload comparison (or, with ``--big``, the capacity case)."""
    if _options["big"]:
        return run_big(_options["big_params"])
    width, depth, steps = shape or ((512, 4, 3) if quick else (768, 6, 5))
    rounds = rounds or (3 if quick else 5)
    missing = e2e_deepspeed.unavailable()
    if missing:
        print(f"offload: {missing}", file=sys.stderr)
    names = providers(deepspeed=missing is None)
    params = sum(p.numel() for p in _model(width, depth).parameters())
    case = f"{params / 1e6:.1f}M params bf16"
    expect(len(names) * rounds)
    folder = _folder()
    try:
        disk = disk_probe.measure(folder, AIO)
        found = spawn_ranks(_timing_rank, (names, rounds, free_port(), (width, depth, steps), folder),
                       os.path.join(folder, "timing"), WORLD)  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    found = [got if "error" not in got else {p: [got["error"]] for p in names} for got in found]
    rows = []
    for provider in names:
        for rank in range(WORLD):
            row = _row(found[rank].get(provider, ["not timed"]))
            rows.append({"case": case, "provider": provider, "rank": rank, **row})
    return _with_ratios(rows, disk) + [{"case": case, "provider": DISK, **disk}]


# ---------------------------------------------------------------- the capacity case
def big_model(num_params: int, width: int = 4096) -> nn.Module:
    """A stack of bias-free ``width`` x ``width`` bf16 layers with about ``num_params`` parameters, built in
    bf16 (no fp32 copy ever exists, so the resident peak is the training's)."""
    torch.manual_seed(0)
    depth = max(1, round(num_params / (width * width)))
    layers = [nn.Linear(width, width, bias=False, dtype=torch.bfloat16) for _ in range(depth)]
    for layer in layers:
        nn.init.normal_(layer.weight, std=width**-0.5)
    return nn.Sequential(*layers)


def _peak_rss() -> int:
    """Peak resident bytes of this process since it started or since ``_reset_peak_rss`` (``VmHWM``;
    ``ru_maxrss`` where /proc is absent)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak_rss() -> bool:
    """Restart ``VmHWM`` from the current resident size (Linux: ``5`` into ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def big_config(folder: str, params_on_disk: bool) -> dict:
    """The capacity case's config: stage 3, the state on disk, and with ``params_on_disk`` the parameter shards
    too (every one: ``max_in_cpu`` 0)."""
    cfg = config(3, "nvme", folder, micro_batch=4)
    if params_on_disk:
        cfg["zero_optimization"]["offload_param"] = {
            "device": "nvme", "nvme_path": folder, "buffer_count": 5, "buffer_size": 100_000_000, "max_in_cpu": 0
        }  # fmt: skip
    return cfg


def _big_rank(
    rank: int, num_params: int, width: int, steps: int, params_on_disk: bool, port: int, folder: str, out: str
) -> None:
    """One rank trains the big model at stage 3 with its optimizer state on disk; it writes what it measured:
    the peak resident memory of the whole run and of its steps alone (after the optimizer was built), the
    state's bytes on disk, the bytes read and written per step, forward + backward and update times."""
    import zero_kernels as zk

    join(rank, 1, port, timeout_s=600)
    torch.set_num_threads(os.cpu_count() or 1)
    model = big_model(num_params, width)
    params = sum(p.numel() for p in model.parameters())
    x = torch.randn(4, width, dtype=torch.bfloat16)
    module, opt = zk.initialize(model, big_config(folder, params_on_disk))
    built_rss = _peak_rss()
    resettable = _reset_peak_rss()
    marks, state_on_disk = [], 0
    before: dict[str, int] = {}
    params_before: dict[str, int] = {}
    grads_before: dict[str, int] = {}
    for i in range(steps + 1):
        if i == 1:
            before, params_before, grads_before = _traffic(opt), _param_traffic(opt), _grad_traffic(opt)
        start = time.perf_counter()
        module(x).float().square().mean().backward()
        middle = time.perf_counter()
        opt.step()
        opt.zero_grad()
        marks.append((start, middle, time.perf_counter()))
        state_on_disk = max(state_on_disk, opt.memory_report().get("disk", 0))
    moved = {k: (v - before.get(k, 0)) / steps for k, v in _traffic(opt).items()}
    params_moved = {k: (v - params_before.get(k, 0)) / steps for k, v in _param_traffic(opt).items()}
    grads_moved = {k: (v - grads_before.get(k, 0)) / steps for k, v in _grad_traffic(opt).items()}
    timed = marks[1:]
    result = {
        "params": params,
        "step_s": statistics.median(end - start for start, _, end in timed),
        "fwd_bwd_s": statistics.median(middle - start for start, middle, _ in timed),
        "update_s": statistics.median(end - middle for _, middle, end in timed),
        "peak_rss_GB": max(built_rss, _peak_rss()) / 1e9,
        "steps_peak_rss_GB": _peak_rss() / 1e9 if resettable else None,
        "state_on_disk_GB": state_on_disk / 1e9,
        "read_GB": moved.get("read", 0) / 1e9,
        "written_GB": moved.get("written", 0) / 1e9,
        "params_read_GB": params_moved.get("read", 0) / 1e9,
        "params_written_GB": params_moved.get("written", 0) / 1e9,
        "grads_read_GB": grads_moved.get("read", 0) / 1e9,
        "grads_written_GB": grads_moved.get("written", 0) / 1e9,
        "malloc_mmap_threshold": os.environ.get(MMAP_ENV),
    }
    finish_rank(out, rank, result)


def run_big(num_params: int, steps: int = 3, width: int = 4096) -> list[dict]:
    """The capacity case, without and with the parameter shards on disk, the latter also with glibc's mmap
    threshold fixed (``MMAP_THRESHOLD``), each in a fresh process (its peak resident memory is its own)."""
    cases = ((False, None), (True, None), (True, MMAP_THRESHOLD))
    expect(len(cases))
    return [_big_case(num_params, steps, width, on_disk, threshold) for on_disk, threshold in cases]


def _big_case(num_params: int, steps: int, width: int, params_on_disk: bool, threshold: Optional[int]) -> dict:
    folder = _folder()
    provider = "zk-stage3-nvme" + ("-params-nvme" if params_on_disk else "")
    provider += f"+mmap-{threshold >> 20}MiB" if threshold else ""
    progress(f"{num_params / 1e6:.0f}M params bf16, stage 3, state on disk", provider)
    load_before = load_average()
    try:
        probes = [disk_probe.measure(folder, AIO)]
        args = (num_params, width, steps, params_on_disk, free_port(), folder)
        with _malloc_threshold(threshold):
            (got,) = spawn_ranks(_big_rank, args, os.path.join(folder, "big"), 1)
        probes.append(disk_probe.measure(folder, AIO))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    row: dict[str, Any] = {"case": f"{num_params / 1e6:.0f}M params bf16, 1 rank", "provider": provider}
    row["params_on_disk"] = params_on_disk
    if load_before is not None:
        row["load_1min_before"] = load_before[0]
    row.update(got)
    row.update(max(probes, key=lambda p: p["disk_mixed_GBps"]))
    row["disk_mixed_GBps_low"] = min(p["disk_mixed_GBps"] for p in probes)
    load = load_average()
    if load is not None:
        row["load_1min"] = load[0]
    if "error" not in got:
        row.update(_big_ratios(got, row["disk_mixed_GBps"] * 1e9))
    return row


@contextlib.contextmanager
def _malloc_threshold(nbytes: Optional[int]) -> Iterator[None]:
    """Ranks spawned in the block start with glibc's ``MALLOC_MMAP_THRESHOLD_`` at ``nbytes`` (None: unset,
    glibc's own); the variable is put back as it was."""
    before = os.environ.pop(MMAP_ENV, None)
    if nbytes is not None:
        os.environ[MMAP_ENV] = str(nbytes)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(MMAP_ENV, None)
        else:
            os.environ[MMAP_ENV] = before


def _big_ratios(got: dict, disk_Bps: float) -> dict:
    """The capacity case's memory and I/O ratios from a rank's measurements ``got`` and the disk's bandwidth."""
    state = 12 * got["params"]
    io_bytes = (got["read_GB"] + got["written_GB"]) * 1e9
    shards = got["params_read_GB"] + got["params_written_GB"] + got["grads_read_GB"] + got["grads_written_GB"]
    disk_bytes = io_bytes + shards * 1e9
    return dict(
        state_GB=state / 1e9,
        state_over_rss=state / (got["peak_rss_GB"] * 1e9),
        state_over_steps_rss=state / (got["steps_peak_rss_GB"] * 1e9) if got["steps_peak_rss_GB"] else None,
        io_GBps=io_bytes / got["step_s"] / 1e9,
        io_of_disk=io_bytes / got["step_s"] / disk_Bps,
        update_io_of_disk=io_bytes / got["update_s"] / disk_Bps,
        step_over_io_bound=got["step_s"] / (io_bytes / disk_Bps) if io_bytes else None,
        disk_io_of_disk=disk_bytes / got["step_s"] / disk_Bps,
        step_over_disk_bound=got["step_s"] / (disk_bytes / disk_Bps) if disk_bytes else None,
    )
