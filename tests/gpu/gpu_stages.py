"""GPU check of the whole stage path: every ZeRO stage on one rank, NCCL, against torch.optim.AdamW.

``python tests/gpu/gpu_stages.py [--device cpu] [--json DIR]`` initialises a world-size-1 process
group (NCCL on CUDA; gloo with ``--device cpu``, the smoke run for machines without a GPU) and, for
stages 0-3 in fp32 and bf16, trains a small MLP a few steps with ``ShardedFusedAdam`` (``impl``
auto: the Triton kernels on CUDA, the C++ kernels on CPU; the comm engine of ``ZERO_KERNELS_COMM``)
in lock-step with ``torch.optim.AdamW`` on a deep copy, checking every parameter after every step.
Then it times a training step (forward + backward + step + zero_grad, median, CUDA events on a GPU)
of each stage next to ``torch.optim.AdamW(fused=True)`` on the same model. Buckets hold about 1/7 of
the model, so parameters straddle buckets; at stage 3 every weight matrix is gathered and freed
around its use. Last, an fp16 run per stage with dynamic loss scaling and one forced overflow: that
step must be skipped on every parameter, the scale must halve, and the next steps must train.

Tolerances (as ``tests/helpers/lockstep.py``, from DESIGN.md). fp32: ``|ours - torch| <= 1e-5 |torch|
+ 1e-6 max|torch|`` per tensor (the kernel is within 1.3e-6 relative per step, and on one rank the
gradients are the same). bf16: the largest error against an fp32 AdamW run on the same start and
data is at most twice that of torch's AdamW on bf16 parameters, plus one bf16 ulp of the tensor's
scale. ``--json DIR`` writes ``gpu_stages.json`` after every check. Exit status: 0 all match, 1 a
mismatch (or a stage raised), 2 CUDA asked for but absent (every check written as skipped).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from a checkout

from benchmarks.gpu_report import Report  # noqa: E402
from benchmarks.gpu_script import join_alone, main_with_smoke_run  # noqa: E402
from zero_kernels import ShardedFusedAdam, comm  # noqa: E402

LR, WEIGHT_DECAY = 1e-3, 1e-2
RTOL = 1.3e-6  # DESIGN.md: fp32 relative error vs torch per step
STAGES = (0, 1, 2, 3)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FUSED = "torch.AdamW fused"


@dataclass(frozen=True)
class Config:
    """Model and run sizes for one device."""

    device: str
    width: int
    depth: int
    rows: int
    check_steps: int
    warmup: int
    repeat: int


CONFIGS = {
    "cuda": Config("cuda", width=1024, depth=4, rows=256, check_steps=5, warmup=3, repeat=20),
    "cpu": Config("cpu", width=64, depth=2, rows=8, check_steps=3, warmup=2, repeat=5),
}


def make_model(cfg: Config, dtype: torch.dtype) -> nn.Module:
    """``depth`` blocks of Linear(w, 4w), GELU, Linear(4w, w), LayerNorm(w), seeded, on ``cfg.device``."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(cfg.depth):
        w = cfg.width
        layers += [nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w), nn.LayerNorm(w)]
    return nn.Sequential(*layers).to(device=cfg.device, dtype=dtype)


def batch(cfg: Config, step: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(cfg.rows, cfg.width, generator=g).to(device=cfg.device, dtype=dtype)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def zero_options(cfg: Config) -> dict:
    """Buckets of about 1/7 of the model; parameters above ``width`` elements are sharded at stage 3."""
    numel = sum(p.numel() for p in make_model(cfg, torch.float32).parameters())
    return {"reduce_bucket_size": numel // 7 + 1, "stage3_param_persistence_threshold": cfg.width}


def make_ours(model: nn.Module, stage: int, cfg: Config) -> ShardedFusedAdam:
    return ShardedFusedAdam(model, lr=LR, weight_decay=WEIGHT_DECAY, stage=stage, **zero_options(cfg))


def mismatches(ours: torch.Tensor, ref: torch.Tensor, atol: "float | torch.Tensor", what: str) -> list[str]:
    """``[what: description]`` unless ``|ours - ref| <= atol + RTOL |ref|`` everywhere (NaN never passes)."""
    a, e = ours.detach().double().flatten(), ref.detach().double().flatten()
    atol = atol.flatten() if isinstance(atol, torch.Tensor) else atol
    bad = ~((a - e).abs() <= atol + RTOL * e.abs())
    if not bool(bad.any()):
        return []
    i = int(bad.nonzero()[0])
    return [f"{what}: {int(bad.sum())} of {a.numel()} differ, e.g. [{i}] {a[i].item():.9g} vs {e[i].item():.9g}"]


def compare_fp32_step(
    model: nn.Module, ref: nn.Module, ropt: torch.optim.Optimizer, before: list, full: dict, what: str
):
    """One step judged on its own: parameters within RTOL of themselves plus RTOL of torch's update
    (``before``: where the step started), m and v within RTOL of themselves and of their largest element."""
    problems = []
    for i, ((name, p), r, b) in enumerate(zip(model.named_parameters(), ref.parameters(), before)):
        problems += mismatches(p, r, RTOL * (r.detach().double() - b).abs(), f"{what} {name}")
        for key in ("exp_avg", "exp_avg_sq"):
            expected = ropt.state[r][key]
            atol = RTOL * expected.abs().max().item()
            problems += mismatches(full["state"][i][key], expected, atol, f"{what} {name} {key}")
    return problems


def sync_reference(model: nn.Module, ref: nn.Module, ropt: torch.optim.Optimizer, full: dict) -> None:
    """Start torch's next step from ours (parameters, m and v), so that each step is judged on its own."""
    for i, (p, r) in enumerate(zip(model.parameters(), ref.parameters())):
        r.data.copy_(p.detach())
        for key in ("exp_avg", "exp_avg_sq"):
            ropt.state[r][key].copy_(full["state"][i][key])


def compare_bf16(model: nn.Module, ref: nn.Module, low: nn.Module, what: str) -> list[str]:
    """The largest error of each parameter against the fp32 run: at most twice that of torch on bf16 + 1 ulp."""
    problems = []
    for (name, p), r, q in zip(model.named_parameters(), ref.parameters(), low.parameters()):
        e = r.detach().double()
        baseline = (q.detach().double() - e).abs().max().item()
        ulp = torch.finfo(p.dtype).eps * e.abs().max().item()
        err = (p.detach().double() - e).abs().max().item()
        if not err <= 2 * baseline + ulp:
            problems.append(f"{what} {name}: error {err:.3g} > 2 x torch's {baseline:.3g} + {ulp:.3g}")
    return problems


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss_of(model, x.to(next(model.parameters()).dtype)).backward()
    opt.step()
    opt.zero_grad()


def check_stage(stage: int, dtype: torch.dtype, cfg: Config) -> list[str]:
    """Lock-step run of ``stage`` against torch.optim.AdamW; a list of mismatches (empty: all match)."""
    model = make_model(cfg, dtype)
    ref = copy.deepcopy(model).float()
    low = copy.deepcopy(model) if dtype != torch.float32 else None
    opt, ropt = make_ours(model, stage, cfg), _adamw(ref)
    lopt = _adamw(low) if low is not None else None
    for step in range(cfg.check_steps):
        x, what = batch(cfg, step, dtype), f"step {step + 1}"
        before = [r.detach().double() for r in ref.parameters()]
        _train_step(model, opt, x)
        _train_step(ref, ropt, x)
        if low is not None:
            _train_step(low, lopt, x)
            with opt.gathered_params():
                problems = compare_bf16(model, ref, low, what)
        else:
            full = opt.full_state_dict()
            with opt.gathered_params():
                problems = compare_fp32_step(model, ref, ropt, before, full, what)
                sync_reference(model, ref, ropt, full)
        if problems:
            return problems
    return []


class _Clock:
    """Marks on the current CUDA stream (events) or the wall clock; ``ms(a, b)`` after ``done()``."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def done(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, a: object, b: object) -> float:
        return a.elapsed_time(b) if self.cuda else 1e3 * (b - a)


def time_steps(model: nn.Module, opt: torch.optim.Optimizer, cfg: Config, dtype: torch.dtype) -> dict:
    """Median ms of a whole training step and of its ``step`` + ``zero_grad`` part."""
    x = batch(cfg, 0, dtype)
    clock = _Clock(cfg.device == "cuda")
    marks = []
    for i in range(cfg.warmup + cfg.repeat):
        t0 = clock.mark()
        loss_of(model, x).backward()
        t1 = clock.mark()
        opt.step()
        opt.zero_grad()
        t2 = clock.mark()
        if i >= cfg.warmup:
            marks.append((t0, t1, t2))
    clock.done()
    whole = [clock.ms(t0, t2) for t0, _, t2 in marks]
    update = [clock.ms(t1, t2) for _, t1, t2 in marks]
    return {"step_ms": statistics.median(whole), "opt_ms": statistics.median(update)}


def check_fp16_overflow(stage: int, cfg: Config) -> list[str]:
    """fp16 with dynamic loss scaling: a forced overflow skips the step everywhere and halves the scale."""
    model = make_model(cfg, torch.float16)
    fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 100}
    opt = ShardedFusedAdam(model, lr=LR, weight_decay=WEIGHT_DECAY, stage=stage, fp16=fp16, **zero_options(cfg))
    problems = []
    for step in range(4):
        scale = opt.loss_scale
        with opt.gathered_params():
            before = [p.detach().clone() for p in model.parameters()]
        loss = loss_of(model, batch(cfg, step, torch.float16))
        opt.backward(loss * float("inf") if step == 1 else loss)
        opt.step()
        opt.zero_grad()
        with opt.gathered_params():
            changed = [not torch.equal(p, b) for p, b in zip(model.parameters(), before)]
            finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        what = f"fp16 stage {stage} step {step + 1}"
        if step == 1:
            if not opt.last_step.skipped or any(changed) or opt.loss_scale != scale / 2:
                problems.append(
                    f"{what} (overflow): skipped={opt.last_step.skipped}, {sum(changed)} parameters changed, "
                    f"scale {scale} -> {opt.loss_scale} (expected {scale / 2})"
                )
        elif opt.last_step.skipped or not all(changed) or not finite or opt.loss_scale != scale:
            problems.append(
                f"{what}: skipped={opt.last_step.skipped}, {len(changed) - sum(changed)} parameters unchanged, "
                f"finite={finite}, scale {scale} -> {opt.loss_scale}"
            )
    return problems


def _guarded(fn: Callable[[], object]) -> tuple[object, list[str]]:
    """(result, []) or (None, [the traceback]): an unattended run reports every case, whatever breaks."""
    try:
        return fn(), []
    except Exception:
        return None, ["raised:\n" + traceback.format_exc()]


HEADER = f"{'dtype':5s}  {'provider':18s}  {'check':5s}  {'step_ms':>9s}  {'opt_ms':>8s}  {'fused/this':>10s}"
LEGEND = "step_ms: forward + backward + step + zero_grad; opt_ms: step + zero_grad; fused/this: speed-up over fused"


def print_row(r: dict) -> None:
    """One table line (and the row's first problems), printed as soon as the row is measured."""
    cells = [f"{r[k]:.3f}" if k in r else "-" for k in ("step_ms", "opt_ms", "fused_vs_this")]
    print(f"{r['dtype']:5s}  {r['provider']:18s}  {r['check']:5s}  {cells[0]:>9s}  {cells[1]:>8s}  {cells[2]:>10s}")
    for p in r["problems"][:10]:
        print(f"      {p}")


def stage_check(name: str, stage: int) -> str:
    return f"{name} stage {stage}: lock-step with torch.optim.AdamW"


def fp16_check(stage: int) -> str:
    return f"fp16 stage {stage}: dynamic loss scale, forced overflow skipped, scale halved"


def check_names() -> list[str]:
    """Every check this script reports, in order."""
    return [stage_check(name, stage) for name in DTYPES for stage in STAGES] + [fp16_check(s) for s in STAGES]


def run_dtype(name: str, cfg: Config, report: Report) -> None:
    """Rows of one dtype: torch's fused AdamW, then each stage (check, then timing); the report is written
    after each."""
    dtype = DTYPES[name]
    rows = report.data.setdefault("rows", [])
    model = make_model(cfg, dtype)
    fused = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    timing, problems = _guarded(lambda: time_steps(model, fused, cfg, dtype))
    baseline = {"dtype": name, "provider": FUSED, "check": "-", **(timing or {}), "problems": problems}
    rows.append(baseline)
    print_row(baseline)
    report.save()
    for stage in STAGES:
        start = time.perf_counter()
        problems, raised = _guarded(lambda: check_stage(stage, dtype, cfg))
        problems = list(problems or []) + raised
        model = make_model(cfg, dtype)
        timing, raised = _guarded(lambda: time_steps(model, make_ours(model, stage, cfg), cfg, dtype))
        problems += raised
        status = "PASS" if not problems else "FAIL"
        row = {"dtype": name, "provider": f"stage {stage}", "check": status, **(timing or {}), "problems": problems}
        if "step_ms" in row and "step_ms" in baseline:
            row["fused_vs_this"] = baseline["step_ms"] / row["step_ms"]
        rows.append(row)
        print_row(row)
        report.record(stage_check(name, stage), status, problems, time.perf_counter() - start)


def run_stages(cfg: Config, report: Report) -> int:
    """Check and time every (dtype, stage), then the fp16 runs; 0 when every check passes, else 1."""
    if cfg.device == "cpu":
        torch.set_num_threads(1)  # a smoke run on a small, possibly busy machine: no thread oversubscription
    backend = join_alone(cfg.device)
    try:
        engine = comm.make_engine().kind
        where = torch.cuda.get_device_name() if cfg.device == "cuda" else "CPU"
        numel = sum(p.numel() for p in make_model(cfg, torch.float32).parameters())
        report.data.update(backend=backend, comm_engine=engine, params=numel)
        print(
            f"gpu_stages: {where}, {backend} world size 1, comm engine {engine}, torch {torch.__version__}, "
            f"{numel / 1e6:.2f}M params, {cfg.rows} rows, median of {cfg.repeat} steps"
        )
        print(HEADER)
        for name in DTYPES:
            run_dtype(name, cfg, report)
        print(LEGEND)
        for stage in STAGES:
            report.run(fp16_check(stage), lambda: check_fp16_overflow(stage, cfg))
    finally:
        dist.destroy_process_group()
    return report.exit_status()


def main(argv: Optional[list[str]] = None) -> int:
    return main_with_smoke_run("gpu_stages", CONFIGS, check_names, run_stages, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
