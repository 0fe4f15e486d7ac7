"""The rank-exchange layer: communication engines, host-data exchanges, cross-rank agreement, the
control group, process groups along the node boundary, and the device a rank works on."""

from __future__ import annotations

from .engines import (
    ALL_GATHER_PRIMITIVES,
    DEFAULT_PRIMITIVES,
    ENGINES,
    MAX_HELD,
    REDUCE_OPS,
    REDUCE_SCATTER_PRIMITIVES,
    CommEngine,
    CommError,
    CppCommEngine,
    CppHandle,
    Handle,
    TorchCommEngine,
    choose_primitive,
    make_engine,
)

__all__ = [
    "ALL_GATHER_PRIMITIVES",
    "DEFAULT_PRIMITIVES",
    "ENGINES",
    "MAX_HELD",
    "REDUCE_OPS",
    "REDUCE_SCATTER_PRIMITIVES",
    "CommEngine",
    "CommError",
    "CppCommEngine",
    "CppHandle",
    "Handle",
    "TorchCommEngine",
    "choose_primitive",
    "make_engine",
]
