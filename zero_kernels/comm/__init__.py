"""The rank-exchange layer: communication engines, host-data exchanges, cross-rank agreement, the
control group, process groups along the node boundary, and the device a rank works on.

Engines: ``engines`` (``make_engine``), ``torch_engine`` and ``cpp_engine`` over ``engine_base``;
their operations' ``handles``; the choice of c10d ``primitives``. Host data: ``objects`` (picklable
values between ranks), ``agreement`` (ranks hold the same thing), ``control`` (the gloo group for host
data), ``groups`` (per node / across nodes), ``devices`` (the device a rank works on). ``quantized``: qgZ, the
reduce-scatter of int4 blocks in two hops along the node boundary.
"""

from __future__ import annotations

from .cpp_engine import CppCommEngine
from .engines import ENGINES, CommEngine, make_engine
from .handles import CppHandle, Handle
from .primitives import (
    ALL_GATHER_PRIMITIVES,
    DEFAULT_PRIMITIVES,
    MAX_HELD,
    PRIMITIVES,
    REDUCE_OPS,
    REDUCE_SCATTER_PRIMITIVES,
    CommError,
    choose_primitive,
)
from .quantized import ErrorFeedback, QuantizedReduceScatter
from .torch_engine import TorchCommEngine

__all__ = [
    "ALL_GATHER_PRIMITIVES",
    "DEFAULT_PRIMITIVES",
    "ENGINES",
    "MAX_HELD",
    "PRIMITIVES",
    "QuantizedReduceScatter",
    "REDUCE_OPS",
    "REDUCE_SCATTER_PRIMITIVES",
    "CommEngine",
    "CommError",
    "CppCommEngine",
    "CppHandle",
    "ErrorFeedback",
    "Handle",
    "TorchCommEngine",
    "choose_primitive",
    "make_engine",
]
