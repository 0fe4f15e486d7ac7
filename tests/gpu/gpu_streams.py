"""GPU check of stream ordering and host synchronisation, on one NCCL rank.

``python tests/gpu/gpu_streams.py [--json DIR]`` needs a CUDA device and the C++ comm engine. The
engine's one-rank shortcut is taken out (``ThroughCpp``): every operation is a real NCCL collective
issued the way the engine issues it on several ranks, so its ordering shows on one GPU.

* ``engine``: for every primitive and dtype path, ``torch.cuda._sleep`` holds the compute stream,
  then the kernel that fills the buffer is queued, then the collective: it must see the filled
  values, not the stale ones (a collective ordered only after the engine's side stream reads them
  before the fill runs). A freshly allocated output that reuses the block of a tensor that queued
  compute still reads must not be written before that read.
* ``output side``: a sleep holds the engine's side stream, so the collective and the cast out of
  its buffer run late; the result is read right after ``wait()``, without a host sync: on the
  compute stream, on another stream current at ``wait()``, and on the compute stream after
  ``synchronize()`` called with another stream current. Each must see the result, not zeros.
* ``first wait elsewhere``: the torch engine's handle and a wrapped one (qwZ's dequantize), issued on the
  compute stream and first waited under another stream held by a sleep (their epilogue runs there, late):
  the compute stream, which never waits on them again, and a third stream after its own ``wait()`` must
  see the result.
* ``stage 3 prefetch``: stage 3 with prefetch, with sleeps before each gradient's copy into its
  bucket and before each step, in lock-step with ``torch.optim.AdamW``.
* ``sync``: stage-2 and stage-3 training steps (after a warm-up step) with clipping and the
  non-finite check on, under ``torch.cuda.set_sync_debug_mode("error")``: forward + backward,
  ``clip_grad_norm_`` (stage 3), then the step, twice; the call that synchronised is named (file,
  line, function).

``--json DIR`` writes ``gpu_streams.json`` after every check. Exit status: 0 all pass, 1 a check
failed, 2 no CUDA device or no comm engine (every check written as skipped).
"""

from __future__ import annotations

import argparse
import collections
import copy
import socket
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from a checkout

from benchmarks.gpu_report import Report  # noqa: E402
from benchmarks.gpu_script import skipped_without_cuda  # noqa: E402
from tests.gpu.gpu_stages import LR, WEIGHT_DECAY, compare_fp32_step, sync_reference  # noqa: E402
from zero_kernels import ShardedFusedAdam, _ext, comm  # noqa: E402
from zero_kernels.comm.handles import Handle, Works  # noqa: E402

SLEEP_CYCLES = 100_000_000  # about 50 ms of a spinning kernel: far longer than a launch takes
NUMEL = 1 << 22
ROOT = str(Path(__file__).resolve().parents[2])


class ThroughCpp(comm.CppCommEngine):
    """The C++ engine without its one-rank shortcut: each operation is issued as on several ranks."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None):
        super().__init__(process_group)
        self._engine = self._ext.Engine(self.group)
        self.issued: collections.Counter[str] = collections.Counter()  # collectives by kind

    def reduce_scatter(self, output, input, *, name="", primitive=None):
        self.issued["reduce_scatter"] += 1
        _, primitive = self._prepare("reduce_scatter", name, output, input, primitive)
        return self._issue("reduce_scatter", input, output, input, name, getattr(self._ext.Primitive, primitive))

    def all_gather(self, output, input, *, name="", primitive=None):
        self.issued["all_gather"] += 1
        _, primitive = self._prepare("all_gather", name, input, output, primitive)
        return self._issue("all_gather", output, output, input, name, getattr(self._ext.Primitive, primitive))

    def all_reduce(self, tensor, *, op="sum", name=""):
        self.issued["all_reduce"] += 1
        self._check_all_reduce(name, tensor, op)
        return self._issue("all_reduce", tensor, tensor, op, name)


def _filled_late(numel: int, dtype: torch.dtype, value: float) -> torch.Tensor:
    """A buffer of stale zeros that the compute stream fills with ``value`` after a long sleep."""
    t = torch.zeros(numel, dtype=dtype, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t.fill_(value)
    return t


def _expect(what: str, t: torch.Tensor, value: float) -> list[str]:
    torch.cuda.synchronize()
    wrong = int((t.float() != value).sum())
    return [] if wrong == 0 else [f"{what}: {wrong} of {t.numel()} elements are not {value} (stale data)"]


def check_engine_order() -> list[str]:
    """Each primitive and dtype path waits for the kernels queued before it on the compute stream."""
    engine, problems, n = ThroughCpp(), [], NUMEL
    for primitive in ("reduce_scatter_tensor", "reduce_scatter_list", "all_reduce_slice"):
        for out_dtype in (torch.float32, torch.bfloat16):
            out = torch.empty(n, dtype=out_dtype, device="cuda")
            engine.reduce_scatter(out, _filled_late(n, torch.float32, 3.0), name="rs", primitive=primitive).wait()
            problems += _expect(f"reduce_scatter {primitive} fp32 -> {out_dtype}", out, 3.0)
    for primitive in ("all_gather_tensor", "all_gather_list"):
        for in_dtype in (torch.float32, torch.bfloat16):
            out = torch.empty(n, dtype=torch.float32, device="cuda")
            engine.all_gather(out, _filled_late(n, in_dtype, 5.0), name="ag", primitive=primitive).wait()
            problems += _expect(f"all_gather {primitive} {in_dtype} -> fp32", out, 5.0)
    tensor = _filled_late(n, torch.float32, 7.0)
    engine.all_reduce(tensor, name="ar").wait()
    problems += _expect("all_reduce", tensor, 7.0)
    problems += _check_reused_block(engine)
    engine.synchronize()
    return problems


def _check_reused_block(engine: ThroughCpp) -> list[str]:
    """A gather's new output may reuse the block of a tensor that queued compute still reads."""
    x = torch.full((NUMEL,), 2.0, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    doubled = x * 2.0  # queued behind the sleep: reads x long after the host moves on
    address = x.data_ptr()
    del x
    full = torch.empty(NUMEL, device="cuda")  # the caching allocator hands x's block back
    engine.all_gather(full, torch.full((NUMEL,), 9.0, device="cuda"), name="reuse").wait()
    problems = _expect("compute read of a block reused by an all-gather", doubled, 4.0)
    if full.data_ptr() != address:
        problems.append("the all-gather output did not reuse the freed block: the hazard was not exercised")
    return problems + _expect("all-gather into a reused block", full, 9.0)


def _late_side(engine: ThroughCpp, tensor: torch.Tensor) -> None:
    """Hold the engine's side stream for ``tensor``'s device with a long sleep: what it queues next runs late."""
    _, _, side = engine._streams(tensor)
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)


def _output_cases(engine: ThroughCpp, n: int) -> dict[str, Callable[[], tuple[torch.Tensor, comm.Handle, float]]]:
    """Operations whose result lands through the side stream: (output, handle, expected value)."""

    def reduce_scatter(primitive: str) -> Callable[[], tuple[torch.Tensor, comm.Handle, float]]:
        def issue() -> tuple[torch.Tensor, comm.Handle, float]:
            x, out = torch.full((n,), 3.0, device="cuda"), torch.zeros(n, dtype=torch.bfloat16, device="cuda")
            _late_side(engine, x)
            return out, engine.reduce_scatter(out, x, name="rs", primitive=primitive), 3.0

        return issue

    def all_gather() -> tuple[torch.Tensor, comm.Handle, float]:
        x, out = torch.full((n,), 5.0, dtype=torch.bfloat16, device="cuda"), torch.zeros(n, device="cuda")
        _late_side(engine, x)
        return out, engine.all_gather(out, x, name="ag", primitive="all_gather_tensor"), 5.0

    def all_reduce() -> tuple[torch.Tensor, comm.Handle, float]:
        x = torch.full((n,), 7.0, device="cuda")
        _late_side(engine, x)
        return x, engine.all_reduce(x, name="ar"), 7.0

    return {
        "reduce_scatter_tensor fp32 -> bf16 (cast out)": reduce_scatter("reduce_scatter_tensor"),
        "all_reduce_slice fp32 -> bf16 (copy out)": reduce_scatter("all_reduce_slice"),
        "all_gather_tensor bf16 -> fp32 (cast in)": all_gather,
        "all_reduce (in place)": all_reduce,
    }


def check_output_order() -> list[str]:
    """The result read right after ``wait()`` (no host sync between) while a sleep holds the side stream, so the
    collective and its cast run late: on the compute stream (the one current at issue); on another stream
    current at ``wait()`` (an autograd callback's, a user's); and on the compute stream after the engine's
    ``synchronize()`` called with another stream current (an operation must finish on its side stream)."""
    engine, problems = ThroughCpp(), []
    for what, issue in _output_cases(engine, NUMEL).items():
        for reader in ("compute after wait()", "another stream after wait()", "compute after synchronize()"):
            torch.cuda.synchronize()
            out, handle, value = issue()
            if reader == "compute after wait()":
                handle.wait()
                seen = out.clone()
            else:
                other = torch.cuda.Stream()
                with torch.cuda.stream(other):
                    if reader == "another stream after wait()":
                        handle.wait()
                        seen = out.clone()
                    else:
                        engine.synchronize()
                if reader == "compute after synchronize()":
                    seen = out.clone()
            problems += _expect(f"{what}, read on {reader}", seen, value)
    engine.synchronize()
    return problems


def _first_wait_cases(n: int) -> dict[str, Callable[[], tuple[torch.Tensor, comm.Handle, float]]]:
    """Handles whose epilogue runs on the stream current at ``wait()``, issued on the compute stream: (output,
    handle, expected value)."""

    def torch_engine() -> tuple[torch.Tensor, comm.Handle, float]:
        x, out = torch.full((n,), 3.0, device="cuda"), torch.zeros(n, dtype=torch.bfloat16, device="cuda")
        work = dist.all_reduce(x, async_op=True)  # the torch engine's all_reduce_slice on one rank
        return out, Handle(work, (x, out), lambda: out.copy_(x), "rs"), 3.0

    def wrapped() -> tuple[torch.Tensor, comm.Handle, float]:
        payload, full = torch.zeros(n, dtype=torch.bfloat16, device="cuda"), torch.zeros(n, device="cuda")
        inner = ThroughCpp().all_gather(payload, torch.full((n,), 5.0, dtype=torch.bfloat16, device="cuda"))
        return full, Handle(Works([inner]), (payload, full), lambda: full.copy_(payload), "qwZ"), 5.0

    return {"the torch engine's handle (cast out)": torch_engine, "a wrapped handle (qwZ's dequantize)": wrapped}


def check_first_wait_elsewhere() -> list[str]:
    """The first ``wait()`` under another stream, held there by a sleep so that the epilogue runs late (the first read
    of a parameter under a user's stream with ``overlap_param_gather``): the compute stream, which issued the
    operation and never waits on the handle again, must see the result; so must a third stream's later ``wait()``."""
    problems = []
    for what, issue in _first_wait_cases(NUMEL).items():
        torch.cuda.synchronize()
        out, handle, value = issue()
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda._sleep(SLEEP_CYCLES)
            handle.wait()
        seen = out.clone()
        with torch.cuda.stream(torch.cuda.Stream()):
            handle.wait()
            third = out.clone()
        problems += _expect(f"{what}, read on the compute stream", seen, value)
        problems += _expect(f"{what}, read on a third stream after its wait()", third, value)
    return problems


def _model(width: int = 1024, depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers).cuda()


def _ours(model: nn.Module, stage: int, **options) -> ShardedFusedAdam:
    """The optimizer built on a ``ThroughCpp`` engine: every part that keeps the engine (stage 3's unit gathers
    too) has that one."""
    with mock.patch("zero_kernels.optim.optimizer.make_engine", lambda group=None: ThroughCpp(group)):
        opt = ShardedFusedAdam(model, lr=LR, weight_decay=WEIGHT_DECAY, stage=stage, **options)
    engine = opt._pipeline.engine
    assert isinstance(engine, ThroughCpp) and opt._engine is engine, type(engine).__name__
    gathers = getattr(opt._pipeline, "unit_gathers", None)
    assert gathers is None or gathers.engine is engine, "stage 3's gathers kept another engine"
    return opt


def _through(opt: ShardedFusedAdam, *kinds: str) -> list[str]:
    """A problem for each kind of collective that never went through the optimizer's ``ThroughCpp``."""
    issued = opt._pipeline.engine.issued
    return [f"no {kind} went through the engine under test ({dict(issued)})" for kind in kinds if not issued[kind]]


def _sleep_before_bucket_copies(model: nn.Module) -> None:
    """Hold the compute stream before each gradient is copied into its bucket (hooks run in order)."""
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: torch.cuda._sleep(SLEEP_CYCLES // 10))


def check_stage3_prefetch() -> list[str]:
    """Stage 3 with prefetch and sleeps in the way, against torch.optim.AdamW, 4 steps (fp32), each step
    judged on its own as in gpu_stages.py (torch's next step starts from ours)."""
    model = _model()
    ref = copy.deepcopy(model)
    _sleep_before_bucket_copies(model)
    unit = 1024 * 1024 + 1024
    opt = _ours(model, 3, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=2 * unit,
                reduce_bucket_size=unit // 3)  # fmt: skip
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    problems: list[str] = []
    for step in range(4):
        x = torch.randn(64, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        before = [r.detach().double() for r in ref.parameters()]
        model(x).square().mean().backward()
        torch.cuda._sleep(SLEEP_CYCLES)  # the step's kernels run late: the next gathers must wait for them
        opt.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        ropt.step()
        ropt.zero_grad()
        full = opt.full_state_dict()
        with opt.gathered_params():
            problems += compare_fp32_step(model, ref, ropt, before, full, f"step {step + 1}")
            sync_reference(model, ref, ropt, full)
        if problems:
            break
    opt._pipeline.engine.synchronize()
    return problems + _through(opt, "all_gather", "reduce_scatter")


def _where(exc: BaseException) -> str:
    """The innermost frame of this checkout in ``exc``'s traceback: file:line in function: code."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(ROOT)]
    if not frames:
        return "outside this checkout"
    f = frames[-1]
    return f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def _sync_free(what: str, fn: Callable[[], None]) -> list[str]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        if "synchroniz" not in str(exc):
            raise
        return [f"{what} synchronised the host at {_where(exc)}"]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return []


def check_sync_free() -> list[str]:
    """Stage-2 and stage-3 steps, after a warm-up step, under set_sync_debug_mode("error"), with clipping and
    the non-finite check on (the step's norm, clip coefficient and skip flag stay on the device), stage 3 also
    through ``clip_grad_norm_``; two rounds, so that a step settles the one before it."""
    problems = []
    for stage in (2, 3):
        model = _model(width=512, depth=3)
        opt = _ours(model, stage, stage3_param_persistence_threshold=0, reduce_bucket_size=200_000, max_grad_norm=1.0)
        x = torch.randn(32, 512, device="cuda")
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        for _ in range(2):
            problems += _sync_free(f"stage {stage} forward + backward", lambda: model(x).square().mean().backward())
            if stage == 3:
                problems += _sync_free("stage 3 clip_grad_norm_", lambda: opt.clip_grad_norm_(0.5))
            problems += _sync_free(f"stage {stage} step", opt.step)
            opt.zero_grad()
        opt._pipeline.engine.synchronize()
        kinds = ("reduce_scatter", "all_gather") if stage == 3 else ("reduce_scatter",)  # stage 2, one rank: no gather
        problems += [f"stage {stage}: {p}" for p in _through(opt, *kinds)]
    return problems


CHECKS = {
    "engine: every primitive and dtype path waits for compute": check_engine_order,
    "engine: the result is ordered for its reader (side stream held by a sleep)": check_output_order,
    "a first wait() under another stream orders the issuing stream": check_first_wait_elsewhere,
    "stage 3 with prefetch, sleeps in the way, vs torch.optim.AdamW": check_stage3_prefetch,
    "no host sync in a stage-2 and a stage-3 step": check_sync_free,
}


def _init_group() -> None:
    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
        device_id=torch.device("cuda", 0),
    )


def run_checks(report: Report) -> int:
    _init_group()
    try:
        report.run_all(CHECKS)
    finally:
        dist.destroy_process_group()
    return report.exit_status()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="DIR", help="also write gpu_streams.json there (after every check)")
    args = parser.parse_args(argv)
    report = Report(args.json, "gpu_streams")
    if skipped_without_cuda(report, list(CHECKS)):
        return report.exit_status()
    try:
        _ext.load("comm")
    except _ext.ExtensionUnavailable as exc:
        print(f"gpu_streams: the C++ comm engine is unavailable: {exc}")
        report.skip_all(list(CHECKS), f"skipped: the C++ comm engine is unavailable ({str(exc)[:200]})")
        return report.exit_status()
    return run_checks(report)


if __name__ == "__main__":
    sys.exit(main())
