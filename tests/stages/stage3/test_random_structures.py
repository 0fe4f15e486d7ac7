"""Stage 3 on randomly drawn model structures and forward programs, in lock-step with DDP + ``torch.optim.AdamW``.

Each seed draws a model (blocks in a ``ModuleList``, a ``ModuleDict`` or Sequentials in a Sequential; a block
is a Linear, Linear + BatchNorm, Linear + a registered constant, a parent reading its child's weight, a block
reading another block's weight with ``F.linear``, a frozen Linear, a Linear tied to another, nested Sequentials,
a ModuleList or a ModuleDict called in an order that changes by step, a parameter held directly), a parameter
on the root, stage-3 knobs drawn small (prefetch, persistence threshold, live parameters, bucket, overlap) and a
program per micro-step (the same on every rank): blocks called several times in any order or skipped, inside
reentrant or non-reentrant checkpoints or ``torch.no_grad()``, returning tuples, dicts or dataclasses; the root
reading a child's weight; sometimes a second forward whose output is not used, an evaluation forward between
steps, two micro-steps (``no_sync`` or ``gradient_accumulation_steps``) and clipping. The reference is each
rank's own copy with its gradients averaged over the ranks (what DDP does) and ``torch.optim.AdamW``.

Compared after every step: every parameter (inside ``gathered_params()``) and buffer; every loss, the
evaluation outputs and the clipped norm. Losses at step 0 within 1.3e-6 relative (DESIGN.md), later ones 1e-5
(the weights they read differ by rounding); weights within 2e-5 + 1e-5 relative. Where a gradient is a sum of
terms that cancel, the order of its sums (per module at stage 3, per bucket at stage 2, per rank here) differs
in the last bits, and Adam turns a gradient at rounding level into a step of ~lr: with Adam's eps at 1e-3 such
a gradient moves nothing (with 1e-8 weights moved 4e-4 apart at stages 1 and 3 alike), and a BatchNorm over 3
rows has eps 1.0 (with 1e-5 it amplifies rounding ~300x). A gradient lost or counted twice moves a weight by
~lr (2e-2); a gathered weight off by 1e-4 in one element fails the first loss.

A block whose forward reads another module's weight and holds no parameter itself registers it
(``zk.register_external_parameter``): found on first use it would be gathered for the enclosing module, which
a checkpoint segment recomputed in backward does not run.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch import nn

import zero_kernels as zk
from tests.helpers.check import assert_close
from tests.helpers.dist import run_cases

D, ROWS, LR, WD = 5, 3, 2e-2, 0.1
EPS = 1e-3  # Adam's eps: a gradient at rounding level (a block whose output barely matters) moves nothing
SEEDS = (7, 28, 31, 40, 51, 12)  # together they draw every kind, container, wrapper, output type and knob value


@dataclasses.dataclass
class Out:
    h: torch.Tensor
    aux: tuple


def _wrap(h: torch.Tensor, fmt: str) -> Any:
    aux = h * 0.5
    return {"t": h, "tuple": (h, (aux,)), "dict": {"h": h, "aux": [aux]}, "dc": Out(h, (aux,))}[fmt]


def _unwrap(o: Any) -> tuple[torch.Tensor, list]:
    if isinstance(o, torch.Tensor):
        return o, []
    if isinstance(o, tuple):
        return o[0], list(o[1])
    if isinstance(o, dict):
        return o["h"], list(o["aux"])
    return o.h, list(o.aux)


class Block(nn.Module):
    """``core`` on ``lin`` (and more), its output wrapped as the call asks."""

    def __init__(self, kind: str, other: nn.Linear, rng: random.Random) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(D, D)
        if kind == "bn":
            self.bn = nn.BatchNorm1d(D, eps=1.0)  # over 3 rows a small eps amplifies rounding ~300x
        elif kind == "const":
            self.register_buffer("c", torch.randn(D))
        elif kind == "frozen":
            self.lin.requires_grad_(False)
        elif kind == "tied":
            self.lin.weight = other.weight
        elif kind == "seq":
            self.seq = nn.Sequential(nn.Sequential(nn.Linear(D, D), nn.Tanh()), nn.Linear(D, D))
        elif kind == "list":
            self.layers = nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D)])
        elif kind == "dict":
            self.d = nn.ModuleDict({"a": nn.Linear(D, D), "b": nn.Linear(D, D)})
        elif kind == "ponly":
            self.w = nn.Parameter(torch.randn(D))
        self.call_child = rng.random() < 0.5
        object.__setattr__(self, "other", other)  # read with F.linear, not a sub-module
        self.flip = False

    def forward(self, x: torch.Tensor, fmt: str = "t") -> Any:
        return _wrap(self.core(x), fmt)

    def core(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kind
        if k == "bn":
            return torch.tanh(self.bn(torch.tanh(self.lin(x))))
        if k == "const":
            return torch.tanh(self.lin(x) + self.c)
        if k == "parent":
            h = F.linear(x, self.lin.weight, self.lin.bias)
            return torch.tanh(h + self.lin(x) if self.call_child else h)
        if k == "func":
            return torch.tanh(self.lin(x) + F.linear(x, self.other.weight))
        if k == "seq":
            return torch.tanh(self.seq(self.lin(x)))
        if k in ("list", "dict"):
            layers = self.layers if k == "list" else [self.d[n] for n in (("b", "a") if self.flip else ("a", "b"))]
            h = self.lin(x)
            for layer in layers:
                h = torch.tanh(layer(h))
            return h
        if k == "ponly":
            return torch.tanh(self.lin(x) * self.w)
        return torch.tanh(self.lin(x))


KINDS = ("lin", "bn", "const", "parent", "func", "frozen", "tied", "seq", "list", "dict", "ponly")


class Root(nn.Module):
    """Blocks in a ModuleList, a ModuleDict or two Sequentials in a Sequential, a parameter, a head."""

    def __init__(self, blocks: list[Block], container: str) -> None:
        super().__init__()
        self.container = container
        if container == "list":
            self.blocks = nn.ModuleList(blocks)
        elif container == "dict":
            self.blocks = nn.ModuleDict({f"b{i}": b for i, b in enumerate(blocks)})
        else:
            half = max(1, len(blocks) // 2)
            self.blocks = nn.Sequential(nn.Sequential(*blocks[:half]), nn.Sequential(*blocks[half:]))
        self.scale = nn.Parameter(torch.rand(D) + 0.5)
        self.head = nn.Linear(D, 2)

    def blk(self, i: int) -> Block:
        if self.container == "list":
            return self.blocks[i]
        if self.container == "dict":
            return self.blocks[f"b{i}"]
        first = self.blocks[0]
        return first[i] if i < len(first) else self.blocks[1][i - len(first)]

    def segment(self, idxs: tuple, fmt: str):
        def run(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            aux = h.new_zeros(())
            for i in idxs:
                h, extra = _unwrap(self.blk(i)(h, fmt=fmt))
                for t in extra:
                    aux = aux + t.mean()
            return h, aux

        return run

    def forward(self, x: torch.Tensor, prog: list) -> dict:
        h, aux = x, x.new_zeros(())
        for op in prog:
            if op[0] == "rootread":  # the root reads a child's weight directly
                h = h * self.scale + 0.5 * F.linear(h, self.blk(op[1]).lin.weight)
            elif op[0] == "seqcall":
                h = torch.tanh(self.blocks[op[1]](h))
            else:
                h, aux = self._run(op, h, aux)
        return {"out": self.head(h * self.scale), "aux": aux}

    def _run(self, op: tuple, h: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, idxs, wrapper, fmt, residual = op
        run = self.segment(idxs, fmt)
        if wrapper in ("ck_re", "ck_nore"):
            o, a = tuc.checkpoint(run, h, use_reentrant=wrapper == "ck_re")
        elif wrapper == "nograd":
            with torch.no_grad():
                o, a = run(h)
        else:
            o, a = run(h)
        return (h + o if residual else o), aux + a


def build(seed: int) -> Root:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    blocks: list[Block] = []
    for _ in range(rng.randint(2, 6)):
        kind = rng.choice(KINDS)
        if kind in ("func", "tied") and not blocks:
            kind = "lin"
        blocks.append(Block(kind, rng.choice(blocks).lin if blocks else None, rng))
    return Root(blocks, rng.choice(["list", "dict", "seq"]))


def draw_prog(rng: random.Random, n: int, container: str, checkpoints: bool = True) -> list:
    prog = []
    for _ in range(rng.randint(1, 5)):
        r = rng.random()
        if r < 0.12:
            prog.append(("rootread", rng.randrange(n)))
        elif r < 0.2 and container == "seq":
            prog.append(("seqcall", rng.randrange(2)))
        else:
            idxs = tuple(rng.randrange(n) for _ in range(rng.randint(1, 2)))
            wrapper = rng.choice(["none", "none", "ck_re", "ck_nore", "nograd"]) if checkpoints else "none"
            fmt = rng.choice(["t", "tuple", "dict", "dc"])
            prog.append(("seg", idxs, wrapper, fmt, wrapper == "nograd" or rng.random() < 0.5))
    return prog


def draw_knobs(seed: int) -> tuple[dict, dict]:
    rng = random.Random(seed * 7 + 1)
    knobs = dict(
        reduce_bucket_size=rng.choice([7, 13, 1000]),
        overlap_comm=rng.random() < 0.5,
        stage3_prefetch_bucket_size=rng.choice([0, 7, 10**6]),
        stage3_param_persistence_threshold=rng.choice([0, 0, 6, 30]),
        stage3_max_live_parameters=rng.choice([1, 30, 10**9]),
    )
    plan = dict(
        steps=rng.randint(4, 6),
        micro=rng.randint(1, 2),
        accum=rng.choice(["no_sync", "gas"]),
        clip=rng.choice([None, None, 0.05, 1.0]),
        second=rng.random() < 0.3,
        eval_every=rng.choice([0, 0, 2]),
        eval_no_grad=rng.random() < 0.5,
        flip=rng.random() < 0.5,
    )
    return knobs, plan


def _data(seed: int, step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(ROWS, D, generator=torch.Generator().manual_seed(seed * 100003 + step * 101 + micro * 7 + rank))


def _loss(o: dict) -> torch.Tensor:
    return o["out"].square().mean() + 0.1 * o["aux"]


def _average_grads(ref: nn.Module, world: int) -> None:
    """What DDP does: every gradient averaged over the ranks (one that no rank has stays None)."""
    for p in ref.parameters():
        if not p.requires_grad:
            continue
        has = torch.tensor([float(p.grad is not None)])
        dist.all_reduce(has, op=dist.ReduceOp.MAX)
        if has.item():
            p.grad = (torch.zeros_like(p) if p.grad is None else p.grad) / world
            dist.all_reduce(p.grad)


def _close_weights(model: nn.Module, ref: nn.Module, what: str) -> None:
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert_close(p, r, rtol=1e-5, atol=2e-5, what=f"{what} {name}")
    for (name, b), (_, r) in zip(model.named_buffers(), ref.named_buffers()):
        if b.is_floating_point():
            assert_close(b, r, rtol=1e-5, atol=2e-5, what=f"{what} buffer {name}")


class Case:
    """One seed: the model under test and its reference, stepped and compared together."""

    def __init__(self, rank: int, world: int, seed: int) -> None:
        self.rank, self.world, self.seed = rank, world, seed
        self.model = build(seed)
        for block in self.model.modules():
            if isinstance(block, Block) and block.kind in ("parent", "func"):
                zk.register_external_parameter(
                    block, block.lin.weight if block.kind == "parent" else block.other.weight
                )
        self.knobs, self.plan = draw_knobs(seed)
        self.ref = copy.deepcopy(self.model)
        self.gas = self.plan["micro"] if self.plan["accum"] == "gas" else 1
        self.opt = zk.ShardedFusedAdam(
            self.model, lr=LR, eps=EPS, weight_decay=WD, stage=3, gradient_accumulation_steps=self.gas, **self.knobs
        )
        self.ropt = torch.optim.AdamW(
            [p for p in self.ref.parameters() if p.requires_grad], lr=LR, eps=EPS, weight_decay=WD
        )
        self.blocks = sum(isinstance(m, Block) for m in self.model.modules())
        self.container = self.model.container

    def forward_both(self, x: torch.Tensor, prog: list, what: str, rtol: float) -> tuple[torch.Tensor, torch.Tensor]:
        out, ref_out = self.model(x, prog), self.ref(x, prog)
        assert_close(_loss(out), _loss(ref_out), rtol=rtol, atol=rtol * 1e-2, what=f"{what} loss")
        return _loss(out), _loss(ref_out)

    def micro_step(self, step: int, micro: int, rng: random.Random) -> None:
        prog = draw_prog(rng, self.blocks, self.container)
        second = draw_prog(rng, self.blocks, self.container) if self.plan["second"] else None
        second_first = second is not None and rng.random() < 0.5
        x, what = _data(self.seed, step, micro, self.rank), f"seed {self.seed} step {step} micro {micro}"
        if second_first:  # an unused forward, before or after the one trained on
            self.forward_both(x, second, what + " unused", 1e-5)
        loss, ref_loss = self.forward_both(x, prog, what, 1.3e-6 if step == 0 else 1e-5)
        if second is not None and not second_first:
            self.forward_both(x, second, what + " unused", 1e-5)
        last, scale = micro == self.plan["micro"] - 1, 1.0 / self.plan["micro"]
        if self.gas > 1:
            loss.backward()
            if not (last and self.plan["clip"]):
                self.opt.step()
                self.opt.zero_grad()
        elif not last:
            with self.opt.no_sync():
                (loss * scale).backward()
        else:
            (loss * scale).backward()
        (ref_loss * scale).backward()

    def step(self, step: int) -> None:
        rng = random.Random(self.seed * 1009 + step)
        for m in list(self.model.modules()) + list(self.ref.modules()):
            if isinstance(m, Block):
                m.flip = self.plan["flip"] and step % 2 == 1
        for micro in range(self.plan["micro"]):
            self.micro_step(step, micro, rng)
        _average_grads(self.ref, self.world)
        what = f"seed {self.seed} step {step}"
        if self.plan["clip"]:
            norm = self.opt.clip_grad_norm_(self.plan["clip"])
            ref_params = [p for p in self.ref.parameters() if p.requires_grad]
            ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, self.plan["clip"])
            assert_close(norm, ref_norm, rtol=1e-5, what=f"{what} norm")
        if self.gas == 1 or self.plan["clip"]:
            self.opt.step()
            self.opt.zero_grad()
        self.ropt.step()
        self.ropt.zero_grad()
        with self.opt.gathered_params():
            _close_weights(self.model, self.ref, what)
        if self.plan["eval_every"] and step % self.plan["eval_every"] == 1:
            self.evaluate(step, rng)

    def evaluate(self, step: int, rng: random.Random) -> None:
        prog, x = draw_prog(rng, self.blocks, self.container, checkpoints=False), _data(self.seed, step, 99, self.rank)
        for m in (self.model, self.ref):
            m.eval()
        with torch.no_grad() if self.plan["eval_no_grad"] else torch.enable_grad():
            out, ref_out = self.model(x, prog)["out"], self.ref(x, prog)["out"]
        assert_close(out, ref_out, rtol=1e-5, atol=1e-6, what=f"seed {self.seed} step {step} evaluation")
        for m in (self.model, self.ref):
            m.train()


def _seed_case(rank: int, world: int, seed: int) -> None:
    case = Case(rank, world, seed)
    for step in range(case.plan["steps"]):
        case.step(step)


def _seeds(rank: int, world: int) -> None:
    run_cases(rank, world, [(f"seed {s}", _seed_case, (s,)) for s in SEEDS])


@pytest.mark.distributed
def test_random_structures_match_ddp_and_adamw(spawn) -> None:
    """Every seed's model and programs train at stage 3 on 2 ranks as DDP + AdamW, step by step."""
    spawn(_seeds, 2, timeout_s=60)
