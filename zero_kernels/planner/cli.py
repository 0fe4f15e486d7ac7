"""The ``plan`` subcommand: a table of every stage's memory and communication, and a recommendation.

Example::

    python -m zero_kernels plan --params 7.5e9 --gpus 64 --gpu-memory 80GB --link ib-400 --json ds.json
    python -m zero_kernels plan --params 70B --gpus 8 --gpu-memory 80GB --link nvlink --offload cpu --json ds.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import Callable

from . import offload_cli
from .choose import NoFitError, StagePlan, format_bytes, recommend
from .models import DTYPE_BYTES, LINKS

HELP = "which ZeRO stage fits, and what it costs per GPU and per step"

_NUMBER = r"\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*"
_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_BYTE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_BARE_BYTES_MIN = 2**20  # a size without a unit below 1 MiB is taken for a forgotten unit (80 for 80GB)


def _split(name: str, text: str, units: dict[str, int]) -> float:
    """``text`` as a number times its unit's scale; a ValueError names ``name`` and the allowed units."""
    match = re.fullmatch(_NUMBER + r"([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in units:
        allowed = ", ".join(u for u in units if u)
        raise ValueError(f"{name}={text!r}: expected a number with an optional unit ({allowed})")
    value = float(match.group(1)) * units[unit]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={text!r}: must be > 0")
    return value


def parse_count(name: str, text: str) -> int:
    """A positive whole count such as ``7.5e9``, ``7.5B``, ``175M`` or ``4096``.

    Args:
        name: the argument name, for the error message.
        text: the count; suffixes K, M, B (or G) and T scale by 10^3, 10^6, 10^9 and 10^12.
    """
    value = _split(name, text, _COUNT_SUFFIX)
    if abs(value - round(value)) > 1e-6 * value:
        raise ValueError(f"{name}={text!r}: must be a whole number")
    return int(round(value))


def parse_bytes(name: str, text: str) -> int:
    """A positive size in bytes such as ``80GB`` (10^9), ``80GiB`` (2^30) or ``8e10``.

    Args:
        name: the argument name, for the error message.
        text: the size; units B, KB, MB, GB, TB (decimal) or KiB, MiB, GiB, TiB (binary); none means bytes,
            and then at least 1 MiB (``80`` is refused as a forgotten unit, not read as 80 bytes).
    """
    value = int(round(_split(name, text, _BYTE_UNITS)))
    if value < _BARE_BYTES_MIN and re.fullmatch(_NUMBER, text):
        raise ValueError(f"{name}={text!r}: {value} bytes; write the unit (e.g. {text.strip()}GB or {text.strip()}GiB)")
    return value


def parse_positive(name: str, text: str) -> float:
    """A finite number > 0 such as ``400`` or ``0.5``.

    Args:
        name: the argument name, for the error message.
        text: the number, without a unit.
    """
    return _split(name, text, {"": 1})


def _arg(parse: Callable[[str, str], int], name: str) -> Callable[[str], int]:
    """An argparse ``type=`` that reports ``parse``'s message instead of argparse's generic one."""

    def convert(text: str) -> int:
        try:
            return parse(name, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return convert


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``plan`` options on ``parser``."""
    parser.add_argument("--params", required=True, type=_arg(parse_count, "--params"), help="parameters: 7.5e9, 7.5B")
    parser.add_argument("--gpus", required=True, type=_arg(parse_count, "--gpus"), help="data-parallel GPUs")
    parser.add_argument(
        "--gpu-memory",
        required=True,
        type=_arg(parse_bytes, "--gpu-memory"),
        help="80GB, 80GiB (a number without a unit is bytes, at least 1 MiB)",
    )
    parser.add_argument("--link", required=True, choices=list(LINKS), help="interconnect of the data-parallel ring")
    parser.add_argument("--link-gbps", type=float, help="override the preset bandwidth, GB/s per direction")
    parser.add_argument("--latency-us", type=float, help="override the preset latency per ring step, microseconds")
    parser.add_argument("--param-dtype", default="bf16", choices=list(DTYPE_BYTES), help="parameter dtype")
    parser.add_argument(
        "--communication-data-type", choices=list(DTYPE_BYTES), help="gradients reduced in (default: --param-dtype)"
    )
    parser.add_argument(
        "--grad-accum-dtype", choices=list(DTYPE_BYTES), help="data_types.grad_accum_dtype (default: --param-dtype)"
    )
    parser.add_argument(
        "--gradient-accumulation-steps",
        "--grad-accum",
        type=_arg(parse_count, "--gradient-accumulation-steps"),
        help="micro-steps per optimizer step (default 1); compute and times stay per optimizer step",
    )
    parser.add_argument(
        "--train-micro-batch-size-per-gpu",
        "--micro-batch",
        type=_arg(parse_count, "--train-micro-batch-size-per-gpu"),
        default=1,
        help="samples per micro-step per GPU, written to the config (default 1); the plan's sizes come from "
        "--activation-memory and --tokens-per-step",
    )
    parser.add_argument(
        "--activation-memory", type=_arg(parse_bytes, "--activation-memory"), help="activations per GPU"
    )
    parser.add_argument("--largest-layer", type=_arg(parse_count, "--largest-layer"), help="stage-3 gathered unit")
    parser.add_argument("--tokens-per-step", type=_arg(parse_count, "--tokens-per-step"), help="tokens per step")
    parser.add_argument(
        "--tflops", type=_arg(parse_positive, "--tflops"), help="achieved TFLOP/s per GPU (with --tokens-per-step)"
    )
    parser.add_argument("--compute-s", type=_arg(parse_positive, "--compute-s"), help="compute s per step per GPU")
    parser.add_argument("--bucket", type=_arg(parse_count, "--bucket"), help="collective bucket size, elements")
    parser.add_argument("--json", metavar="PATH", help="write the recommended DeepSpeed config to PATH")
    offload_cli.add_arguments(parser, _arg(parse_bytes, "size"))


def format_table(plans: tuple[StagePlan, ...], gpu_memory: float) -> str:
    """One row per stage: memory per GPU, whether it fits, communication per step and the step estimate; with
    offload also host memory and disk per rank, and the bytes crossing the host link and the disk per step."""
    offload = any(p.offload is not None for p in plans)
    micro_steps = plans[0].comm.micro_steps
    head = ("stage", "params", "grads", "optimizer", "working set", "activations", "total/GPU")
    head += ("host/rank", "disk/rank", "bus/step", "disk I/O/step") if offload else ()
    head += ("fits?", "sent/GPU/step", "comm time") + (("comm/micro-step",) if micro_steps > 1 else ()) + ("step time",)
    rows = [head]
    for p in plans:
        m = p.memory
        row = (str(p.stage), format_bytes(m.params), format_bytes(m.grads), format_bytes(m.optimizer))
        row += (format_bytes(m.working_set), format_bytes(p.activation_bytes), format_bytes(p.gpu_bytes))
        if p.offload is not None:
            o = p.offload
            row += (format_bytes(o.host_bytes), format_bytes(o.disk_bytes), format_bytes(o.bus_down + o.bus_up))
            row += (format_bytes(o.disk_read + o.disk_write),)
        row += ("yes" if p.fits else "no", format_bytes(p.comm.bytes_sent), f"{p.comm.time_s * 1e3:.1f} ms")
        row += (f"{p.comm.micro_time_s * 1e3:.1f} ms",) if micro_steps > 1 else ()
        rows.append(row + (f"{p.step_s * 1e3:.1f} ms",))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    per = "per optimizer step"
    if micro_steps > 1:
        per += f" of {micro_steps} micro-steps; comm/micro-step: what every micro-step runs, within comm time"
    return f"GPU memory: {format_bytes(gpu_memory)}\n" + "\n".join(lines) + f"\nsent, comm and step time: {per}"


def run(args: argparse.Namespace) -> int:
    """Print the table and the recommendation; write the DeepSpeed config when ``--json`` is given."""
    if args.compute_s is None and (args.tokens_per_step is None) != (args.tflops is None):
        given = "--tokens-per-step" if args.tflops is None else "--tflops"
        raise ValueError(f"{given} without the other: give --tokens-per-step with --tflops, or --compute-s")
    offload, sources = offload_cli.setup(args)
    for line in sources:
        print(f"offload figure: {line}")
    try:
        rec = recommend(
            args.params,
            gpus=args.gpus,
            gpu_memory=args.gpu_memory,
            link=args.link,
            link_gbps=args.link_gbps,
            latency_us=args.latency_us,
            param_dtype=args.param_dtype,
            activation_bytes=args.activation_memory or 0,
            largest_layer_params=args.largest_layer,
            tokens_per_step=args.tokens_per_step,
            achieved_tflops=args.tflops,
            compute_s=args.compute_s,
            bucket_elements=args.bucket,
            offload=offload,
            communication_data_type=args.communication_data_type,
            grad_accum_dtype=args.grad_accum_dtype,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            train_micro_batch_size_per_gpu=args.train_micro_batch_size_per_gpu,
        )
    except NoFitError as exc:
        print(format_table(exc.plans, args.gpu_memory))
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(format_table(rec.plans, args.gpu_memory))
    print(f"\nrecommended: ZeRO stage {rec.stage}")
    print("\n".join(f"  - {line}" for line in rec.reasons))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rec.deepspeed, f, indent=2)
            f.write("\n")
        print(f"DeepSpeed config written to {args.json}")
    return 0
