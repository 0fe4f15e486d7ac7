"""Every ``ZERO_KERNELS_*`` environment variable, read in one place.

This module imports nothing heavy so that ``setup.py`` can load it by path. The README's table of
environment variables mirrors ``VARIABLES`` below.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

IMPLS = ("auto", "triton", "cpu", "torch")
COMM_BACKENDS = ("auto", "cpp", "torch")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

VARIABLES = {
    "ZERO_KERNELS_IMPL": "default kernel backend: auto | triton | cpu | torch (default auto)",
    "ZERO_KERNELS_COMM": "communication engine: auto | cpp | torch (default auto)",
    "ZERO_KERNELS_BUILD_OPS": "1 = compile the C++ extension at install time instead of on first use",
    "ZERO_KERNELS_NO_JIT": "1 = never compile the extension at run time; use the pure-PyTorch path",
    "ZERO_KERNELS_VERBOSE_BUILD": "1 = show compiler output of the just-in-time build",
    "ZERO_KERNELS_LOG_LEVEL": "level of the zero_kernels logger: DEBUG | INFO | WARNING | ERROR (default WARNING)",
    "ZERO_KERNELS_SHM": "0 = ranks on one host, and the ranks of each node across nodes, exchange through gloo's "
    "sockets instead of shared memory (default 1)",
    "ZERO_KERNELS_CPU_ADAM_THREADS": "threads of the host Adam with offload_optimizer (default: "
    "offload_optimizer.cpuadam_cores_perc of the process's cores)",
}


def _flag(name: str) -> bool:
    value = os.environ.get(name, "0").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable {name}={value!r}: expected 0 or 1")


def _choice(name: str, allowed: tuple[str, ...], default: str, *, upper: bool = False) -> str:
    value = os.environ.get(name, default).strip()
    value = value.upper() if upper else value.lower()
    if value not in allowed:
        raise ValueError(f"environment variable {name}={value!r}: allowed values are {', '.join(allowed)}")
    return value


def shared_memory() -> bool:
    """``ZERO_KERNELS_SHM``: whether ranks on one host exchange through shared memory (default yes)."""
    return _flag("ZERO_KERNELS_SHM") if os.environ.get("ZERO_KERNELS_SHM", "").strip() else True


def cpu_adam_threads() -> Optional[int]:
    """``ZERO_KERNELS_CPU_ADAM_THREADS`` (an integer >= 1), or None when unset."""
    name = "ZERO_KERNELS_CPU_ADAM_THREADS"
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"environment variable {name}={value!r}: expected an integer >= 1")
    return int(value)


@dataclass(frozen=True)
class Settings:
    impl: str
    comm: str
    build_ops: bool
    no_jit: bool
    verbose_build: bool
    log_level: str


def settings() -> Settings:
    """Read the environment now (cheap; callers that need a stable view keep the result)."""
    return Settings(
        impl=_choice("ZERO_KERNELS_IMPL", IMPLS, "auto"),
        comm=_choice("ZERO_KERNELS_COMM", COMM_BACKENDS, "auto"),
        build_ops=_flag("ZERO_KERNELS_BUILD_OPS"),
        no_jit=_flag("ZERO_KERNELS_NO_JIT"),
        verbose_build=_flag("ZERO_KERNELS_VERBOSE_BUILD"),
        log_level=_choice("ZERO_KERNELS_LOG_LEVEL", LOG_LEVELS, "WARNING", upper=True),
    )
