"""Random combinations of model, configuration and operations, run against DDP + ``torch.optim.AdamW``.

``draw(seed)`` picks a ``Case``: a model of 2-6 modules (Linear with or without bias, Embedding, LayerNorm,
Conv1d) of awkward sizes (1, 3, 17, 257 elements, a 0-size parameter), sometimes a tied weight, a frozen
parameter, a branch used on some micro-steps only (by step number, alike on every rank) and a layer added to the
optimizer later; a stage, small buckets, stage 3's gathering keys, accumulation (config, ``no_sync`` or plain
repeated backward), clipping, 1-3 param groups (lr, weight decay, betas, eps, amsgrad, maximize), fp32 or bf16;
and 4-8 operations: updates (with a clip by ``opt.clip_grad_norm_`` or torch's, ``zero_grad`` with either
``set_to_none``), an lr / weight-decay edit, a scheduler step, ``add_param_group`` once, a
``full_state_dict()`` -> new optimizer -> ``load_state_dict()`` round trip once.

``run_case(rank, world, case)`` trains it on gloo ranks next to DDP + AdamW, emulated in each rank's process (every
rank's gradients from its own rows, summed over micro-steps, averaged over ranks in the parameters' dtype; bf16:
AdamW on an fp32 master), and returns what differs: every parameter after every update (stage 3 inside
``gathered_params()``), the fp32 masters and the whole Adam state (``full_state_dict()``), element by element.
Weights and masters: lockstep's tolerances (1e-5 relative, 1e-6 of the tensor's scale) plus 1e-5 of the largest lr
per update (bf16: 2e-4, and two bf16 ulps for the bf16 weights). Moments: 1e-3 (bf16: 1e-2) of the gradients'
size, a check for gross errors (see ``Run._compare_state``).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import random
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

import zero_kernels as zk

ROWS = 2  # rows per rank per micro-step
LR_MAX = 3e-2  # the largest lr a group is given
KINDS = ("linear", "linear_nobias", "embedding", "layernorm", "conv1d")


@dataclass
class Case:
    seed: int
    width: int
    vocab: int
    kinds: list[str]
    zero_size: bool
    tied: bool
    frozen: Optional[str]  # name of a parameter frozen before the optimizer is built
    branch: bool  # a Linear used on every third micro-step only
    late: bool  # a Linear added with add_param_group
    groups: list[dict[str, Any]]  # hyper-parameters of each group
    assign: list[int]  # the group of each trainable parameter, in the model's order
    options: dict[str, Any]
    stage: int
    bf16: bool
    accumulation: int
    accumulate_by: str  # "config", "no_sync", "plain"
    clipping: float  # gradient_clipping / max_grad_norm, 0 off
    form: str  # "initialize" or "optimizer"
    ops: list[tuple] = field(default_factory=list)

    def summary(self) -> str:
        """One line: seed, stage, dtype, form, width, modules, extras (zero-size, tied, frozen, branch, late), groups,
        accumulation (count and c/n/p), clipping, then the operations (``u`` + clip + N: set_to_none, Z: zeros)."""
        flags = (self.zero_size, self.tied, self.frozen, self.branch, self.late)
        extras = "".join(c for c, on in zip("ztfbl", flags) if on)
        ops = " ".join(_op_name(op) for op in self.ops)
        precision = "bf16" if self.bf16 else "fp32"
        accumulation = f"acc{self.accumulation}{self.accumulate_by[0]}"
        return (
            f"seed {self.seed} s{self.stage} {precision} {self.form} h{self.width} [{','.join(self.kinds)}] "
            f"+{extras} g{len(self.groups)} {accumulation} clip{self.clipping} | {ops}"
        )


def _op_name(op: tuple) -> str:
    if op[0] != "update":
        return op[0]
    return f"u{op[1][0] if op[1] else ''}{'N' if op[2] else 'Z'}"


class Model(nn.Module):
    def __init__(self, case: Case) -> None:
        super().__init__()
        h, v = case.width, case.vocab
        self.kinds = case.kinds
        self.layers = nn.ModuleList(_layer(kind, h, v) for kind in case.kinds)
        self.zero = nn.Parameter(torch.zeros(0)) if case.zero_size else None
        self.branch = nn.Linear(h, h) if case.branch else None
        self.late = nn.Linear(h, h, bias=False) if case.late else None
        self.use_late = False
        embeddings = [m for m in self.layers if isinstance(m, nn.Embedding) and m.embedding_dim == h]
        self.head = nn.Linear(h, v if case.tied and embeddings else 1, bias=not case.tied)
        if case.tied and embeddings:
            self.head.weight = embeddings[0].weight

    def forward(self, x: torch.Tensor, ids: torch.Tensor, micro: int) -> torch.Tensor:
        h = x
        for kind, layer in zip(self.kinds, self.layers):
            if kind == "embedding":
                e = layer(ids % layer.num_embeddings)
                h = h + e if e.shape[-1] == h.shape[-1] else torch.tanh(h * (1 + e))  # LayerNorm undoes a scale
            elif kind == "conv1d":
                h = torch.tanh(layer(h.unsqueeze(1)).squeeze(1))  # a LayerNorm next would wash its bias out
            elif kind == "layernorm":
                h = layer(h)
            else:
                h = torch.tanh(layer(h))
        if self.zero is not None:
            h = h + self.zero.sum()
        if self.branch is not None and micro % 3 == 1:
            h = h + torch.tanh(self.branch(h))
        if self.late is not None and self.use_late:
            h = h + self.late(h)
        return self.head(h).square().mean()


def _layer(kind: str, h: int, v: int) -> nn.Module:
    if kind == "linear":
        return nn.Linear(h, h)
    if kind == "linear_nobias":
        return nn.Linear(h, h, bias=False)
    if kind == "embedding":
        return nn.Embedding(v, h) if v <= 64 else nn.Embedding(v, 1)  # 257 x 1
    if kind == "layernorm":
        return nn.LayerNorm(h)
    return nn.Conv1d(1, 1, 3, padding=1)


def draw(seed: int) -> Case:
    rnd = random.Random(seed)
    kinds = [rnd.choice(KINDS) for _ in range(rnd.randint(2, 6))]
    case = Case(
        seed=seed, width=rnd.choice((1, 3, 5, 17)), vocab=rnd.choice((3, 17, 257)), kinds=kinds,
        zero_size=rnd.random() < 0.4, tied=rnd.random() < 0.4, frozen=None, branch=rnd.random() < 0.5,
        late=rnd.random() < 0.4, groups=[], assign=[], options={}, stage=rnd.randint(0, 3),
        bf16=rnd.random() < 0.25, accumulation=rnd.randint(1, 3),
        accumulate_by=rnd.choice(("config", "no_sync", "plain")),
        clipping=rnd.choice((0.0, 0.0, 0.05, 1.0)), form=rnd.choice(("initialize", "optimizer")),
    )  # fmt: skip
    if case.width == 1:  # a LayerNorm of one element makes every gradient before it 0 (Adam amplifies the noise)
        kinds[:] = ["linear" if k == "layernorm" else k for k in kinds]
    if case.tied and "embedding" not in kinds:
        kinds.append("embedding")
    if case.tied:
        case.vocab = min(case.vocab, 17)
    names = [n for n, _ in _trainable(Model(case))]
    if rnd.random() < 0.4:
        case.frozen = rnd.choice([n for n in names if n != "head.weight" or not case.tied])
    trainable = [n for n in names if n != case.frozen]
    case.groups = [_group(rnd) for _ in range(rnd.randint(1, 3))]
    case.assign = [rnd.randrange(len(case.groups)) for _ in trainable]
    case.options = _options(rnd, case.stage)
    case.ops = _ops(rnd, case)
    return case


def _group(rnd: random.Random) -> dict[str, Any]:
    return dict(
        lr=rnd.choice((1e-3, 1e-2, 3e-2)), weight_decay=rnd.choice((0.0, 0.01, 0.1)),
        betas=rnd.choice(((0.9, 0.999), (0.8, 0.95), (0.5, 0.9))), eps=rnd.choice((1e-8, 1e-6, 1e-3)),
        amsgrad=rnd.random() < 0.3, maximize=rnd.random() < 0.2,
    )  # fmt: skip


def _options(rnd: random.Random, stage: int) -> dict[str, Any]:
    options = dict(
        reduce_bucket_size=rnd.randint(50, 5000), allgather_bucket_size=rnd.randint(50, 5000),
        overlap_comm=rnd.random() < 0.5, contiguous_gradients=rnd.random() < 0.5, reduce_scatter=rnd.random() < 0.5,
    )  # fmt: skip
    if stage == 3:
        options.update(
            stage3_prefetch_bucket_size=rnd.choice((0, 7, 50, 1000)),
            stage3_param_persistence_threshold=rnd.choice((0, 3, 20, 100000)),
            stage3_max_live_parameters=rnd.choice((0, 10, 1000, 1000000000)),
        )
    return options


def _ops(rnd: random.Random, case: Case) -> list[tuple]:
    ops: list[tuple] = []
    extra = ["edit", "sched", "roundtrip"] + (["add_group"] if case.late else [])
    for _ in range(rnd.randint(4, 8)):
        if extra and rnd.random() < 0.35:
            op = rnd.choice(extra)
            if op in ("roundtrip", "add_group"):
                extra.remove(op)
            ops.append((op,))
            continue
        clip = rnd.choice((None, None, ("opt", 0.05), ("torch", 0.05), ("opt", 10.0)))
        ops.append(("update", clip, rnd.random() < 0.5))
    if not any(op[0] == "update" for op in ops[-1:]):
        ops.append(("update", None, True))
    return ops


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    late = set() if model.late is None else {id(p) for p in model.late.parameters()}
    return [(n, p) for n, p in model.named_parameters() if id(p) not in late]


def make_groups(case: Case, model: Model) -> list[dict[str, Any]]:
    params = [p for n, p in _trainable(model) if n != case.frozen]
    groups = [dict(g, params=[]) for g in case.groups]
    for p, g in zip(params, case.assign):
        groups[g]["params"].append(p)
    return [g for g in groups if g["params"]]


def build_model(case: Case) -> Model:
    torch.manual_seed(case.seed)
    model = Model(case)
    if case.frozen is not None:
        dict(model.named_parameters())[case.frozen].requires_grad_(False)
    return model


def build_optimizer(case: Case, model: Model, groups: list[dict[str, Any]]) -> zk.ShardedFusedAdam:
    if case.form == "optimizer":
        if case.bf16:
            model.to(torch.bfloat16)
        extra = dict(gradient_accumulation_steps=case.accumulation) if case.accumulate_by == "config" else {}
        return zk.ShardedFusedAdam(groups, module=model, stage=case.stage, max_grad_norm=case.clipping,
                                   **extra, **case.options)  # fmt: skip
    config = {
        "zero_optimization": dict(stage=case.stage, **case.options),
        "gradient_clipping": case.clipping,
        "gradient_accumulation_steps": case.accumulation if case.accumulate_by == "config" else 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    if case.bf16:
        config["bf16"] = {"enabled": True}
    model_out, opt = zk.initialize(model, config, model_parameters=groups)
    assert model_out is model
    return opt


def batch(case: Case, update: int, micro: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed * 1000 + update * 10 + micro)
    x = torch.randn(rows, case.width, generator=g)
    return x, torch.randint(0, 1 << 20, (rows,), generator=g)


class Run:
    """The optimizer under test next to DDP + ``torch.optim.AdamW``, emulated in this process: each rank's gradients
    computed on its own rows, added up over micro-steps, then averaged over the ranks (in the parameters' dtype, as
    DDP reduces them); for bf16, AdamW steps an fp32 master (``shadow``) and the bf16 parameters are its rounding."""

    def __init__(self, rank: int, world: int, case: Case) -> None:
        self.rank, self.world, self.case = rank, world, case
        self.model = build_model(case)
        self.ref = copy.deepcopy(self.model).to(self.dtype())
        self.shadow = copy.deepcopy(self.ref).float() if case.bf16 else self.ref
        self.opt = build_optimizer(case, self.model, make_groups(case, self.model))
        self.ropt = torch.optim.AdamW(make_groups(case, self.shadow))
        self.scheds: list[Any] = []
        self.micro = 0  # micro-steps so far, all updates
        self.updates = 0
        self.worst = 0.0  # largest error / tolerance seen

    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.case.bf16 else torch.float32

    def update(self, clip: Optional[tuple[str, float]], set_to_none: bool) -> list[str]:
        case, k, found = self.case, self.case.accumulation, []
        sums: list[dict[str, torch.Tensor]] = [{} for _ in range(self.world)]
        norms = []
        for m in range(k):
            x, ids = batch(case, self.updates, m, self.world * ROWS)
            x = x.to(self.dtype())
            last = m == k - 1
            divide = 1 if case.accumulate_by == "config" else k
            lo, hi = self.rank * ROWS, (self.rank + 1) * ROWS
            local = self.model(x[lo:hi], ids[lo:hi], self.micro)
            sync = contextlib.nullcontext() if last or case.accumulate_by != "no_sync" else self.opt.no_sync()
            with sync:
                (local / divide).backward()
            for r in range(self.world):
                self._local_gradients(sums[r], x[r * ROWS : (r + 1) * ROWS], ids[r * ROWS : (r + 1) * ROWS], divide)
            self.micro += 1
            if last:
                self._reduce(sums, 1 if case.accumulate_by != "config" else k)
                if clip is not None:
                    norms = self._clip(*clip)
            if case.accumulate_by == "config" and not last:
                self.opt.step()
                self.opt.zero_grad(set_to_none=set_to_none)
        rtol = torch.finfo(torch.bfloat16).eps if case.bf16 else 1e-5  # torch's norm of bf16 gradients is bf16
        if norms and abs(norms[0] - norms[1]) > rtol * norms[1] + 1e-7:
            found.append(f"clip norm {norms[0]:.9g} vs torch {norms[1]:.9g}")
        if case.clipping:
            torch.nn.utils.clip_grad_norm_(self.shadow.parameters(), case.clipping)
        for opt in (self.opt, self.ropt):
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        if self.shadow is not self.ref:
            with torch.no_grad():
                for p, master in zip(self.ref.parameters(), self.shadow.parameters()):
                    p.copy_(master)
        self.updates += 1
        return found + self.compare(f"update {self.updates}")

    def _local_gradients(self, sums: dict[str, torch.Tensor], x: torch.Tensor, ids: torch.Tensor, divide: int) -> None:
        """One rank's backward: its gradients added into ``sums`` (in the parameters' dtype, as in ``p.grad``)."""
        named = [(n, p) for n, p in self.ref.named_parameters() if p.requires_grad]
        loss = self.ref(x, ids, self.micro) / divide
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        for (name, _), g in zip(named, grads):
            if g is not None:
                sums[name] = sums[name] + g if name in sums else g

    def _reduce(self, sums: list[dict[str, torch.Tensor]], divide: int) -> None:
        """DDP's all-reduce (sum, then divided by the world size) into the master's ``grad``; ``divide``: the
        optimizer's division of the accumulated sum at the step (``gradient_accumulation_steps``)."""
        for name, p in self.shadow.named_parameters():
            got = [s[name] for s in sums if name in s]
            if not got:
                continue
            total = got[0] if len(got) == 1 else got[0] + got[1] if len(got) == 2 else sum(got[1:], got[0])
            p.grad = (total / self.world).float() / divide

    def _clip(self, how: str, max_norm: float) -> list[float]:
        if how == "opt":
            ours = self.opt.clip_grad_norm_(max_norm)
        else:
            ours = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return [float(ours), float(torch.nn.utils.clip_grad_norm_(self.shadow.parameters(), max_norm))]

    def edit(self) -> None:
        for opt in (self.opt, self.ropt):
            for g in opt.param_groups:
                g["lr"] *= 0.7
                g["weight_decay"] = 0.05

    def sched(self) -> None:
        if not self.scheds:
            self.scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (self.opt, self.ropt)]
        for s in self.scheds:
            s.step()

    def add_group(self) -> None:
        for opt, model in ((self.opt, self.model), (self.ropt, self.shadow)):
            opt.add_param_group({"params": list(model.late.parameters()), "lr": 2e-2, "weight_decay": 0.0})
        for model in (self.model, self.ref, self.shadow):
            model.use_late = True

    def roundtrip(self) -> None:
        """full_state_dict() -> a new model and optimizer built alike, given the weights -> load_state_dict()."""
        full = self.opt.full_state_dict()
        holding = self.opt.gathered_params() if self.case.stage == 3 else contextlib.nullcontext()
        with holding:
            weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        sched = self.scheds[0].state_dict() if self.scheds else None
        late_groups = self.opt.param_groups[len(make_groups(self.case, self.model)) :]
        del self.opt
        gc.collect()
        model = build_model(self.case).to(self.dtype())
        model.load_state_dict(weights)
        model.use_late = self.model.use_late
        groups = make_groups(self.case, model)
        if late_groups:
            hyper = {k: v for k, v in late_groups[0].items() if k != "params"}
            groups.append(dict(hyper, params=list(model.late.parameters())))
        self.model = model
        self.shadow.zero_grad(set_to_none=True)  # the new model has no gradients
        self.opt = build_optimizer(self.case, model, groups)
        self.opt.load_state_dict(full)
        if sched is not None:
            self.scheds[0] = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
            self.scheds[0].load_state_dict(sched)

    def compare(self, what: str) -> list[str]:
        found = []
        full = self.opt.full_state_dict()
        holding = self.opt.gathered_params() if self.case.stage == 3 else contextlib.nullcontext()
        with holding:
            ours = {n: p.detach().float().clone() for n, p in self.model.named_parameters()}
        # Adam's step is ~lr whatever the weight: its rounding, summed; bf16: 20 times as much. Where several
        # synchronised backward passes make one bf16 step ("plain") the 16-bit sums round in another order than
        # here, and a clip of bf16 gradients scales them a little differently: such cases can exceed even that
        # (masters up to 3.7e-4 apart measured, after 1-2 updates at lr 3e-2); the test's seeds have none
        drift = (2e-4 if self.case.bf16 else 1e-5) * LR_MAX * self.updates
        for name, p in self.ref.named_parameters():
            ulp = 2 * torch.finfo(p.dtype).eps * p.detach().float().abs() if self.case.bf16 else 0.0
            found += self._close(ours[name], p.detach().float(), drift + ulp, f"{what} {name}")
        theirs = self.ropt.state_dict()
        if set(full["state"]) != set(theirs["state"]):
            found.append(f"{what}: state entries {sorted(full['state'])} vs AdamW's {sorted(theirs['state'])}")
        betas = {i: g["betas"] for g in theirs["param_groups"] for i in g["params"]}
        order = {i: p for i, p in enumerate(p for g in self.ropt.param_groups for p in g["params"])}
        for index in set(full["state"]) & set(theirs["state"]):
            mine = full["state"][index]
            found += self._compare_state(index, mine, theirs["state"][index], betas[index], what)
            if self.case.bf16:
                found += self._close(mine["master"], order[index].detach(), drift, f"{what} state[{index}] master")
        return found

    def _compare_state(self, index: int, mine: dict, ref: dict, betas: tuple, what: str) -> list[str]:
        found = []
        step = float(ref["step"])
        if float(mine["step"]) != step:
            found.append(f"{what} state[{index}] step {float(mine['step'])} vs {step}")
        # From the second update on, the gradients are taken at weights that differ by the rounding of the
        # step (DESIGN.md allows 1.3e-6 relative), which a gradient made of cancelling terms (an Embedding row
        # of a deep model) can amplify a thousandfold: the moments are checked at 1e-3 of the gradients' size
        # (the bias-corrected root of exp_avg_sq), a check for gross errors (a wrong beta, scale or clip)
        v = ref["exp_avg_sq"]
        rms = (v.max().item() / (1 - betas[1] ** step)) ** 0.5 if step and v.numel() else 0.0
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if (key in mine) != (key in ref):
                found.append(f"{what} state[{index}] {key} present {key in mine} vs {key in ref}")
            elif key in ref:
                rtol = 1e-2 if self.case.bf16 else 1e-3
                atol = rtol * rms * (1.0 if key == "exp_avg" else rms)
                found += self._close(mine[key].float(), ref[key], atol, f"{what} state[{index}] {key}", rtol)
        return found

    def _close(
        self, actual: torch.Tensor, expected: torch.Tensor, atol: Any, what: str, rtol: float = 1e-5
    ) -> list[str]:
        """Within ``rtol`` (lockstep's 1e-5) relative, plus 1e-6 of the tensor's largest magnitude, plus ``atol``."""
        if actual.shape != expected.shape:
            return [f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"]
        if actual.numel() == 0:
            return []
        err = (actual - expected).abs()
        bound = 1e-6 * expected.abs().max() + rtol * expected.abs() + atol
        ratios = err / bound.clamp_min(1e-30)
        ratio = ratios.max().item()
        ratio = float("inf") if ratio != ratio else ratio
        self.worst = max(self.worst, ratio)
        if ratio <= 1:
            return []
        i = int(ratios.flatten().argmax())
        return [f"{what}: error {err.flatten()[i].item():.3g} = {ratio:.3g} x tolerance (element {i}: "
                f"{actual.flatten()[i].item():.9g} vs {expected.flatten()[i].item():.9g})"]  # fmt: skip


def run_case(rank: int, world: int, case: Case) -> tuple[list[str], float]:
    """Train ``case`` on this rank next to the references; (what differed, the largest error / tolerance)."""
    run = Run(rank, world, case)
    found: list[str] = []
    for op in case.ops:
        if op[0] == "update":
            found += run.update(op[1], op[2])
        else:
            getattr(run, op[0])()
            if op[0] == "roundtrip":
                found += run.compare("after round trip")
        if found:
            break
    return found, run.worst
