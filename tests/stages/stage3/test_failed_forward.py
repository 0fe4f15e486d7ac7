"""A forward that raises out of a stage-3 model (an out-of-memory error caught, a batch-size finder's retry): the
units the modules it left running had gathered are freed, the failed batch's graph goes with its exception, and
training goes on as ``torch.optim.AdamW`` on the batches that trained. Before, the scheduler stayed "in forward"
for the rest of the run: every failed forward's activations and the failing module's full weights stayed held.

A ``KeyboardInterrupt`` (Ctrl-C caught by the loop to save and go on) runs no ``always_call`` hook: the next forward
finds the interrupted one still marked running and drops it, freeing its units. Before, each interrupt kept the
interrupted module's full weights gathered for the rest of the run (one more unit per interrupt), and every later
forward ran without prefetch and checked its gathers across ranks at once. One that lands inside a unit's free,
with some of its parameters freed and some not, leaves a unit the next use gathers whole (it was taken for a gathered
one with parameters replaced: the next ``gathered_params()`` raised a ``ValueError`` telling to resize the model).
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

import zero_kernels as zk
from tests.helpers.check import assert_close

LR = 1e-2


class OutOfMemory(Exception):
    """Stands for ``torch.OutOfMemoryError``."""


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _boom(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    raise OutOfMemory("stand-in for torch.OutOfMemoryError")


def test_a_forward_that_raises_leaves_nothing_held() -> None:
    model, ref = _model(), _model()
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, stage3_param_persistence_threshold=0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    _step(model, opt, 0)
    _step(ref, ropt, 0)
    held = opt.memory_report()["params"]
    activations: list[weakref.ref] = []
    keep = model[2].register_forward_hook(lambda m, i, o: activations.append(weakref.ref(o)))
    for _ in range(3):
        failing = model[4].register_forward_hook(_boom)
        try:
            model(torch.randn(256, 16)).sum().backward()
        except OutOfMemory:
            pass
        failing.remove()
        gc.collect()
        assert opt.memory_report()["params"] == held, "the failing forward's units stayed gathered"
        assert all(a() is None for a in activations), "the failed forward's activations stayed alive"
    keep.remove()
    for seed in (1, 2):
        _step(model, opt, seed)
        _step(ref, ropt, seed)
    with opt.gathered_params():
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p, q, rtol=1e-5, atol=1e-6 * float(q.detach().abs().max()), what=name)


def _interrupt(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    raise KeyboardInterrupt("Ctrl-C (simulated)")


def test_a_forward_interrupted_is_dropped_by_the_next() -> None:
    model, ref = _model(), _model()
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, stage3_param_persistence_threshold=0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    _step(model, opt, 0)
    _step(ref, ropt, 0)
    held = opt.memory_report()["params"]
    for seed, layer in ((1, 0), (2, 2), (3, 4)):
        failing = model[layer].register_forward_hook(_interrupt)
        try:
            model(torch.randn(8, 16)).sum().backward()
        except KeyboardInterrupt:
            opt.zero_grad()
        failing.remove()
        _step(model, opt, seed)
        _step(ref, ropt, seed)
        assert opt.memory_report()["params"] == held, f"the forward interrupted in layer {layer} kept units gathered"
    with opt.gathered_params():
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p, q, rtol=1e-5, atol=1e-6 * float(q.detach().abs().max()), what=name)


def test_a_free_interrupted_halfway_is_gathered_whole_next_time() -> None:
    model, ref = _model(), _model()
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, stage3_param_persistence_threshold=0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    _step(model, opt, 0)
    _step(ref, ropt, 0)
    unit = next(u for u in opt.pipeline._scheduler.units if any(p is model[2].weight for p in u.params))
    real = unit.free

    def cut_short(hand_over: bool = False) -> None:
        unit.__dict__.pop("free")
        unit.params[0].data = torch.empty(0)  # one parameter freed, the others not
        raise KeyboardInterrupt("Ctrl-C (simulated)")

    unit.free = cut_short
    try:
        model(torch.randn(8, 16)).sum().backward()
    except KeyboardInterrupt:
        opt.zero_grad()
    assert unit.free == real
    with opt.gathered_params():
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p, q, rtol=1e-5, atol=1e-6 * float(q.detach().abs().max()), what=f"{name}, free cut short")
    for seed in (1, 2):
        _step(model, opt, seed)
        _step(ref, ropt, seed)
    with opt.gathered_params():
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p, q, rtol=1e-5, atol=1e-6 * float(q.detach().abs().max()), what=name)


class _Recursive(nn.Module):
    """Calls itself once inside its own forward (the root running twice: not an interrupted forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, depth: int = 0) -> torch.Tensor:
        h = torch.tanh(self.inner(x))
        return self(h, depth + 1) if depth == 0 else self.head(h)


def test_a_root_called_inside_its_own_forward_trains_as_adamw() -> None:
    torch.manual_seed(0)
    model = _Recursive()
    torch.manual_seed(0)
    ref = _Recursive()
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, stage3_param_persistence_threshold=0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    held = None
    for seed in range(3):
        _step(model, opt, seed)
        _step(ref, ropt, seed)
        held = held or opt.memory_report()["params"]
        assert opt.memory_report()["params"] == held
    with opt.gathered_params():
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p, q, rtol=1e-5, atol=1e-6 * float(q.detach().abs().max()), what=name)
