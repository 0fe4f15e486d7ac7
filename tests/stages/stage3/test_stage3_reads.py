"""Stage 3: parameters read outside a forward, on 1-3 gloo ranks.

Between uses a stage-3 parameter is an empty tensor. Computing with it, with what its ``.data``,
``.detach()`` or a conversion gave (a snapshot, an EMA, ``AveragedModel``, a norm, ``torch.save``),
and ``model.load_state_dict`` into it raise an error naming the parameter and
``gathered_params()``, and change nothing; metadata reads and conversions of the model still pass.
Inside ``gathered_params()`` the same code works: a best-weights snapshot and its restore, an EMA
and ``torch.optim.swa_utils.AveragedModel`` match the same code run on ``torch.optim.AdamW``'s
model, element by element (fp32 tolerance of DESIGN.md, as ``tests.helpers.lockstep.compare``).
"""

from __future__ import annotations

import io
from typing import Any, Callable

import pytest
import torch
from torch.optim.swa_utils import AveragedModel

from tests.helpers.check import assert_close
from tests.helpers.lockstep import LR, WORLD_SIZES, Net, batch, compare, forward_backward, make_models, make_opt

FIX = r"gathered_params\(\)"


def raises_naming(fn: Callable[[], Any], name: str, what: str) -> None:
    with pytest.raises(RuntimeError, match=rf"'{name}'.*{FIX}") as info:
        fn()
    assert "size mismatch" not in str(info.value), f"{what}: {info.value}"


def train_step(model: Net, ref: Net, opt: Any, ropt: Any, rank: int, world: int, step: int) -> None:
    forward_backward(model, ref, rank, world, 3, step)
    for o in (opt, ropt):
        o.step()
        o.zero_grad()


def reads_outside(model: Net, opt: Any) -> None:
    """Every way of computing with a freed parameter or what it gave raises, naming it; nothing changes."""
    p = model.emb.weight
    assert p.data.shape == (0,) and p.detach().numel() == 0 and p.data.dtype == torch.float32  # metadata passes
    with opt.gathered_params():
        before = {n: q.detach().clone() for n, q in model.named_parameters()}
    ema = torch.zeros(11, 6)
    cases = {
        "p.data.norm()": lambda: p.data.norm(),
        "p.detach().sum()": lambda: p.detach().sum(),
        "snapshot": lambda: {n: q.data.clone() for n, q in model.named_parameters()},
        "restore": lambda: p.data.copy_(before["emb.weight"]),
        "ema.lerp_(p.detach())": lambda: ema.lerp_(p.detach(), 0.1),
        "p.detach().cpu().clone()": lambda: p.detach().cpu().clone(),
        "p.data.t()": lambda: p.data.t(),
        "torch.save(p.detach())": lambda: torch.save(p.detach(), io.BytesIO()),
        "p.add(1)": lambda: p.add(1.0),
    }
    for what, fn in cases.items():
        raises_naming(fn, "emb.weight", what)
    state = {n: t.clone() for n, t in before.items()}
    raises_naming(lambda: model.load_state_dict(state), "emb.weight", "load_state_dict")
    raises_naming(lambda: model.load_state_dict(state, assign=True), "emb.weight", "load_state_dict(assign=True)")
    raises_naming(lambda: model.mid.load_state_dict({"weight": state["mid.weight"]}, strict=False), "weight", "mid")
    assert torch.equal(ema, torch.zeros(11, 6)), "ema written"
    model.to(torch.device("cpu", 0))  # what frameworks do to a built model still passes
    with opt.gathered_params():
        for n, q in model.named_parameters():
            assert torch.equal(q, before[n]), f"{n} changed by a refused operation"


def reads_case(rank: int, world: int) -> None:
    model, ref = make_models(torch.float32)
    averaged, ref_averaged = AveragedModel(model), AveragedModel(ref)  # made before the optimizer: whole copies
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref_ema = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt, ropt = make_opt(model, 3), torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(2):
        train_step(model, ref, opt, ropt, rank, world, step)
        with opt.gathered_params():
            averaged.update_parameters(model)
            for n, p in model.named_parameters():
                ema[n].lerp_(p.detach(), 0.25)
        ref_averaged.update_parameters(ref)
        for n, p in ref.named_parameters():
            ref_ema[n].lerp_(p.detach(), 0.25)
    reads_outside(model, opt)
    throwaway = AveragedModel(Net())  # update_parameters updates the parameters before the first freed one
    raises_naming(lambda: throwaway.update_parameters(model), "emb.weight", "AveragedModel.update_parameters")
    with opt.gathered_params():
        best = {n: p.data.clone() for n, p in model.named_parameters()}
    ref_best = {n: p.data.clone() for n, p in ref.named_parameters()}
    for step in range(2, 4):
        train_step(model, ref, opt, ropt, rank, world, step)
    with opt.gathered_params():
        for n, p in model.named_parameters():
            p.data.copy_(best[n])
    for n, p in ref.named_parameters():
        p.data.copy_(ref_best[n])
    with opt.gathered_params():
        compare(model, ref, f"world {world}: best weights restored")
    train_step(model, ref, opt, ropt, rank, world, 4)
    with opt.gathered_params():
        compare(model, ref, f"world {world}: a step after the restore")
    compare(averaged.module, ref_averaged.module, f"world {world}: AveragedModel")
    for n, r in ref_ema.items():
        assert torch.allclose(ema[n], r, rtol=1e-5, atol=1e-6 * r.abs().max().item()), f"world {world}: EMA {n}"


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"world{w}")
def test_reading_freed_parameters_outside_a_forward(spawn, world: int) -> None:
    spawn(reads_case, world)


def test_reads_inside_a_forward_of_another_module_still_work() -> None:
    """A module's forward that reads another module's freed parameter directly gathers it (registered as
    external); read through ``.detach()`` there, it raises, naming the fix."""

    class Head(torch.nn.Module):
        def __init__(self, embed: torch.nn.Linear, detach: bool) -> None:
            super().__init__()
            self.embed, self.detach = [embed], detach  # not a sub-module: its weight is another module's

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            w = self.embed[0].weight
            return h @ (w.detach() if self.detach else w)

    for detach in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())
        model.append(Head(model[0], detach))
        opt = make_opt(model, 3)
        x = torch.randn(2, 6)
        if detach:
            with pytest.raises(RuntimeError, match=rf"'0.weight'.*\.detach\(\).*{FIX}"):
                model(x)
            continue
        model(x).square().sum().backward()
        opt.step()


def swap(model: Net, ema: list[torch.Tensor]) -> None:
    """Evaluate-with-EMA idiom: ``p.data, e.data = e.data, p.data`` for every parameter."""
    for p, e in zip(model.parameters(), ema):
        p.data, e.data = e.data, p.data


def ema_swap_case(rank: int, world: int) -> None:
    """EMA weights swapped in for an evaluation and back: inside ``gathered_params()`` (the forward outside it) as
    AdamW's model does; outside it, the swap back of a parameter gathered since raises, naming it, instead of
    keeping the EMA as the trained weights (and leaving the EMA empty)."""
    model, ref = make_models(torch.float32)
    opt, ropt = make_opt(model, 3), torch.optim.AdamW(ref.parameters(), lr=LR)
    ema = [torch.full_like(p, 0.5) for p in ref.parameters()]
    ref_ema = [e.clone() for e in ema]
    x = batch(7, 3)
    for step in range(2):
        train_step(model, ref, opt, ropt, rank, world, step)
    with opt.gathered_params():
        swap(model, ema)
    swap(ref, ref_ema)
    with torch.no_grad():
        assert_close(model(x), ref(x), rtol=1e-5, atol=1e-6, what=f"world {world}: forward with the EMA swapped in")
    with opt.gathered_params():
        swap(model, ema)
    swap(ref, ref_ema)
    swap(model, ema)  # outside the block, nothing in between: undone exactly
    swap(model, ema)
    train_step(model, ref, opt, ropt, rank, world, 2)
    with opt.gathered_params():
        compare(model, ref, f"world {world}: EMA swapped in and out")
    for e, r in zip(ema, ref_ema):
        assert torch.equal(e, r), f"world {world}: the EMA lost its values"
    swap(model, ema)  # outside the block, then a forward gathers what was swapped in
    with torch.no_grad():
        model(x)
    with pytest.raises(RuntimeError, match=r"p\.data = t.*'emb.weight'.*gathered_params\(\)"):
        swap(model, ema)


@pytest.mark.distributed
@pytest.mark.parametrize("world", (1, 2), ids=lambda w: f"world{w}")
def test_ema_swapped_in_and_out(spawn, world: int) -> None:
    spawn(ema_swap_case, world)


def test_numpy_views_of_gathered_parameters_leave_training_working() -> None:
    """``p.detach().numpy()`` inside ``gathered_params()`` (what ``torch.utils.tensorboard``'s ``add_histogram`` does
    with a CPU tensor) and in a forward hook makes the storage not resizable: the free leaves it to the array (or
    to nobody) instead of raising ``Trying to resize storage that is not resizable``, there and at every later
    forward, and training goes on as AdamW."""
    model, ref = make_models(torch.float32)
    opt, ropt = make_opt(model, 3), torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(3):
        with opt.gathered_params():
            for p, r in zip(model.parameters(), ref.parameters()):
                assert_close(torch.from_numpy(p.detach().numpy().copy()), r.detach(), rtol=1e-5, atol=1e-6)
        seen = []
        hook = model.head.register_forward_hook(lambda m, i, o: seen.append(m.weight.detach().numpy().sum()))
        train_step(model, ref, opt, ropt, 0, 1, step)
        hook.remove()
        assert seen
    with opt.gathered_params():
        compare(model, ref, "after numpy() views of gathered parameters")
