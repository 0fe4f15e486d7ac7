"""Every CUDA event, stream and exchange names its device (the gradients' or the parameters'), never the current one.

No GPU here: ``FakeCuda`` stands in for ``torch.cuda`` on a rank whose current device (0) is not
the one its tensors live on (1), as after ``init_process_group(device_id=...)`` without
``torch.cuda.set_device``; it logs on which device each allocation, copy and event happens.
"""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator, Optional

import pytest
import torch

from zero_kernels import devices
from zero_kernels.stages import outcome


class FakeStream:
    def __init__(self, device: int):
        self.device = torch.device("cuda", device)


class FakeCuda:
    """The parts of ``torch.cuda`` a step's outcome uses, with device 0 current."""

    def __init__(self) -> None:
        self.current = 0
        self.log: list[tuple[str, int]] = []
        fake = self

        class Event:
            def record(self, stream: Optional[FakeStream] = None) -> None:
                stream = stream if stream is not None else fake.current_stream()
                fake.log.append(("event", stream.device.index))

            def query(self) -> bool:
                return True

            def synchronize(self) -> None:
                pass

        self.Event = Event

    def current_device(self) -> int:
        return self.current

    @contextlib.contextmanager
    def device(self, device: Any) -> Iterator[None]:
        previous, self.current = self.current, torch.device(device).index
        try:
            yield
        finally:
            self.current = previous

    def current_stream(self, device: Any = None) -> FakeStream:
        return FakeStream(self.current if device is None else torch.device(device).index)


class OnGpu1(torch.Tensor):
    """A CPU tensor that says it lives on cuda:1 (results of torch operations on it say so too)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 1)


class PinnedHost:
    """What ``torch.empty(..., pin_memory=True)`` returns: logs where it was made and filled."""

    def __init__(self, cuda: FakeCuda, shape: torch.Size, dtype: torch.dtype):
        self.cuda, self.values = cuda, torch.empty(shape, dtype=dtype)
        cuda.log.append(("pinned", cuda.current))

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> "PinnedHost":
        self.cuda.log.append(("copy", self.cuda.current))
        self.values.copy_(src.as_subclass(torch.Tensor))
        return self

    def tolist(self) -> list:
        return self.values.tolist()


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    cuda = FakeCuda()
    for name in ("Event", "current_device", "device", "current_stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    empty = torch.empty

    def fake_empty(*shape: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return PinnedHost(cuda, torch.Size(*shape), kwargs["dtype"]) if pin_memory else empty(*shape, **kwargs)

    monkeypatch.setattr(torch, "empty", fake_empty)
    return cuda


def test_step_result_copies_and_records_on_the_gradients_device(fake_cuda: FakeCuda) -> None:
    """The norm and skip flag of a step on cuda:1, with cuda:0 current: the pinned buffer, the copy and the
    event that completes it are all on cuda:1 (an event on cuda:0 completes without the copy: the host
    would read the previous step's values)."""
    norm = torch.tensor(2.5, dtype=torch.float64).as_subclass(OnGpu1)
    skip = torch.ones(1).as_subclass(OnGpu1)
    assert norm.device.type == "cuda" and torch.cat([norm.reshape(1)]).device.index == 1
    result = outcome.StepResult(norm, skip)
    assert fake_cuda.log == [("pinned", 1), ("copy", 1), ("event", 1)], fake_cuda.log
    assert fake_cuda.current == 0, "the current device was not given back"
    assert (result.grad_norm, result.skipped) == (2.5, True)


def test_a_current_device_other_than_the_parameters_is_refused_with_the_fix(fake_cuda: FakeCuda) -> None:
    """Parameters on cuda:1 with cuda:0 current: construction stops before anything is made, saying what to call."""
    import zero_kernels as zk

    model = torch.nn.Linear(4, 3)
    for name, p in list(model.named_parameters()):
        setattr(model, name, torch.nn.Parameter(p.detach().clone().as_subclass(OnGpu1)))
    assert model.weight.device == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"on cuda:1 but cuda:0 is the current device.*torch\.cuda\.set_device"):
        zk.ShardedFusedAdam(model, stage=1)
    fake_cuda.current = 1  # what torch.cuda.set_device(LOCAL_RANK) does: now the check passes
    assert devices.current_device_problem(model.weight.device) is None


def test_a_rank_on_the_wrong_device_stops_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is exchanged: a rank whose own device is right raises too when another rank's is wrong."""
    seen = []

    def exchange(engine: Any, obj: Any, name: str, device: Any) -> list:
        seen.append(device)
        return [obj, "the parameters are on cuda:1 but cuda:0 is the current device"]

    monkeypatch.setattr(devices, "all_gather_objects", exchange)
    engine = SimpleNamespace(world_size=2, rank=0, backend="gloo", global_ranks=None)
    with pytest.raises(ValueError, match=r"^ShardedFusedAdam: on rank 1: the parameters are on cuda:1.*set_device"):
        devices.check_current_device(engine, torch.device("cpu"))
    assert seen == [torch.device("cpu")], "the exchange must run on the parameters' device"
    devices.check_current_device(engine, torch.device("cpu"), exchange=False)  # a copy: this rank only


def test_construction_exchanges_run_on_the_parameters_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """On NCCL without a bound device, the fingerprint exchange names the parameters' device; an exchange that
    names none is refused rather than run on whatever device is current (GPU 0 on every rank)."""
    from zero_kernels import agreement, comm_objects

    seen = []

    def exchange(engine: Any, obj: Any, name: str, device: Any = None) -> list:
        seen.append(device)
        return [obj, obj]

    monkeypatch.setattr(agreement, "all_gather_objects", exchange)
    nccl = SimpleNamespace(
        world_size=2, rank=0, backend="nccl", group=SimpleNamespace(bound_device_id=None), kind="cpp", global_ranks=None
    )
    opt = SimpleNamespace(pipeline=SimpleNamespace(engine=nccl, device=torch.device("cuda", 1)))
    agreement.check_optimizer(opt, "constructed with 1 param groups")
    assert seen == [torch.device("cuda", 1)]
    with pytest.raises(ValueError, match="needs a device"):
        comm_objects.collective_device(nccl)


def test_cpu_parameters_on_a_cuda_only_group_exchange_on_the_current_gpu(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model left on the CPU under init_process_group("nccl") (its group carries CUDA tensors only): the check's
    exchange runs on this rank's current GPU, not on the CPU (which NCCL refuses), and names the fix."""
    from zero_kernels.comm import devices as comm_devices

    seen = []

    def exchange(engine: Any, obj: Any, name: str, device: Any) -> list:
        seen.append(device)
        return [obj, None]

    monkeypatch.setattr(comm_devices, "all_gather_objects", exchange)
    monkeypatch.setattr(comm_devices.dist, "get_backend_config", lambda group: "cuda:nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    nccl = SimpleNamespace(world_size=2, rank=0, backend="nccl", group=object(), global_ranks=None)
    with pytest.raises(
        ValueError,
        match=r"^ShardedFusedAdam: on rank 0: the parameters are on cpu but the process "
        r"group carries cuda tensors only \(backend nccl\); move the model to this rank's GPU.*"
        r"model\.to\(torch\.cuda\.current_device\(\)\); zk\.initialize does not move the model",
    ):
        devices.check_current_device(nccl, torch.device("cpu"))
    assert seen == [torch.device("cuda", 0)], "the exchange must run on a device the group carries"
    seen.clear()
    devices.check_current_device(nccl, torch.device("cuda", 0))  # the model on its GPU: nothing to say
    assert seen == [torch.device("cuda", 0)]
    monkeypatch.setattr(comm_devices.dist, "get_backend_config", lambda group: "cpu:gloo,cuda:nccl")
    devices.check_current_device(nccl, torch.device("cpu"))  # a group that carries CPU tensors too: they train there


def _cpu_model_on_a_cuda_only_group(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    import zero_kernels as zk

    group = dist.new_group(backend="cuda:gloo")  # the device map of init_process_group("nccl"): CUDA tensors only
    assert dist.get_backend_config(group) == "cuda:gloo"
    torch.manual_seed(rank)  # values differ across ranks: zk.initialize would broadcast rank 0's
    model = torch.nn.Linear(4, 3)  # never moved to a GPU
    refused = r"parameters are on cpu but the process group carries cuda tensors only.*model\.to\(torch\.cuda\."
    with pytest.raises(ValueError, match=refused):
        zk.ShardedFusedAdam(model, lr=1e-3, stage=2, process_group=group)
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
    with pytest.raises(ValueError, match=refused):  # not c10d's "No backend type associated with device type cpu"
        zk.initialize(model, config, process_group=group)


@pytest.mark.distributed
def test_a_model_left_on_the_cpu_under_a_cuda_only_group_is_refused_with_the_fix() -> None:
    """The group of init_process_group("nccl") carries no CPU tensors: a model never moved to its GPU (which
    deepspeed.initialize would have done) is refused on every rank naming the fix, by ShardedFusedAdam and by
    zk.initialize, where the optimizer's first internal exchange (initialize: its comparison of the ranks' values)
    failed with c10d's "No backend type associated with device type cpu"."""
    from tests.helpers.dist import run_ranks

    run_ranks(_cpu_model_on_a_cuda_only_group, 2)


PACKAGE = Path(__file__).resolve().parents[2] / "zero_kernels"
# The current CUDA device, read on purpose: the construction check, and a checkpoint's GPU tensor read back.
READS_CURRENT_DEVICE = {"comm/devices.py", "checkpoint/objects.py"}
IMPLICIT = {  # torch.cuda functions that take the current device when given no argument
    "current_stream", "default_stream", "synchronize", "Stream", "current_blas_handle", "set_device",
}  # fmt: skip


def _dotted(node: ast.AST) -> str:
    """``torch.cuda.current_stream`` for that attribute chain; "" for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _cuda(values: list[ast.AST]) -> bool:
    """Whether ``values`` hold the bare device name "cuda" (the current CUDA device)."""
    return any(isinstance(v, ast.Constant) and v.value == "cuda" for v in values)


def _launch_guards(tree: ast.AST) -> set[int]:
    """The ids of the calls inside a ``with tuning.launch_device(...)`` block."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        entered = (
            [i.context_expr for i in node.items if isinstance(i.context_expr, ast.Call)]
            if isinstance(node, ast.With)
            else []
        )
        if any(_dotted(call.func).endswith("launch_device") for call in entered):
            inside |= {id(n) for n in ast.walk(node) if isinstance(n, ast.Call)}
    return inside


def _implicit_device_calls(path: Path) -> list[str]:
    """Calls in ``path`` that would queue work on, or read, the current CUDA device instead of a named one."""
    tree = ast.parse(path.read_text())
    guarded, where = _launch_guards(tree), path.relative_to(PACKAGE).as_posix()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name, args = _dotted(node.func), node.args or node.keywords
        bad = name.startswith("torch.cuda.") and name.rsplit(".", 1)[1] in IMPLICIT and not args
        bad |= name == "torch.cuda.set_device" or (name.endswith(".cuda") and not args)
        bad |= name == "torch.cuda.current_device" and where not in READS_CURRENT_DEVICE
        bad |= name.endswith(".record") and not args  # an event recorded on the current device's stream
        bad |= name == "torch.device" and len(node.args) == 1 and _cuda(node.args)
        bad |= name.endswith(".to") and _cuda(node.args) or _cuda([k.value for k in node.keywords if k.arg == "device"])
        launch = isinstance(node.func, ast.Subscript) and _dotted(node.func.value).endswith("_kernel")
        bad |= launch and id(node) not in guarded and where != "kernels/aot.py"  # Triton launches on the current device
        if bad:
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_no_cuda_call_takes_the_current_device_implicitly() -> None:
    """Every stream, event, synchronisation and Triton launch of the package names its tensors' device (or runs in
    ``tuning.launch_device``): a rank whose tensors are on cuda:1 would otherwise queue it on the current device,
    GPU 0 where the script did not call torch.cuda.set_device (refused at construction, but only there)."""
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in _implicit_device_calls(path)]
    assert not found, "\n".join(found)
