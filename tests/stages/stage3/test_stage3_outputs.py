"""Stage 3: what a module returns and what forward hooks see, in lock-step with ``torch.optim.AdamW``.

- A forward hook put on after the optimizer, reading the module's parameters and returning its input on some
  ranks (a layer drop), trains as AdamW: stage 3's own last hook is kept the module's last.
- A module returning views of its own parameter (``self.table[:n]``, GPT-2's ``wpe`` read as a slice), or the
  parameter itself, read after the module freed its units, trains and evaluates as AdamW.
- Outputs inside a frozen dataclass, a tuple subclass whose constructor takes the items one by one, and a dict
  that mirrors its keys as attributes (read by attribute) train as AdamW; so does a model whose hooks keep a
  module's output, which the caller then changes in place (``nn.ReLU(inplace=True)``), and a view of a
  parameter, both read in the loss; and one whose loss is only what a hook kept (feature extraction); also
  with the feature kept by a global forward hook (``register_module_forward_hook``, run before a module's own),
  also one put on inside the forward or around the children called directly.
- A module returning its child's weight (a tied head reads it), with a hook that adds a tensor made from the
  module's parameter to its output dict in place, trains as AdamW.
- ``stage3.nested`` finds and replaces tensors in those containers, keeping their types and attributes.

Tolerances as in ``test_stage3.py``: fp32, ``rtol=1e-5`` with ``atol = 1e-6 x`` the tensor's largest
magnitude, after every step.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict, namedtuple
from typing import Callable, Optional

import pytest
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

import zero_kernels as zk
from tests.helpers.check import assert_close
from tests.stages.stage3.test_stage3_models import LR, ROWS, SKIP_USES, SMALL, _train
from zero_kernels.stages.stage3 import nested


def _batches(world: int, steps: int = 3) -> list[torch.Tensor]:
    return [torch.randn(world * ROWS, 4, generator=torch.Generator().manual_seed(s)) for s in range(steps)]


def _built(make: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module, zk.ShardedFusedAdam]:
    """A model from ``make`` (seeded), its copy for AdamW, and its stage-3 optimizer with small units."""
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    return model, ref, zk.ShardedFusedAdam(model, lr=LR, weight_decay=0.1, stage=3, **SMALL)


def _chunked(ref: nn.Module, world: int) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """``forward(m, x)`` for ``_train``: ``ref`` runs the whole batch as ``world`` chunks, the model its rows."""
    return lambda m, x: m(x, world if m is ref else 1)


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).square().mean()


def _hook_cases(rank: int, world: int) -> None:
    """A hook on ``b``, put on after the optimizer was built, records ``b.weight``'s norm and drops ``b`` (returns
    its input) on the ranks ``SKIP_USES`` does not use it on; ``ref`` runs each rank's chunk with that rank's choice."""
    batches = _batches(world, 4)
    model, ref, opt = _built(Chain)
    drop, norms = [False], {id(model): [], id(ref): []}
    for net in (model, ref):
        net.b.register_forward_hook(
            lambda mod, args, out, key=id(net): (
                norms[key].append(mod.weight.detach().norm()) or (args[0] if drop[0] else None)
            )
        )
    steps, uses = iter(SKIP_USES), []

    def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if m is not ref:
            uses.append(next(steps))
            drop[0] = not uses[-1][rank]
            return m(x)
        losses = []
        for r, h in enumerate(x.chunk(world)):
            drop[0] = not uses[-1][r]
            losses.append(m(h))
        return sum(losses) / world

    _train(rank, world, model, ref, opt, batches, "hook put on after the optimizer", forward)
    assert_close(
        torch.stack(norms[id(model)]),
        torch.stack(norms[id(ref)][rank::world]),
        rtol=1e-5,
        atol=1e-6,
        what="norms read in the hook",
    )
    opt.pipeline.close()


@pytest.mark.distributed
def test_forward_hook_put_on_after_the_optimizer_runs_before_the_module_frees(spawn) -> None:
    """A user's forward hook registered after the optimizer reads the module's parameters and, on some ranks,
    replaces the output by the input (a layer drop): it trains as AdamW (the ranks used to wait in their
    collectives until the timeout, stage 3's hook having run first)."""
    spawn(_hook_cases, 2)


class Positions(nn.Module):
    """A table of learned positions returned as views of the parameter (GPT-2's ``wpe``, a ViT's ``pos_embed``)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.table = nn.Parameter(torch.randn(8, 6))

    def forward(self, n: int) -> dict[str, torch.Tensor]:
        rows = self.table[:n] if self.form == "slice" else self.table.view(4, 12)[: (n + 1) // 2].view(-1, 6)[:n]
        return {"rows": rows}


class PositionNet(nn.Module):
    """The mean of the losses of ``x``'s chunks, each given the positions of its rows."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.inp, self.pos, self.out = nn.Linear(4, 6), Positions(form), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, chunks: int = 1) -> torch.Tensor:
        losses = []
        for h in x.chunk(chunks):
            got = self.pos(len(h))
            losses.append(self.out(torch.tanh(self.inp(h) + got["rows"])).square().mean())
        return sum(losses) / chunks


def _position_cases(rank: int, world: int) -> None:
    batches = _batches(world)
    for form in ("slice", "views"):
        model, ref, opt = _built(lambda: PositionNet(form))
        _train(rank, world, model, ref, opt, batches, f"positions ({form})", _chunked(ref, world))
        x = batches[0][rank * ROWS : (rank + 1) * ROWS]
        with torch.no_grad():
            assert_close(model(x), ref(x), rtol=1e-5, atol=1e-7, what=f"positions ({form}) evaluated")
        opt.pipeline.close()


@pytest.mark.distributed
@pytest.mark.parametrize("world", (1, 2), ids=lambda w: f"world{w}")
def test_module_returning_views_of_its_parameter_matches_adamw(spawn, world: int) -> None:
    """A module that returns slices and views of its parameter (in a dict), read after the module freed its
    parameters, trains and evaluates as AdamW (the views used to read freed memory: a crash
    or garbage)."""
    spawn(_position_cases, world)


@dataclasses.dataclass(frozen=True)
class Rows:
    rows: torch.Tensor
    scaled: torch.Tensor


class Pair(tuple):
    """A tuple subclass whose constructor takes the items one by one."""

    def __new__(cls, rows: torch.Tensor, scaled: torch.Tensor) -> "Pair":
        return super().__new__(cls, (rows, scaled))

    @property
    def rows(self) -> torch.Tensor:
        return self[0]

    @property
    def scaled(self) -> torch.Tensor:
        return self[1]


class AttrDict(dict):
    """Keys mirrored as attributes, set once (as EasyDict-style containers do)."""

    def __init__(self, **items: torch.Tensor) -> None:
        super().__init__(**items)
        for key, value in items.items():
            object.__setattr__(self, key, value)


class Table(nn.Module):
    """Positions as a view of the parameter and a computed tensor, in the container ``form`` names; ``param``
    returns the parameter itself (the caller slices it)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.table = nn.Parameter(torch.randn(8, 6))

    def forward(self, n: int):
        rows, scaled = self.table[:n], self.table[:n] * 2
        if self.form == "param":
            return self.table
        return {"dataclass": Rows, "pair": Pair, "attrdict": AttrDict}[self.form](rows=rows, scaled=scaled)


class Kept(nn.Module):
    """Hooks keep ``feat``'s output (changed in place by the caller's ReLU afterwards) and a view of the table's
    rows; the loss reads both, or (``features``) only the kept output."""

    def __init__(self, form: str, features: bool = False) -> None:
        super().__init__()
        self.form, self.features = form, features
        self.feat, self.act, self.table, self.out = nn.Linear(4, 6), nn.ReLU(inplace=True), Table(form), nn.Linear(6, 2)
        self.kept: list[torch.Tensor] = []

    def keep(self, globally: bool = False) -> Optional[RemovableHandle]:
        """Put on the hooks (after a deep copy: each model keeps into its own list); ``globally``: ``feat``'s as a
        global forward hook (returned, to take off)."""
        self.kept = []
        handle = None
        if globally:
            keep = lambda m, args, out: self.kept.append(out) if m is self.feat else None  # noqa: E731
            handle = torch.nn.modules.module.register_module_forward_hook(keep)
        else:
            self.feat.register_forward_hook(lambda m, args, out: self.kept.append(out), prepend=True)
        self.table.register_forward_hook(lambda m, args, out: self.kept.append(self._rows(out)[0].detach()))
        return handle

    def _rows(self, out) -> tuple[torch.Tensor, torch.Tensor]:
        if self.form == "param":
            return out[:ROWS], out[:ROWS] * 2
        return out.rows, out.scaled

    def forward(self, x: torch.Tensor, chunks: int = 1) -> torch.Tensor:
        losses = []
        for h in x.chunk(chunks):
            del self.kept[:]
            y = self.act(self.feat(h))
            rows, scaled = self._rows(self.table(len(h)))
            feature, snapshot = self.kept
            if self.features:
                losses.append(feature.square().mean())
            else:
                z = self.out(y + rows + scaled).square().mean()
                losses.append(z + 0.5 * feature.mean() + (snapshot * y).mean())
        return sum(losses) / chunks


def _kept_cases(rank: int, world: int) -> None:
    batches = _batches(world)
    cases = [(form, False, False) for form in ("dataclass", "pair", "attrdict", "param")]
    cases += [("pair", True, False), ("pair", False, True), ("pair", True, True)]
    for form, features, globally in cases:
        model, ref, opt = _built(lambda: Kept(form, features))
        handles = [ref.keep(globally), model.keep(globally)]  # the model's after the optimizer
        what = f"kept outputs ({form}, features {features}, global hook {globally})"
        try:
            _train(rank, world, model, ref, opt, batches, what, _chunked(ref, world))
        finally:
            for handle in handles:
                handle is not None and handle.remove()
        opt.pipeline.close()
        assert not torch.nn.modules.module._global_forward_hooks, f"{what}: a global hook left behind"


@pytest.mark.distributed
@pytest.mark.parametrize("world", (1, 2), ids=lambda w: f"world{w}")
def test_outputs_in_containers_and_kept_by_hooks_match_adamw(spawn, world: int) -> None:
    """Outputs in containers ``nested`` opens, read by attribute; a hook's kept output changed in place by the
    caller, and a kept view of a parameter, both in the loss; a loss of only what a hook kept: as AdamW (the kept
    output used to miss the in-place ReLU in its gradient, the views and the feature-only loss crashed)."""
    spawn(_kept_cases, world)


class Probed(nn.Module):
    """A global forward hook keeps ``inp``'s output for an extra loss, put on inside the forward (``mid``) or
    around calls of the children made by the caller (``children``), after the root's pre-hooks ran or without
    them; the caller's ReLU then changes the output in place."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.inp, self.act, self.out = nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 2)

    def kept(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kept = []
        keep = lambda m, args, out: kept.append(out) if m is self.inp else None  # noqa: E731
        handle = torch.nn.modules.module.register_module_forward_hook(keep)
        try:
            return self.out(self.act(self.inp(h))), kept[0]
        finally:
            handle.remove()

    def forward(self, x: torch.Tensor, chunks: int = 1) -> torch.Tensor:
        parts = [self.kept(h) for h in x.chunk(chunks)]
        return sum(y.square().mean() + 0.5 * k.mean() for y, k in parts) / chunks


def _probed_cases(rank: int, world: int) -> None:
    batches = _batches(world)
    for mode in ("mid", "children"):
        model, ref, opt = _built(lambda: Probed(mode))
        forward = _chunked(ref, world)
        if mode == "children":
            forward = lambda m, x: Probed.forward(m, x, world if m is ref else 1)  # noqa: E731
        _train(rank, world, model, ref, opt, batches, f"global hook ({mode})", forward)
        model.out(torch.zeros(1, 6))  # a module's forward without user global hooks takes stage 3's off
        assert not torch.nn.modules.module._global_forward_hooks, f"{mode}: a global hook left behind"
        opt.pipeline.close()


@pytest.mark.distributed
@pytest.mark.parametrize("world", (1, 2), ids=lambda w: f"world{w}")
def test_global_hook_put_on_inside_the_forward_or_around_children_matches_adamw(spawn, world: int) -> None:
    """A global forward hook put on after the model's forward began, or around its children called directly,
    keeps the output the caller gets (it used to miss the caller's in-place ReLU); stage 3's global hook is off
    again once the user's are."""
    spawn(_probed_cases, world)


class Embed(nn.Module):
    """Returns its child's weight beside its output (a head tied to it reads it)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.scale = nn.Linear(4, 6, bias=False), nn.Parameter(torch.ones(6))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": self.tok(x) * self.scale, "w": self.tok.weight}


class TiedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = Embed()

    def extra(self) -> None:
        """A hook that adds to the output dict in place a tensor made from the module's parameter."""
        self.emb.register_forward_hook(lambda m, args, out: out.__setitem__("extra", out["h"] * m.scale))

    def forward(self, x: torch.Tensor, chunks: int = 1) -> torch.Tensor:
        losses = []
        for h in x.chunk(chunks):
            out = self.emb(h)
            losses.append((out["h"] @ out["w"]).square().mean() + out["extra"].mean())
        return sum(losses) / chunks


def _tied_cases(rank: int, world: int) -> None:
    batches = _batches(world)
    model, ref, opt = _built(TiedHead)
    ref.extra(), model.extra()  # the model's after the optimizer
    what = "child's weight returned, a hook adding to the output"
    _train(rank, world, model, ref, opt, batches, what, _chunked(ref, world))
    opt.pipeline.close()


@pytest.mark.distributed
@pytest.mark.parametrize("world", (1, 2), ids=lambda w: f"world{w}")
def test_child_weight_returned_and_hook_adding_an_output_match_adamw(spawn, world: int) -> None:
    """A module returning its child's weight (a copy, gathered for it) and a hook that adds a tensor made from
    the module's parameter to its output dict in place (routed at the exit) train as AdamW (the first read
    freed memory, the second's backward ran without the parameter gathered)."""
    spawn(_tied_cases, world)


Point = namedtuple("Point", "x y")


def test_nested_finds_and_replaces_tensors_keeping_types_and_attributes() -> None:
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    new = {id(a): c}
    for obj, kind in [
        (Rows(a, b), Rows),
        (Pair(a, b), Pair),
        (AttrDict(rows=a, scaled=b), AttrDict),
        (Point(a, b), Point),
        (OrderedDict(rows=a, scaled=b), OrderedDict),
        ([a, (b, {"k": a})], list),
    ]:
        assert [id(t) for t in nested.tensors(obj)][:2] == [id(a), id(b)], kind
        out = nested.replace(obj, new)
        assert type(out) is kind and out is not obj, kind
        assert [id(t) for t in nested.tensors(out)][:2] == [id(c), id(b)], kind
        assert nested.replace(obj, {}) is obj, f"{kind}: nothing replaced, nothing rebuilt"
    assert nested.replace(AttrDict(rows=a, scaled=b), new).rows is c, "mirrored attribute"
    assert nested.tensors(object()) == [] and nested.tensors(None) == []
    looped = {"a": a}
    looped["self"] = looped
    assert nested.tensors(looped) == [a], "a dict inside itself is looked into once"
    out = nested.replace(looped, new)
    assert out["a"] is c and out["self"] is looped, "the inner reference keeps pointing at the original"
