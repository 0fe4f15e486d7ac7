"""The ``plan`` command's offload options: which tier, and the figures of the machine it runs on.

Every figure is a knob; left out, it comes from this machine (and the plan says so): the host link from
the device kind (the CUDA device here; without one the device is the host and the link is a copy in
memory, measured; the ``cpu`` kind also plans the host tier as it runs there, without host copies), the
CPU Adam's rate measured with the C++ kernel on this process's threads, the host memory this machine has,
the space free under ``--nvme-path``. The disk's bandwidth has no default: measure it
where the files will go (``python -m benchmarks offload`` measures one from a checkout).
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Callable, Optional

from .offload import DEVICE_KINDS, OFFLOAD_DEVICES, OffloadSetup
from .rates import cpu_adam_gbps, memory_copy_gbps

# A CUDA device's name -> its kind (first match wins: GH200 before H200).
_NAMES = (("GH200", "gh200"), ("H200", "h200"), ("H100", "h100"), ("A100", "a100"))


def add_arguments(parser: argparse.ArgumentParser, parse_bytes: Callable[[str], int]) -> None:
    """Register the offload options on ``parser``; ``parse_bytes`` converts a size argument."""
    group = parser.add_argument_group("offload (optimizer state in host memory or on disk)")
    group.add_argument("--offload", default="none", choices=OFFLOAD_DEVICES, help="offload_optimizer.device")
    group.add_argument("--offload-param", default="none", choices=OFFLOAD_DEVICES, help="offload_param (stage 3)")
    group.add_argument(
        "--offload-ratio", type=float, help="offload_optimizer.ratio: the share offloaded (default 1; with --offload)"
    )
    group.add_argument("--nvme-path", help="folder of the offload files (with nvme)")
    group.add_argument("--disk-gbps", type=float, help="the disk's sequential bandwidth per node, GB/s (with nvme)")
    group.add_argument("--disk-space", type=parse_bytes, help="free disk per node (default: free under --nvme-path)")
    kinds = ["auto", *DEVICE_KINDS]
    group.add_argument("--device-kind", default="auto", choices=kinds, help="sets the host link's bandwidth")
    group.add_argument("--bus-gbps", type=float, help="host link per device, GB/s each way (overrides the kind)")
    group.add_argument("--cpu-adam-gbps", type=float, help="CPU Adam per node, GB of state per s (default: measured)")
    group.add_argument("--host-memory", type=parse_bytes, help="host memory per node (default: this machine's)")
    group.add_argument("--gpus-per-node", type=int, help="devices per node, dividing --gpus (default: min(--gpus, 8))")


def device_kind(name: str) -> str:
    """``name``, or for ``auto`` the kind of this machine's CUDA device (``cpu`` without one)."""
    if name != "auto":
        return name
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    found = torch.cuda.get_device_name()
    for part, kind in _NAMES:
        if part in found:
            return kind
    raise ValueError(f"--device-kind=auto: unknown device {found!r}; give --device-kind or --bus-gbps")


def device_is_host(name: str) -> bool:
    """Whether the device of kind ``name`` is the host itself: ``cpu``, or ``auto`` on a machine without CUDA."""
    if name != "auto":
        return name == "cpu"
    import torch

    return not torch.cuda.is_available()


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _disk_space(path: Optional[str]) -> Optional[int]:
    if path is None:
        return None
    if not os.path.isdir(path):
        raise ValueError(f"--nvme-path={path!r} is not a folder here: give --disk-space for the plan")
    return shutil.disk_usage(path).free


def _gpus_per_node(args: argparse.Namespace) -> int:
    """``--gpus-per-node`` (default ``min(--gpus, 8)``); the plan takes every node to hold that many ranks."""
    if args.gpus_per_node is None:
        per_node = min(args.gpus, 8)
        if args.gpus % per_node:
            raise ValueError(
                f"--gpus={args.gpus} does not fill nodes of {per_node} devices (the default, min(--gpus, 8)): "
                "give --gpus-per-node, a divisor of --gpus"
            )
        return per_node
    if args.gpus_per_node < 1 or args.gpus % args.gpus_per_node:
        raise ValueError(
            f"--gpus={args.gpus} is not a multiple of --gpus-per-node={args.gpus_per_node}: the plan takes every "
            "node to hold --gpus-per-node devices (uneven nodes are not planned)"
        )
    return args.gpus_per_node


def setup(args: argparse.Namespace) -> tuple[Optional[OffloadSetup], list[str]]:
    """(the offload the arguments ask for, or None; one line per figure saying where it comes from)."""
    if args.offload == "none" and args.offload_ratio is not None:
        raise ValueError(
            f"--offload-ratio={args.offload_ratio} is offload_optimizer.ratio, which --offload none does not "
            "write: give --offload cpu or nvme with it, or leave it out"
        )
    if args.gpus_per_node is not None or args.offload != "none" or args.offload_param != "none":
        per_node = _gpus_per_node(args)
    if args.offload == "none" and args.offload_param == "none":
        return None, []
    notes = []
    on_host = device_is_host(args.device_kind)
    if on_host and args.device_kind == "auto":
        notes.append("device: the host (no CUDA device here): the state is offloaded without host copies")
    bus = args.bus_gbps
    if bus is None:
        kind = DEVICE_KINDS[device_kind(args.device_kind)]
        bus = kind.gbytes_per_s if kind.gbytes_per_s is not None else memory_copy_gbps()
        notes.append(f"host link {bus:.3g} GB/s each way: {kind.name}, {kind.description}")
    adam = args.cpu_adam_gbps
    if adam is None:
        adam, impl = cpu_adam_gbps()
        notes.append(f"CPU Adam {adam:.3g} GB of state per s: measured here ({impl} kernel, this process's threads)")
    host = args.host_memory
    if host is None:
        host = _host_memory()
        notes.append(f"host memory {host / 1e9:.3g} GB per node: this machine's")
    space = args.disk_space
    uses_disk = "nvme" in (args.offload, args.offload_param)
    if space is None and uses_disk:
        space = _disk_space(args.nvme_path)
        notes.append(f"disk space {space / 1e9:.3g} GB: free under {args.nvme_path}" if space else "")
    made = OffloadSetup(
        optimizer=args.offload,
        param=args.offload_param,
        bus_gbps=bus,
        adam_gbps=adam,
        host_memory=host,
        ranks_per_node=per_node,
        disk_gbps=args.disk_gbps,
        disk_space=space,
        nvme_path=args.nvme_path,
        grad_accum=args.gradient_accumulation_steps or 1,
        ratio=1.0 if args.offload_ratio is None else args.offload_ratio,
        device_is_host=on_host,
    )
    return made, [n for n in notes if n]
