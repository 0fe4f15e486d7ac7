"""Stream ordering of the C++ engine's CUDA path, checked on the CPU with fake streams.

On NCCL a collective's ``wait()`` makes the *current* stream wait for it, and the engine's epilogue
(a cast out of the communication buffer) is queued on its side stream. So:

- an operation is finished with its side stream current, whoever finishes it (``PendingOp::wait``,
  ``Engine::synchronize``, the engine's destructor): the C++ test ``csrc/tests/test_comm.cpp``
  (run by ``tests/extension/test_cmake.py``) checks it with a fake device, and here the Python engine must
  hand the side stream to C++ with every operation;
- ``CppHandle.wait()`` makes the caller's current stream wait for the side stream, whichever stream
  that is (an autograd callback's, a user's), not only the stream current when it was issued.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch

from zero_kernels import comm


class FakeStream:
    """A stream that records which streams it was made to wait for."""

    def __init__(self, name: str, device: int = 1):
        self.name, self.device = name, torch.device("cuda", device)
        self.cuda_stream = hash(name) & 0xFFFF
        self.waited_for: list[str] = []

    def wait_stream(self, other: "FakeStream") -> None:
        self.waited_for.append(other.name)


def _index(device: Any) -> int:
    """The CUDA device index of ``device`` (an index, a ``torch.device`` or None: the current one, 1)."""
    if device is None:
        return 1
    return device if isinstance(device, int) else torch.device(device).index


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> dict[str, FakeStream]:
    """torch.cuda with a current stream per device that ``torch.cuda.stream(s)`` changes."""
    current = {1: FakeStream("compute")}
    made: dict[str, FakeStream] = {"compute": current[1]}

    def current_stream(device: Any = None) -> FakeStream:
        return current[_index(device)]

    @contextlib.contextmanager
    def stream(s: FakeStream) -> Iterator[None]:
        previous, current[s.device.index] = current[s.device.index], s
        try:
            yield
        finally:
            current[s.device.index] = previous

    def new_stream(device: Any = None) -> FakeStream:
        made["side"] = FakeStream("side", _index(device))
        return made["side"]

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    made["set_current"] = lambda s: current.__setitem__(1, s)
    return made


class RecordingOp:
    what = "all_reduce of bucket 'b'"

    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1


def test_wait_orders_the_callers_current_stream(streams: dict[str, Any]) -> None:
    """Issued with one stream current, waited on with another: the waiting stream follows the side stream."""
    side = FakeStream("side")
    handle = comm.CppHandle(RecordingOp(), side)
    callback = FakeStream("autograd callback")
    streams["set_current"](callback)
    handle.wait()
    assert callback.waited_for == ["side"], "the caller's stream does not wait for the operation"
    user = FakeStream("user")
    streams["set_current"](user)
    handle.wait()  # idempotent in C++; every caller's stream is still ordered
    assert user.waited_for == ["side"] and handle._op.waits == 2


def test_cpu_handles_touch_no_stream(streams: dict[str, Any]) -> None:
    handle = comm.CppHandle(RecordingOp(), None)
    handle.wait()
    assert streams["compute"].waited_for == []


class OnGpu1(torch.Tensor):
    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 1)

    @property
    def is_cuda(self) -> bool:
        return True


def test_every_operation_hands_its_side_stream_to_the_engine(streams: dict[str, Any]) -> None:
    """The C++ engine finishes an operation on the stream it is given (``side``): each call must give it, and
    issue with the side stream current while the caller's stream is the compute stream."""
    calls = []

    def record(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> RecordingOp:
            calls.append((name, kwargs, torch.cuda.current_stream(1).name))
            return RecordingOp()

        return call

    engine = comm.CppCommEngine.__new__(comm.CppCommEngine)
    engine.rank, engine.world_size, engine.backend, engine._group = 0, 2, "nccl", None
    engine.where = "rank 0 of 2"
    engine._side_streams = {}
    engine._engine = SimpleNamespace(**{n: record(n) for n in ("all_reduce", "all_gather", "reduce_scatter")})
    engine._ext = SimpleNamespace(Primitive=SimpleNamespace(all_gather_tensor=1, reduce_scatter_tensor=2))
    full, shard = torch.zeros(8).as_subclass(OnGpu1), torch.zeros(4).as_subclass(OnGpu1)
    handles = [
        engine.all_reduce(full, name="a"),
        engine.all_gather(full, shard, name="g"),
        engine.reduce_scatter(shard, full, name="r"),
    ]
    side = streams["side"]
    assert [c[0] for c in calls] == ["all_reduce", "all_gather", "reduce_scatter"]
    for name, kwargs, current in calls:
        assert kwargs.get("side") is side, f"{name}: the side stream was not handed to the engine"
        assert kwargs["side_stream"] == side.cuda_stream and kwargs["compute_stream"] == streams["compute"].cuda_stream
        assert current == "side", f"{name} was issued with {current} current"
    for handle in handles:
        handle.wait()
    assert streams["compute"].waited_for == ["side"] * 3


def test_torch_engine_copy_out_tells_the_allocator_of_the_waiting_stream(
    streams: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torch engine's reduce-scatter into another dtype sums into a temporary allocated with the issuing
    stream current and copies it out at ``wait()`` on the stream current then: that stream's use is recorded
    (``record_stream``) before the handle drops the temporary."""
    from zero_kernels.comm import torch_engine

    used: list[str] = []

    class Temporary(OnGpu1):
        def record_stream(self, stream: FakeStream) -> None:
            used.append(stream.name)

    real_empty = torch.empty

    def empty(*size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        t = real_empty(*size, **kwargs)
        return t.as_subclass(Temporary) if device is not None and torch.device(device).type == "cuda" else t

    class Work:
        def wait(self) -> None: ...

        def is_completed(self) -> bool:
            return False

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch_engine, "reduce_scatter_flat", lambda *args, **kwargs: Work())
    engine = comm.TorchCommEngine.__new__(comm.TorchCommEngine)
    engine.rank, engine.world_size, engine.backend, engine._group = 0, 2, "nccl", None
    engine.where = "rank 0 of 2"
    engine._pending, engine._tags = [], 0
    full = torch.arange(8.0).as_subclass(OnGpu1)
    shard = real_empty(4, dtype=torch.bfloat16).as_subclass(OnGpu1)
    handle = engine.reduce_scatter(shard, full, name="r", primitive="reduce_scatter_tensor")
    streams["set_current"](FakeStream("autograd callback"))
    handle.wait()
    assert used == ["autograd callback"], "the waiting stream's read of the temporary is not recorded"


class _MetaOnCuda(torch.Tensor):
    """A tensor that only says it is on cuda:0 (no storage): it reaches the C++ engine's stream checks, which
    come before anything reads data."""

    @staticmethod
    def __new__(cls, numel: int) -> "_MetaOnCuda":
        return torch.Tensor._make_wrapper_subclass(cls, (numel,), dtype=torch.float32, device=torch.device("cuda", 0))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise AssertionError(f"the engine touched the data ({func}) before its stream checks")


@pytest.mark.ext
def test_cpp_engine_takes_the_default_stream_as_compute_stream() -> None:
    """torch reports the default CUDA stream as handle 0 (``torch.cuda.current_stream().cuda_stream == 0``), the
    stream an ordinary training loop runs on: the C++ engine must order its side stream after it, not refuse it
    (it raised "CUDA tensors need the compute and side streams" for every collective, from the device check of the
    optimizer's constructor on). Without CUDA in this build the operation stops at the next check."""
    from zero_kernels import _ext

    try:
        ext = _ext.load("comm")
    except _ext.ExtensionUnavailable as exc:
        pytest.skip(f"C++ comm engine not buildable here: {exc}")
    c10d = torch._C._distributed_c10d
    store = c10d.HashStore()
    group = c10d.ProcessGroup(store, 0, 2)
    engine = ext.Engine(group)
    for compute in (0, 0x1234):  # the default stream, another one
        with pytest.raises(RuntimeError, match="built without CUDA"):
            engine.all_reduce(_MetaOnCuda(4), "sum", "b", compute_stream=compute, side_stream=0x5EED, side=None)
    with pytest.raises(ValueError, match="need the side stream"):
        engine.all_reduce(_MetaOnCuda(4), "sum", "b", compute_stream=0, side_stream=0, side=None)


def test_wrapped_handle_epilogue_tells_the_allocator_of_the_waiting_stream(
    streams: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """qwZ's gather (``all_gather_quantized``; hpZ's quantized gather and frozen int8 chunks alike) receives the int8
    payloads into a buffer allocated with the issuing stream current and dequantizes out of it at ``wait()``, on the
    stream current then: that stream's use is recorded (``record_stream``) before the handle drops the buffer, as
    the torch engine's ``copy_out`` does; else its block could go to the issuing stream's next allocation while the
    dequantize is still queued (the gathered parameters silently wrong)."""
    from zero_kernels.comm.handles import Handle
    from zero_kernels.stages import quantized_gather

    recorded: list[tuple[str, str]] = []

    class Recorded(OnGpu1):
        def record_stream(self, stream: FakeStream) -> None:
            recorded.append((type(self).__name__, stream.name))

    class Received(Recorded):
        pass

    real_empty = torch.empty

    def empty(*size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        t = real_empty(*size, **kwargs)
        return t.as_subclass(Received) if device is not None and torch.device(device).type == "cuda" else t

    read_on: list[str] = []
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(
        quantized_gather, "dequantize_chunks", lambda *args, **kwargs: read_on.append(torch.cuda.current_stream(1).name)
    )
    engine = SimpleNamespace(world_size=2, rank=0, all_gather=lambda *args, **kwargs: comm.Handle(None, ()))
    layout = quantized_gather.Payload(64)
    payload = real_empty(layout.nbytes, dtype=torch.uint8).as_subclass(Recorded)
    full, shard = real_empty(128).as_subclass(Recorded), real_empty(64).as_subclass(Recorded)
    handle, _ = quantized_gather.all_gather_quantized(engine, full, shard, payload, layout, own_exact=True, name="g")
    assert isinstance(handle, Handle)
    streams["set_current"](FakeStream("autograd callback"))
    handle.wait()
    assert read_on == ["autograd callback"]
    assert ("Received", "autograd callback") in recorded, "the waiting stream's read of the received payloads is lost"


class _Work:
    """A c10d work that is done whenever asked (its own stream ordering is the backend's)."""

    def wait(self) -> None: ...

    def is_completed(self) -> bool:
        return False


def test_torch_engine_wait_on_another_stream_orders_the_issuing_stream(
    streams: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On NCCL a work's ``wait()`` orders only the stream current then. The C++ engine also makes the stream that was
    current at issue wait (its epilogue); the torch engine must too: with ``overlap_param_gather`` the step issues the
    gathers on the training stream and the first read of a parameter (an EMA update under a side stream) waits, and
    gives the parameter its class back; the next forward on the training stream then read the bucket while the
    all-gather was still writing it (silently stale or torn weights)."""
    from zero_kernels.comm import torch_engine

    monkeypatch.setattr(torch_engine, "all_gather_flat", lambda *args, **kwargs: _Work())
    engine = comm.TorchCommEngine.__new__(comm.TorchCommEngine)
    engine.rank, engine.world_size, engine.backend, engine._group = 0, 2, "nccl", None
    engine.where = "rank 0 of 2"
    engine._pending, engine._tags = [], 0
    full, shard = torch.zeros(8).as_subclass(OnGpu1), torch.zeros(4).as_subclass(OnGpu1)
    handle = engine.all_gather(full, shard, name="params.0", primitive="all_gather_tensor")
    ema = FakeStream("ema side stream")
    streams["set_current"](ema)
    handle.wait()
    assert streams["compute"].waited_for == ["ema side stream"], "the issuing stream does not follow the wait"
    later = FakeStream("another reader")
    streams["set_current"](later)
    handle.wait()  # a later waiter on a third stream follows the issuing stream, which follows the first wait
    assert later.waited_for == ["compute"]


def test_wrapped_handle_epilogue_on_another_stream_orders_the_issuing_stream(streams: dict[str, Any]) -> None:
    """qwZ's gather at stages 1-2 (``publish``, kept in flight by ``overlap_param_gather``) dequantizes the other
    ranks' parts into the parameter buffer at ``wait()``, on the stream current then. The inner C++ handle orders the
    issuing stream after the collective only, not after that dequantize: a wait under another stream must make the
    issuing stream follow it, whichever engine carried the payloads."""
    from zero_kernels.comm.handles import Handle, Works

    side, ran_on = FakeStream("side"), []
    inner = comm.CppHandle(RecordingOp(), side)
    full = torch.zeros(8).as_subclass(OnGpu1)
    handle = Handle(Works([inner]), (full,), lambda: ran_on.append(torch.cuda.current_stream(1).name), "qwZ")
    ema = FakeStream("ema side stream")
    streams["set_current"](ema)
    handle.wait()
    assert ran_on == ["ema side stream"] and ema.waited_for == ["side"]
    assert streams["compute"].waited_for == ["ema side stream"], "the issuing stream does not follow the dequantize"


def test_handles_waited_on_the_issuing_stream_add_no_wait(streams: dict[str, Any]) -> None:
    from zero_kernels.comm.handles import Handle

    handle = Handle(_Work(), (torch.zeros(4).as_subclass(OnGpu1),), None, "b")
    handle.wait()
    handle.wait()
    assert streams["compute"].waited_for == []
