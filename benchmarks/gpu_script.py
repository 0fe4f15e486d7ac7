"""The frame the GPU scripts share (run by ``gpu_check.sh`` as scripts): a world-size-1 process group, the
skip of every check without a CUDA device, and the command line of a script with a CPU smoke run."""

from __future__ import annotations

import argparse
import socket
from datetime import timedelta
from typing import Callable, Optional, TypeVar

from benchmarks.gpu_report import Report

Config = TypeVar("Config")


def join_alone(device: str) -> str:
    """A world-size-1 default process group on a free loopback port (NCCL on device 0, gloo on the CPU); its
    backend."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    return backend


def skipped_without_cuda(report: Report, names: list[str], note: str = "") -> bool:
    """Without a CUDA device: every check of ``names`` written as skipped, a line saying so, and True."""
    import torch

    if torch.cuda.is_available():
        return False
    print(f"{report.data['script']}: no CUDA device here: every check is skipped{note}")
    report.skip_all(names)
    return True


def main_with_smoke_run(
    script: str,
    configs: dict[str, Config],
    names: Callable[[], list[str]],
    run: Callable[[Config, Report], int],
    argv: Optional[list[str]] = None,
    description: Optional[str] = None,
) -> int:
    """``script [--device cuda|cpu] [--json DIR]``: ``run(configs[device], report)``, or on ``cuda`` without a
    CUDA device every check of ``names()`` skipped; the exit status of the report."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", choices=sorted(configs), default="cuda", help="cpu: gloo smoke run, small model")
    parser.add_argument("--json", metavar="DIR", help=f"also write {script}.json there (after every check)")
    args = parser.parse_args(argv)
    report = Report(args.json, script)
    if args.device == "cuda" and skipped_without_cuda(report, names(), " (--device cpu is the smoke run)"):
        return report.exit_status()
    return run(configs[args.device], report)
