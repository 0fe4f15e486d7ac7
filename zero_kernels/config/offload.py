"""The offload blocks of a DeepSpeed config: ``offload_optimizer``, ``offload_param`` and ``aio``.

Each block is a small frozen dataclass, checked again when built directly (``ZeroOptions`` takes a
device name, a mapping or the dataclass). Defaults are DeepSpeed 0.19's
(``deepspeed/runtime/zero/offload_config.py``, ``deepspeed/runtime/swap_tensor/aio_config.py``).

- ``OffloadOptimizerConfig``: where this rank's optimizer state lives: ``"none"`` (the parameters'
  device), ``"cpu"`` (host memory, ``pin_memory``: page-locked when CUDA is there) or ``"nvme"``
  (files under ``nvme_path``, swapped through ``buffer_count`` host buffers; ``pipeline_read``
  reads the next sub-group ahead, ``pipeline_write`` writes the last one behind).
  ``cpuadam_cores_perc``: the share of this process's cores the host Adam uses (at least one thread; the
  environment variable ``ZERO_KERNELS_CPU_ADAM_THREADS`` overrides it). ``ratio`` in [0, 1]: the share of the state
  that is offloaded, whole buckets (the rest stays on the device: ``stages.placement``; 0: none, as without the
  block). ``super_offload``: at stage 3 with ``device`` cpu, the host Adam of each bucket runs during backward,
  speculatively (``stages.speculation``); elsewhere ignored, with a warning. ``pin_memory`` defaults to true, as in
  DeepSpeed 0.19.8.
- ``OffloadParamConfig``: stage 3's parameter shards in host memory or files. Parsed and checked (stage 3 only:
  ``ZeroOptions`` drops it with a warning elsewhere; ``nvme_path`` with ``"nvme"``); with all the optimizer state
  offloaded the shards are the state tier's host copies (``"cpu"``), otherwise host memory of their own
  (``stages.stage3.host_params``); ``"nvme"`` puts the shards past ``max_in_cpu`` in files
  (``stages.stage3.disk_params``).
- ``AioConfig``: the file I/O engine's knobs (the thread count is ``intra_op_parallelism``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

from .rules import Invalid, Scalar, boolean, choice, integer, number

OFFLOAD_DEVICES = {"none": "none", "cpu": "cpu", "nvme": "nvme"}
DEVICE: Scalar = choice(OFFLOAD_DEVICES)
RATIO: Scalar = number(0, 1, text=True)
PAGE = 4096


def _path(value: Any) -> Optional[str]:
    """A non-empty directory path (a string or a ``pathlib.Path``, kept as a string) or null."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if value is None or (isinstance(value, str) and value.strip()):
        return value
    raise Invalid


PATH: Scalar = Scalar("a directory path (a non-empty string or a pathlib.Path) or null", _path)


def _check(obj: Any, rules: Mapping[str, Scalar], prefix: str) -> None:
    for name, rule in rules.items():
        object.__setattr__(obj, name, rule(getattr(obj, name), f"{prefix}.{name}"))


def _need_nvme_keys(block: Any, prefix: str, sizes: tuple[str, ...]) -> None:
    """``"nvme"`` needs a path and buffers of some size (DeepSpeed's schema takes 0 for any device: the cpu
    device reads none of these keys)."""
    if block.device != "nvme":
        return
    if block.nvme_path is None:
        raise ValueError(f'{prefix}.device="nvme" needs {prefix}.nvme_path (a directory for the swap files)')
    for name in sizes:
        if getattr(block, name) < 1:
            raise ValueError(f'{prefix}.{name}=0: device "nvme" swaps through buffers: expected an integer >= 1')


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer`` (see the module docstring)."""

    device: str = "none"
    nvme_path: Optional[str] = None
    pin_memory: bool = True  # DeepSpeed 0.19.8's default
    buffer_count: int = 4
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = 1.0
    cpuadam_cores_perc: float = 0.8
    super_offload: bool = False

    def __post_init__(self) -> None:
        prefix = "offload_optimizer"
        _check(self, OPTIMIZER_RULES, prefix)
        _need_nvme_keys(self, prefix, ("buffer_count",))

    @property
    def enabled(self) -> bool:
        """A device, and a share of the state to put there (``ratio`` 0, which DeepSpeed takes, offloads none)."""
        return self.device != "none" and self.ratio > 0


@dataclass(frozen=True)
class OffloadParamConfig:
    """``zero_optimization.offload_param`` (stage 3 only)."""

    device: str = "none"
    nvme_path: Optional[str] = None
    pin_memory: bool = True  # DeepSpeed 0.19.8's default
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000

    def __post_init__(self) -> None:
        _check(self, PARAM_RULES, "offload_param")

    def check_nvme(self) -> None:
        """``"nvme"``'s path and buffer sizes, checked at stage 3 only: DeepSpeed ignores the block below it, whatever
        it holds (``zero_config``'s stage check drops it there)."""
        _need_nvme_keys(self, "offload_param", ("buffer_count", "buffer_size"))

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True)
class AioConfig:
    """The top-level ``aio`` block: the asynchronous file I/O of the disk tier."""

    block_size: int = 1 << 20
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True

    def __post_init__(self) -> None:
        _check(self, AIO_RULES, "aio")


# The numbers take strings holding one ("5", "0.5") as DeepSpeed's offload config models read them.
OPTIMIZER_RULES: dict[str, Scalar] = {
    "device": DEVICE,
    "nvme_path": PATH,
    "pin_memory": boolean(),
    "buffer_count": integer(0, text=True),
    "pipeline_read": boolean(),
    "pipeline_write": boolean(),
    "fast_init": boolean(),
    "ratio": RATIO,
    "cpuadam_cores_perc": number(0, 1, text=True),  # 0 (DeepSpeed takes it): one thread
    "super_offload": boolean(),
}
PARAM_RULES: dict[str, Scalar] = {
    "device": DEVICE,
    "nvme_path": PATH,
    "pin_memory": boolean(),
    "buffer_count": integer(0, text=True),
    "buffer_size": integer(0, text=True),
    "max_in_cpu": integer(0, text=True),
}
AIO_RULES: dict[str, Scalar] = {
    "block_size": integer(PAGE, multiple_of=PAGE),  # whole pages (the engine's pieces: ``offload.aio``)
    "queue_depth": integer(1),
    "intra_op_parallelism": integer(1),
    "single_submit": boolean(),
    "overlap_events": boolean(),
}

Block = Union[OffloadOptimizerConfig, OffloadParamConfig, AioConfig]


def as_block(kind: type, value: Any, name: str) -> Block:
    """``value`` as a ``kind`` block: the block itself, a mapping of its keys, a device name, or None (defaults)."""
    if isinstance(value, kind):
        return value
    if value is None:
        return kind()
    if isinstance(value, str) and kind is not AioConfig:
        return kind(device=value)
    if isinstance(value, Mapping):
        known = {f.name for f in fields(kind)}
        unknown = [k for k in value if k not in known]
        if unknown:
            raise ValueError(f"ZeroOptions.{name}: unknown key {unknown[0]!r}; expected one of {', '.join(known)}")
        return kind(**value)
    raise ValueError(f"ZeroOptions.{name}={value!r} is invalid: expected a {kind.__name__}, a mapping or a device name")
