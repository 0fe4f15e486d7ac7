"""Weights tied after the optimizer was built, in either direction, train as with ``torch.optim.AdamW``.

``model.head.weight = model.embed.weight`` and ``model.embed.weight = model.head.weight`` (nanoGPT's direction)
made after the optimizer was built both tie two parameters the optimizer holds: the one assigned trains with
both uses' gradients, the one replaced gets no gradient and is left alone, as ``torch.optim.AdamW`` does. The
second direction was refused at the first step ("no longer the Parameter the optimizer was built with"), the
name check taking the Parameter the optimizer holds under the other name for a new one. At stages 0-3 (stage 3
also with every parameter partitioned) on 2 and 3 gloo ranks, element by element against AdamW on the whole
batch (DESIGN.md's fp32 tolerances). A sharded checkpoint of such a run, which names every tensor by its model name,
is refused naming the parameter tied away (it said "a parameter of param group 0 (shape (0,))" at stage 3).

At stage 3 the tie changes which modules read the tied weight: the modules' plan is read again at the next forward,
as for a tie made before the optimizer was built. Where it was not, param groups that put the two modules' weights
in different buffers made the step refuse a "second gradient" of the weight, and a weight the root's forward read
(an external parameter) tied away made the next forward raise about a register_external_parameter call the user
never made.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
from torch import nn

import zero_kernels as zk
from tests.helpers.check import assert_close
from tests.helpers.dist import run_cases

VOCAB, WIDTH, ROWS, SEQ = 13, 7, 2, 3
BUCKET = 13  # elements: parameters straddle buckets and shards
LR = 2e-2


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(idx)))).logsumexp(-1).mean()


def tie_head_to_embed(m: LM) -> nn.Parameter:
    old = m.head.weight
    m.head.weight = m.embed.weight
    return old


def tie_embed_to_head(m: LM) -> nn.Parameter:
    old = m.embed.weight
    m.embed.weight = m.head.weight
    return old


def tokens(step: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(700 + step)
    return torch.randint(0, VOCAB, (world * ROWS, SEQ), generator=g)


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.detach().abs().max().item()
    assert_close(actual.detach(), expected.detach(), rtol=1e-5, atol=1e-6 * scale, what=what)


def tied_case(rank: int, world: int, stage: int, tie, extra: dict) -> None:
    torch.manual_seed(0)
    model = LM()
    ref = copy.deepcopy(model)
    opt = zk.ShardedFusedAdam(model, lr=LR, weight_decay=1e-2, stage=stage, reduce_bucket_size=BUCKET, **extra)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=1e-2)
    old, rold = tie(model), tie(ref)
    for step in range(3):
        x = tokens(step, world)
        model(x[rank * ROWS : (rank + 1) * ROWS]).backward()
        ref(x).backward()
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
        with opt.gathered_params():
            assert model.embed.weight is model.head.weight
            for (name, p), r in zip(model.named_parameters(), ref.parameters()):
                close(p, r, f"stage {stage} {tie.__name__} step {step} {name}")
            close(old, rold, f"stage {stage} {tie.__name__} step {step}: the parameter tied away")
    gone = "head" if tie is tie_head_to_embed else "embed"
    with tempfile.TemporaryDirectory() as folder:
        with pytest.raises(zk.checkpoint.CheckpointError, match=rf"'{gone}\.weight'.*shape \({VOCAB}, {WIDTH}\).*tied"):
            zk.checkpoint.save(folder, model, opt)


STAGE_CASES = [(0, {}), (1, {}), (2, {}), (3, {}), (3, {"stage3_param_persistence_threshold": 0})]


def cases(rank: int, world: int) -> None:
    run_cases(rank, world, [
        (f"stage {stage} {extra} {tie.__name__}", tied_case, (stage, tie, extra))
        for stage, extra in STAGE_CASES for tie in (tie_head_to_embed, tie_embed_to_head)
    ])  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_weights_tied_after_build_in_either_direction_match_adamw(spawn, world: int) -> None:
    spawn(cases, world)


def test_tie_after_build_one_rank() -> None:
    for stage, extra in STAGE_CASES:
        for tie in (tie_head_to_embed, tie_embed_to_head):
            tied_case(0, 1, stage, tie, extra)


class HeadRead(LM):
    """The root's forward reads the head's weight itself (``F.linear(h, self.head.weight)``): at stage 3 with every
    parameter partitioned the root gathers it as an external parameter (registered at its first use)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.embed(idx)))
        return torch.nn.functional.linear(h, self.head.weight).logsumexp(-1).mean()


def _tied_later(model_cls: type, tie, groups: bool, extra: dict) -> None:
    """Train a step, tie, train two more, next to AdamW (one process, stage 3)."""
    torch.manual_seed(0)
    model = model_cls()
    ref = copy.deepcopy(model)

    def split(m: nn.Module) -> list[dict]:
        rest = [m.mid.weight, m.mid.bias, m.head.weight]
        return [{"params": [m.embed.weight], "weight_decay": 0.3}, {"params": rest}]

    opt = zk.ShardedFusedAdam(split(model) if groups else model, module=model, lr=LR, weight_decay=1e-2, stage=3,
                              reduce_bucket_size=BUCKET, **extra)  # fmt: skip
    ropt = torch.optim.AdamW(split(ref) if groups else ref.parameters(), lr=LR, weight_decay=1e-2)
    for step in range(3):
        if step == 1:
            tie(model), tie(ref)
        x = tokens(step, 1)
        model(x).backward()
        ref(x).backward()
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    with opt.gathered_params():
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            close(p, r, f"{model_cls.__name__} {tie.__name__} groups={groups} {extra} {name}")


def test_tie_after_build_with_param_groups_at_stage3_kept_whole() -> None:
    """Small (kept-whole) parameters, groups that put the tied weight's two modules in different buffers: the
    tie changes which modules use ``head.weight``; the modules' plan was not re-read, and the step refused a
    'second gradient' of ``head.weight`` (no error where both sat in one buffer)."""
    for tie in (tie_embed_to_head, tie_head_to_embed):
        _tied_later(LM, tie, True, {})


def test_tie_after_build_of_a_weight_the_root_reads_at_stage3() -> None:
    """Every parameter partitioned, the head's weight read by the root's forward (an external parameter): tied away
    after build, the next forward raised "register_external_parameter: a parameter of shape (0,) registered on
    module '' (LM) is not a parameter of the model", a call the user never made."""
    for groups in (False, True):
        _tied_later(HeadRead, tie_head_to_embed, groups, {"stage3_param_persistence_threshold": 0})


class TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.b(torch.tanh(self.a(x))) ** 2).sum()


def test_tie_through_data_after_build_is_refused_naming_both() -> None:
    """``b.weight.data = a.weight.data`` after the optimizer was built (``torch.optim.AdamW`` then trains both
    Parameters on one storage) is refused at the next step, naming both, before anything changes, as at
    construction: the step copied ``a``'s values into ``b``'s slot and untied them without a word (0.03 off AdamW
    after 3 steps, every stage). Also across param groups (other buffers) and with the same tensor given to two."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    ties = {
        "b.data = a.data": lambda m: setattr(m.b.weight, "data", m.a.weight.data),
        "both given one tensor": lambda m: [setattr(p, "data", t) for t in [torch.randn(4, 4)] for p in m.parameters()],
    }
    for stage in (0, 1, 2):
        for groups in (False, True):
            for what, tie in ties.items():
                model = TwoLinear()
                params = [{"params": [model.a.weight]}, {"params": [model.b.weight]}] if groups else model
                opt = zk.ShardedFusedAdam(params, module=model, lr=LR, stage=stage)
                model(x).backward()
                opt.step()
                opt.zero_grad()
                tie(model)
                before = [p.detach().clone() for p in model.parameters()]
                model(x).backward()
                with pytest.raises(ValueError, match=r"parameter 'a\.weight' and parameter 'b\.weight' share memory"):
                    opt.step()
                for p, b in zip(model.parameters(), before):
                    assert torch.equal(p.detach(), b), f"stage {stage} groups={groups} {what}: a value changed"


def _swap(m: TwoLinear) -> None:
    m.a.weight.data, m.b.weight.data = m.b.weight.data, m.a.weight.data


def test_weights_swapped_through_data_after_build_match_adamw() -> None:
    """``a.data, b.data = b.data, a.data`` after the optimizer was built: each now views the other's slot, and the
    step's copy of ``a``'s values into its own slot overwrote what ``b`` viewed, so both trained from ``b``'s old
    values (0.6 off AdamW after one step at stages 0-2, no error). In one buffer and across param groups."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    for stage in (0, 1, 2, 3):
        for groups in (False, True):
            torch.manual_seed(0)
            model = TwoLinear()
            ref = copy.deepcopy(model)
            params = [{"params": [model.a.weight]}, {"params": [model.b.weight]}] if groups else model
            opt = zk.ShardedFusedAdam(params, module=model, lr=LR, stage=stage, stage3_param_persistence_threshold=0)
            ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
            for step in range(2):
                if step == 1:
                    with opt.gathered_params():
                        _swap(model)
                    _swap(ref)
                model(x).backward()
                ref(x).backward()
                opt.step()
                ropt.step()
                opt.zero_grad()
                ropt.zero_grad()
            with opt.gathered_params():
                for (name, p), r in zip(model.named_parameters(), ref.parameters()):
                    close(p, r, f"stage {stage} groups={groups} {name}")
