"""``overlap_param_gather`` at stages 1-2: the step's parameter all-gathers finish where a parameter is first used.

Every rank's gathers are made late on purpose (``late_gathers``): the gathered values land in the
parameters only when the gather is waited for, so a read that does not wait sees the values from
before the step, every time, instead of whatever a fast loopback gather happened to deliver.
With that, each case trains next to single-process ``torch.optim.AdamW`` on the whole batch and
compares the loss of every forward and every parameter after the last step, element by element
(DESIGN.md's fp32 tolerances, as ``test_stages``): a tied weight (embedding and head), a parameter
used functionally in the root module's forward, a frozen module, clipping, gradient accumulation,
and the reads and writes a user makes between ``step()`` and the next forward.
"""

from __future__ import annotations

import copy
import tempfile
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero_kernels as zk
from tests.helpers.check import assert_close
from tests.helpers.dist import run_cases
from zero_kernels.config import ZeroOptions
from zero_kernels.stages.param_gather import is_pending

VOCAB, WIDTH, ROWS, SEQ = 11, 6, 2, 3
BUCKET = 13  # elements: many buckets, parameters straddling them
LR = 2e-2


class TiedNet(nn.Module):
    """Embedding tied to the head, ``scale`` read by this module's own forward, a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))
        self.body = nn.Linear(WIDTH, 9)
        self.out = nn.Linear(9, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx) * self.scale
        h = self.out(torch.tanh(self.body(h))) + self.frozen(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), idx.flatten())


class _Late:
    """A gather handle whose values reach the parameters only when it is waited for."""

    def __init__(self, handle: Any, output: torch.Tensor, staging: torch.Tensor) -> None:
        self.handle, self.output, self.staging = handle, output, staging

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.output.copy_(self.staging)
            self.handle = None

    def is_completed(self) -> bool:
        return self.handle is None


def late_gathers(opt: zk.ShardedFusedAdam) -> None:
    """Make the step's parameter all-gathers of ``opt`` land only when waited for."""
    engine = opt.pipeline.engine
    real = engine.all_gather

    def all_gather(output: torch.Tensor, input: torch.Tensor, *, name: str = "", **kwargs: Any) -> Any:
        if not name.startswith("params."):
            return real(output, input, name=name, **kwargs)
        staging = output.clone()
        return _Late(real(staging, input, name=name, **kwargs), output, staging)

    engine.all_gather = all_gather


def tokens(step: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (world * ROWS, SEQ), generator=g)


def mine(x: torch.Tensor, rank: int) -> torch.Tensor:
    return x[rank * ROWS : (rank + 1) * ROWS]


def setup(stage: int, **kwargs: Any) -> tuple[TiedNet, TiedNet, zk.ShardedFusedAdam, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = TiedNet()
    ref = copy.deepcopy(model)
    opt = zk.ShardedFusedAdam(
        model, lr=LR, stage=stage, reduce_bucket_size=BUCKET, overlap_param_gather=True, **kwargs
    )  # fmt: skip
    late_gathers(opt)
    return model, ref, opt, torch.optim.AdamW(ref.parameters(), lr=LR)


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.detach().abs().max().item()
    assert_close(actual, expected, rtol=1e-5, atol=1e-6 * scale, what=what)


def compare_params(model: nn.Module, ref: nn.Module, what: str) -> None:
    """Plain reads of every parameter (no explicit wait): the guard must make them current."""
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        close(p.detach(), r, f"{what} {name}")


def forward_both(model: TiedNet, ref: TiedNet, x: torch.Tensor, rank: int, what: str) -> torch.Tensor:
    """This rank's loss, checked against the reference model's loss on the same rows."""
    loss = model(mine(x, rank))
    with torch.no_grad():
        close(loss, ref(mine(x, rank)), f"{what}: loss")
    return loss


def train(rank: int, world: int, stage: int, *, accumulate: int = 1, clip: float = 0.0, steps: int = 4) -> None:
    """Train next to AdamW: ``accumulate`` micro-steps per update, clipping at ``clip`` (0: none)."""
    what = f"stage {stage} accumulate={accumulate} clip={clip}"
    model, ref, opt, ropt = setup(stage, gradient_accumulation_steps=accumulate, max_grad_norm=clip or None)
    pending_seen = False
    for step in range(steps):
        for micro in range(accumulate):
            x = tokens(step * accumulate + micro, world)
            forward_both(model, ref, x, rank, f"{what} step {step}.{micro}").backward()
            (ref(x) / accumulate).backward()
            opt.step()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
        pending_seen |= any(is_pending(p) for p in model.parameters())
    assert pending_seen, f"{what}: no parameter was left pending after a step"
    compare_params(model, ref, f"{what} after {steps} steps")
    assert opt.pipeline.gathers.in_flight == 0


def step_once(model: TiedNet, ref: TiedNet, opt: Any, ropt: Any, step: int, rank: int, world: int) -> None:
    x = tokens(step, world)
    forward_both(model, ref, x, rank, f"step {step}").backward()
    ref(x).backward()
    opt.step()
    ropt.step()
    opt.zero_grad()
    ropt.zero_grad()
    assert opt.pipeline.gathers.in_flight > 0, "the step waited for its all-gathers"


def reads(rank: int, world: int, stage: int) -> None:
    """Reads between the step and the next forward see the step's values, each kind on its own step."""
    model, ref, opt, ropt = setup(stage)
    ones = torch.ones(1, WIDTH)
    checks: list[Callable[[], None]] = [
        lambda: [close(p.data, r, "p.data") for p, r in zip(model.parameters(), ref.parameters())],
        lambda: [close(v, ref.state_dict()[k], f"model.state_dict() {k}") for k, v in model.state_dict().items()],
        lambda: [close(p.sum(), r.sum(), "p.sum()") for p, r in zip(model.parameters(), ref.parameters())],
        lambda: close(F.linear(ones, model.head.weight), F.linear(ones, ref.head.weight), "F.linear(x, tied weight)"),
        lambda: compare_params(copy.deepcopy(model), ref, "copy.deepcopy(model)"),
    ]
    for step, check in enumerate(checks):
        step_once(model, ref, opt, ropt, step, rank, world)
        check()
    compare_params(model, ref, f"stage {stage} reads")


def kept_alias(rank: int, world: int, stage: int) -> None:
    """A tensor taken from a parameter before the step is not guarded: ``opt.wait_params()`` makes it current."""
    model, ref, opt, ropt = setup(stage)
    kept = [p.data for p in model.parameters()]
    step_once(model, ref, opt, ropt, 0, rank, world)
    stale = any(not torch.equal(k, r) for k, r in zip(kept, ref.parameters()))
    assert stale, "a kept alias was current before wait_params(): the gathers did not stay in flight"
    opt.wait_params()
    assert not any(is_pending(p) for p in model.parameters())
    for k, r in zip(kept, ref.parameters()):
        close(k, r, "a kept p.data after opt.wait_params()")


def writes(rank: int, world: int, stage: int) -> None:
    """Writes between the step and the forward stick: the gathers in flight must not land over them."""
    model, ref, opt, ropt = setup(stage)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    step_once(model, ref, opt, ropt, 0, rank, world)
    model.load_state_dict(start)  # model.load_state_dict between step and forward
    ref.load_state_dict(start)
    step_once(model, ref, opt, ropt, 1, rank, world)
    with torch.no_grad():
        for p, r in zip(model.parameters(), ref.parameters()):  # in-place writes
            if p.requires_grad:
                p.mul_(0.5)
                r.mul_(0.5)
    step_once(model, ref, opt, ropt, 2, rank, world)
    compare_params(model, ref, f"stage {stage} writes")


def saves(rank: int, world: int, stage: int, folder: str) -> None:
    """State dicts and checkpoints taken between the step and the forward, loaded there too, resume exactly."""
    model, ref, opt, ropt = setup(stage)
    step_once(model, ref, opt, ropt, 0, rank, world)
    full = opt.full_state_dict()
    for index, r in enumerate(ref.parameters()):
        if r.requires_grad:
            close(full["state"][index]["exp_avg"], ropt.state[r]["exp_avg"], "full_state_dict exp_avg")
    zk.checkpoint.save(folder, model, opt)
    snapshot = (copy.deepcopy(ref), copy.deepcopy(ropt.state_dict()))
    sharded = opt.state_dict()
    step_once(model, ref, opt, ropt, 1, rank, world)
    zk.checkpoint.load(folder, model, opt)  # loaded while step 1's gathers are in flight
    ref.load_state_dict(snapshot[0].state_dict())
    ropt.load_state_dict(snapshot[1])
    compare_params(model, ref, "after checkpoint.load")
    opt.load_state_dict(sharded)
    step_once(model, ref, opt, ropt, 2, rank, world)
    with opt.gathered_params():
        compare_params(model, ref, "gathered_params() after the step")
    step_once(model, ref, opt, ropt, 3, rank, world)
    zk.save_pretrained(model, opt, folder + "/pretrained")
    if rank == 0:
        written = torch.load(folder + "/pretrained/model_state_dict.pt")
        for k, v in written.items():
            close(v, ref.state_dict()[k], f"save_pretrained {k}")


def matrix(rank: int, world: int, folder: str) -> None:
    for stage in (1, 2):
        train(rank, world, stage)
        train(rank, world, stage, accumulate=2, clip=0.05)
        reads(rank, world, stage)
        kept_alias(rank, world, stage)
        writes(rank, world, stage)
        saves(rank, world, stage, f"{folder}/stage{stage}")


def off_by_default(rank: int, world: int) -> None:
    for stage, overlap in ((1, None), (2, False), (0, True), (3, True)):
        torch.manual_seed(0)
        model = TiedNet()
        kwargs = {} if overlap is None else {"overlap_param_gather": overlap}
        opt = zk.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=BUCKET, **kwargs)
        model(tokens(0, world)[:ROWS]).backward()
        opt.step()
        what = f"stage {stage} overlap_param_gather={overlap}"
        assert opt.pipeline.gathers.in_flight == 0, what
        assert not any(is_pending(p) for p in model.parameters()), what


def cases(rank: int, world: int, folder: str) -> None:
    run_cases(rank, world, [("overlapped gathers", matrix, (folder,)), ("the step waits", off_by_default, ())])


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_overlapped_gather_matches_torch_adamw_and_the_step_waits_unless_asked(spawn, world: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        spawn(cases, world, folder)


def test_config_key() -> None:
    assert ZeroOptions.from_dict({"stage": 2, "overlap_param_gather": True}).overlap_param_gather is True
    assert ZeroOptions.from_dict({"stage": 2}).overlap_param_gather is False
    with pytest.raises(ValueError, match=r"zero_optimization\.overlap_param_gather.*true or false"):
        ZeroOptions.from_dict({"stage": 2, "overlap_param_gather": "yes"})


def test_one_rank_has_nothing_in_flight() -> None:
    model = TiedNet()
    config = {"optimizer": {"type": "AdamW", "params": {"lr": LR}}, "zero_optimization": {"stage": 2}}
    config["zero_optimization"]["overlap_param_gather"] = True
    model, opt = zk.initialize(model, config)
    assert opt.pipeline.gathers.enabled
    model(tokens(0, 1)).backward()
    opt.step()
    assert opt.pipeline.gathers.in_flight == 0
    assert not any(is_pending(p) for p in model.parameters())
