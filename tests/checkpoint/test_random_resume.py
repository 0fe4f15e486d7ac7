"""Randomized resumes: a run interrupted at step k, saved one way (``zk.checkpoint``, ``full_state_dict()`` through
``torch.save``, ``consolidate_state_dict``), resumed at another stage and offload on 2 ranks, and from the sharded
checkpoint on 1 rank. Each draw (seeded) picks the model (odd sizes, tied or frozen weights), the param groups
(lr, weight decay, betas, AMSGrad), fp32 or bf16, clipping, accumulation and a scheduler. At the load every
parameter, every Adam state value, the step counts, the learning rates and the scheduler's state are the saved
ones bit for bit; the remaining steps give the weights and state of the run that loaded the saved state from
memory at the same config, and, where the layout is the saved one, of the uninterrupted run."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import zero_kernels as zk
from tests.helpers.dist import run_ranks_checked

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROWS = 4
STEPS = 4
SEEDS = range(8)


class Net(nn.Module):
    def __init__(self, draw: dict) -> None:
        super().__init__()
        d = draw["width"]
        self.emb = nn.Embedding(7, d)
        self.body = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 7, bias=False)
        if draw["tied"]:
            self.head.weight = self.emb.weight
        if draw["frozen"]:
            self.norm.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.head(self.norm(torch.tanh(self.body(self.emb(x))))).float() ** 2).mean()


def draw(seed: int) -> dict:
    r = random.Random(seed)
    betas = [(0.9, 0.999), (0.8, 0.95)]
    groups = [
        {"lr": r.choice([1e-2, 3e-2]), "weight_decay": r.choice([0.0, 0.1]), "betas": r.choice(betas),
         "amsgrad": r.random() < 0.4}
        for _ in range(r.randint(1, 2))
    ]  # fmt: skip
    stages = [(s, o) for s in range(4) for o in (["none"] if s == 0 else ["none", "cpu"])]
    return {
        "seed": seed,
        "width": r.choice([5, 9]),
        "tied": r.random() < 0.5,
        "frozen": r.random() < 0.5,
        "groups": groups,
        "bf16": r.random() < 0.5,
        "clip": r.random() < 0.5,
        "gas": r.choice([1, 2]),
        "sched": r.random() < 0.5,
        "method": ["zk", "full", "consolidated", "zk"][seed % 4],
        "k": r.randint(1, STEPS - 1),
        "A": r.choice(stages),
        "B": r.choice(stages),
        "one_rank": r.choice(stages),
    }


def build(d: dict, layout: tuple[int, str]) -> tuple[Net, Any, Any]:
    torch.manual_seed(d["seed"])
    model = Net(d)
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": trained[i :: len(d["groups"])], **g} for i, g in enumerate(d["groups"])]
    zero = {"stage": layout[0], "reduce_bucket_size": 24}
    if layout[1] != "none":
        zero["offload_optimizer"] = {"device": layout[1]}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": d["gas"], "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "bf16": {"enabled": d["bf16"]}}  # fmt: skip
    if d["clip"]:
        config["gradient_clipping"] = 0.05
    if d["sched"]:
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_min_lr": 0.0}}
    built = zk.initialize(model, config, model_parameters=groups)
    return built[0], built[1], built[2] if len(built) == 3 else None


def train(d: dict, run: tuple, steps: range, rank: int, world: int) -> None:
    model, opt, sched = run
    for micro in range(steps.start * d["gas"], steps.stop * d["gas"]):
        rows = torch.randint(0, 7, (ROWS, 3), generator=torch.Generator().manual_seed(1000 * d["seed"] + micro))
        model(rows[rank * ROWS // world : (rank + 1) * ROWS // world]).backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()


def snapshot(run: tuple) -> dict:
    model, opt, sched = run
    full = opt.full_state_dict()
    with opt.gathered_params():
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"params": params, "full": full, "lrs": [g["lr"] for g in opt.param_groups],
            "sched": None if sched is None else sched.state_dict()}  # fmt: skip


def differences(ours: dict, theirs: dict, what: str) -> list[str]:
    found = [f"{what}: {n}" for n, p in ours["params"].items() if not torch.equal(p, theirs["params"][n])]
    for index, entry in ours["full"]["state"].items():
        other = theirs["full"]["state"].get(index, {})
        if entry.keys() != other.keys():
            found.append(f"{what}: state[{index}] keys {sorted(entry)} against {sorted(other)}")
        found += [f"{what}: state[{index}][{key!r}]" for key, v in entry.items()
                  if key in other and not torch.equal(torch.as_tensor(v), torch.as_tensor(other[key]))]  # fmt: skip
    for key in ("lrs", "sched"):
        if ours[key] != theirs[key]:
            found.append(f"{what}: {key} {ours[key]} against {theirs[key]}")
    if ours["full"]["zero_kernels.sharded"] != theirs["full"]["zero_kernels.sharded"]:
        found.append(f"{what}: loss scale or skipped steps")
    return found


def save(d: dict, run: tuple, folder: Path, rank: int) -> None:
    model, opt, sched = run
    zk.checkpoint.save(folder / "ck", model, opt, scheduler=sched)
    if d["method"] == "full":
        state = opt.full_state_dict()
    elif d["method"] == "consolidated":
        opt.consolidate_state_dict(to=0)
        state = opt.state_dict()
    if d["method"] != "zk":
        with opt.gathered_params():  # where every parameter is whole and exact, at every stage
            weights = {k: v.clone() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save({"opt": state, "model": weights, "sched": sched and sched.state_dict()}, folder / "state.pt")
    torch.distributed.barrier()


def load(d: dict, run: tuple, folder: Path) -> None:
    model, opt, sched = run
    if d["method"] == "zk":
        zk.checkpoint.load(folder / "ck", model, opt, scheduler=sched)
        return
    saved = torch.load(folder / "state.pt", weights_only=False)
    with opt.gathered_params():
        model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    if sched is not None:
        sched.load_state_dict(saved["sched"])


def load_sharded(folder: Path, run: tuple) -> None:
    zk.checkpoint.load(folder, run[0], run[1], scheduler=run[2])


def load_from_memory(run: tuple, snap: dict) -> None:
    """The reference resume: the saved weights and ``full_state_dict()`` given from memory."""
    model, opt, sched = run
    with opt.gathered_params():
        for name, p in model.named_parameters():
            p.data.copy_(snap["params"][name])
    opt.load_state_dict(snap["full"])
    if sched is not None:
        sched.load_state_dict(snap["sched"])


def resumed(d: dict, layout: tuple, folder: Path, snap: dict, rank: int, world: int, how: Any) -> list[str]:
    """Resume at ``layout`` by ``how``: the differences at the load and after the remaining steps from the resume
    that loaded ``snap`` from memory."""
    run = build(d, layout)
    how(run)
    found = differences(snap["k"], snapshot(run), f"seed {d['seed']} at the load ({layout})")
    train(d, run, range(d["k"], STEPS), rank, world)
    reference = build(d, layout)
    load_from_memory(reference, snap["k"])
    train(d, reference, range(d["k"], STEPS), rank, world)
    return found + differences(snapshot(reference), snapshot(run), f"seed {d['seed']} resumed at {layout}")


def _two_ranks(rank: int, world: int, folders: list[str]) -> list[str]:
    found = []
    for seed, folder in zip(SEEDS, map(Path, folders)):
        d = draw(seed)
        run = build(d, d["A"])
        train(d, run, range(d["k"]), rank, world)
        snap = {"k": snapshot(run)}
        save(d, run, folder, rank)
        train(d, run, range(d["k"], STEPS), rank, world)
        snap["n"] = snapshot(run)
        if rank == 0:
            torch.save(snap["k"], folder / "snap.pt")
        found += resumed(d, d["B"], folder, snap, rank, world, lambda r: load(d, r, folder))
        again = build(d, d["A"])  # the saved layout: the uninterrupted run's weights and state
        load(d, again, folder)
        train(d, again, range(d["k"], STEPS), rank, world)
        found += differences(snap["n"], snapshot(again), f"seed {seed} against the uninterrupted run")
    return found


@pytest.mark.distributed
def test_random_resumes_continue_the_run(tmp_path: Path) -> None:
    folders = [tmp_path / str(seed) for seed in SEEDS]
    run_ranks_checked(_two_ranks, 2, [str(f) for f in folders], timeout_s=240)
    for seed, folder in zip(SEEDS, folders):  # the sharded checkpoint on one rank (no process group)
        d = draw(seed)
        snap = {"k": torch.load(folder / "snap.pt", weights_only=False)}
        found = resumed(d, d["one_rank"], folder, snap, 0, 1, lambda run, ck=folder / "ck": load_sharded(ck, run))
        assert not found, found
