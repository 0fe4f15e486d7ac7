"""``gathered_params(modifier_rank=k)``: rank ``k`` alone edits inside the block (DeepSpeed's
``GatheredParameters(params, modifier_rank=k)``, as Hugging Face's ``_init_weights`` writes it at ZeRO-3); after
the block every rank holds rank ``k``'s values, bit for bit, and training goes on as ``torch.optim.AdamW`` started
from them; in bf16 (fp32 masters, ZeRO++, frozen int8 units, offload) bit for bit as when every rank makes the edit."""

from __future__ import annotations

import contextlib
import logging
import re

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import run_cases
from tests.helpers.lockstep import STAGES, Net, compare, forward_backward, make_models, make_opt

CPU = {"device": "cpu"}
OFFLOADED = {"offload_optimizer": CPU, "offload_param": CPU}
CONFIGS = [(stage, {}) for stage in STAGES] + [(3, OFFLOADED)]
ZPP = {"zero_quantized_weights": True, "zero_quantized_nontrainable_weights": True}
LOW_CONFIGS = [(1, {}), (2, {"offload_optimizer": CPU}), (3, ZPP), (3, OFFLOADED)]


def init_weights(model: Net) -> None:
    """An ``_init_weights``-like edit: a new value for every parameter, the frozen one too, signed zeros included."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            p.view(-1)[0] = -0.0


class BlockFailed(Exception):
    """Raised on every rank inside the block, after rank 0's edit."""


def edit_on_rank_0(opt: torch.optim.Optimizer, model: Net, rank: int, raises: bool) -> None:
    """Rank 0 edits inside ``gathered_params(modifier_rank=0)``; ``raises``: then every rank raises in the block,
    and the error must come out of it."""
    with pytest.raises(BlockFailed) if raises else contextlib.nullcontext():
        with opt.gathered_params(modifier_rank=0):
            if rank == 0:
                init_weights(model)
            if raises:
                raise BlockFailed


def modifier_case(rank: int, world: int, stage: int, options: dict, raises: bool = False) -> None:
    what = f"stage {stage} {options or 'on device'}, world {world}{', the block raised' if raises else ''}"
    model, ref = make_models(torch.float32)
    opt = make_opt(model, stage, **options)
    adamw = torch.optim.AdamW(ref.parameters(), lr=opt.param_groups[0]["lr"])
    for step in range(4):
        if step == 1:
            edit_on_rank_0(opt, model, rank, raises)
            init_weights(ref)
            with opt.gathered_params():
                for (name, p), r in zip(model.named_parameters(), ref.parameters()):
                    bits = torch.equal(p.view(torch.int32), r.view(torch.int32))
                    assert bits, f"{what}: {name} on rank {rank} is not rank 0's value after the block"
        forward_backward(model, ref, rank, world, stage, step)
        for o in (opt, adamw):
            o.step()
            o.zero_grad()
        with opt.gathered_params():
            compare(model, ref, f"{what}, step {step}")


def low_precision_case(rank: int, world: int, stage: int, options: dict) -> None:
    """bf16: rank 0 alone edits (``modifier_rank=0``) against every rank editing, bit for bit, weights and state."""
    runs = []
    for modifier_rank in (0, None):
        model, _ = make_models(torch.bfloat16)
        runs.append((model, make_opt(model, stage, **options), modifier_rank))
    for step in range(3):
        for model, opt, modifier_rank in runs:
            if step == 1:
                with opt.gathered_params(modifier_rank=modifier_rank):
                    if rank == 0 or modifier_rank is None:
                        init_weights(model)
            forward_backward(model, Net(), rank, world, stage, step)
            opt.step()
            opt.zero_grad()
        (a, a_opt, _), (b, b_opt, _) = runs
        what = f"bf16 stage {stage} {options or 'on device'}, step {step}"
        with a_opt.gathered_params(), b_opt.gathered_params():
            for (name, p), q in zip(a.named_parameters(), b.parameters()):
                assert torch.equal(p, q), f"{what}: {name} differs from every rank making the edit"
        states = a_opt.full_state_dict()["state"], b_opt.full_state_dict()["state"]
        for index, kinds in states[1].items():
            for kind, value in kinds.items():
                assert torch.equal(states[0][index][kind], value), f"{what}: state {index} {kind} differs"


def all_modifier_cases(rank: int, world: int) -> None:
    cases = [(f"stage {s} {o}", modifier_case, (s, o)) for s, o in CONFIGS]
    cases += [(f"bf16 stage {s} {o}", low_precision_case, (s, o)) for s, o in LOW_CONFIGS]
    run_cases(rank, world, cases)


@pytest.mark.distributed
def test_the_modifier_ranks_edit_reaches_every_rank(spawn) -> None:
    spawn(all_modifier_cases, 2, timeout_s=300)


def all_raising_cases(rank: int, world: int) -> None:
    run_cases(rank, world, [(f"stage {s}, the block raised", modifier_case, (s, {}, True)) for s in STAGES])


@pytest.mark.distributed
def test_the_modifier_ranks_edit_reaches_every_rank_when_the_block_raised(spawn) -> None:
    """DeepSpeed's ``GatheredParameters.__exit__`` broadcasts whatever the exception: the ranks stay equal."""
    spawn(all_raising_cases, 2, timeout_s=300)


# (what rank 1, the modifier, does inside the block, the parameter the error names)
MISMATCHES = [
    ("shape", "parameter 'mid.weight'"),  # a parameter the optimizer holds, given another shape
    ("dtype", "parameter 'mid.weight'"),  # ... another dtype
    ("loose", "parameter 'frozen'"),  # the frozen parameter, outside the optimizer's buffers, given another shape
]


def _mismatched(model: Net, kind: str) -> None:
    if kind == "shape":
        model.mid.weight.data = torch.zeros(3, 11)
    elif kind == "dtype":
        model.mid.weight.data = model.mid.weight.data.double()
    else:
        model.frozen.data = torch.zeros(7)


def same_on_every_rank(model: Net, what: str) -> None:
    """Every parameter's bits are rank 0's."""
    for name, p in model.named_parameters():
        bits = p.detach().contiguous().view(torch.int32)
        seen = [torch.empty_like(bits) for _ in range(dist.get_world_size())]
        dist.all_gather(seen, bits)
        assert all(torch.equal(b, bits) for b in seen), f"{what}: {name} differs between the ranks"


def edit_in_place(model: Net) -> None:
    with torch.no_grad():
        model.emb.weight.add_(1.0)
        model.frozen.mul_(-2.0)


class ErrorRecords(logging.Handler):
    def __init__(self, level: int = logging.ERROR) -> None:
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def mismatch_case(rank: int, world: int, stage: int, kind: str, name: str, nesting: str = "") -> None:
    """Rank 1, the modifier, edits in place, then gives one parameter a ``.data`` the other ranks cannot receive:
    every rank raises naming the parameter, the replaced ``.data`` is put back, rank 1's in-place edits reach every
    rank, bit for bit, and training goes on in lock-step with ``torch.optim.AdamW`` given those edits. ``nesting``:
    "nested", the block inside a plain ``gathered_params()`` (stage 3 writes back at the outer block's end);
    "raises", the block raises its own error, which comes out of it, the mismatch logged at ERROR."""
    what = f"stage {stage}, rank 1 edited in place and changed {name}'s {kind} {nesting}"
    model, ref = make_models(torch.float32)
    opt = make_opt(model, stage)
    adamw = torch.optim.AdamW(ref.parameters(), lr=opt.param_groups[0]["lr"])
    expected = BlockFailed if nesting == "raises" else ValueError
    records = ErrorRecords()
    logging.getLogger("zero_kernels").addHandler(records)
    try:
        with opt.gathered_params() if nesting == "nested" else contextlib.nullcontext():
            with pytest.raises(expected) as error:
                with opt.gathered_params(modifier_rank=1):
                    if rank == 1:
                        edit_in_place(model)
                        _mismatched(model, kind)
                    if nesting == "raises":
                        raise BlockFailed
    finally:
        logging.getLogger("zero_kernels").removeHandler(records)
    message = records.messages[0] if nesting == "raises" and records.messages else str(error.value)
    assert re.search(rf"gathered_params\(modifier_rank=1\): {name} .*rank 1's values .* went to every rank", message), (
        f"{what}: {message}"
    )
    assert "rank 1" in message, f"{what}: the error names no rank: {message}"
    edit_in_place(ref)
    with opt.gathered_params():
        same_on_every_rank(model, f"{what}: after the refused block")
        compare(model, ref, f"{what}: after the refused block")
    for step in range(2):
        forward_backward(model, ref, rank, world, stage, step)
        for o in (opt, adamw):
            o.step()
            o.zero_grad()
        with opt.gathered_params():
            same_on_every_rank(model, f"{what}, step {step}")
            compare(model, ref, f"{what}, step {step}")


def all_mismatch_cases(rank: int, world: int) -> None:
    cases = [(f"stage {s} {kind}", mismatch_case, (s, kind, name)) for s in STAGES for kind, name in MISMATCHES]
    cases += [(f"stage {s} {n}", mismatch_case, (s, *MISMATCHES[0], n)) for s in (1, 3) for n in ("nested", "raises")]
    run_cases(rank, world, cases)


@pytest.mark.distributed
def test_a_modifier_edit_the_ranks_cannot_receive_raises_on_every_rank(spawn) -> None:
    """Once a hang in the broadcast: the ranks agree on shapes and dtypes first. Then rank 1's in-place edits reach
    every rank (once stage 0 kept them on rank 1 for good, stage 3 half of them when nested)."""
    spawn(all_mismatch_cases, 2, timeout_s=300)


def unnamed_case(rank: int, world: int, options: dict) -> None:
    """Stage 3 without ``modifier_rank``: the same edit on every rank says nothing; an edit on rank 0 alone, which
    leaves each shard with its own rank's values, is reported at WARNING on every rank, naming the parameter and
    ``modifier_rank``; values differing before a block that no rank edits in it say nothing."""
    model, _ = make_models(torch.float32)
    opt = make_opt(model, 3, **options)
    records = ErrorRecords(logging.WARNING)
    logging.getLogger("zero_kernels").addHandler(records)
    try:
        with opt.gathered_params():
            init_weights(model)
        assert not records.messages, records.messages
        with opt.gathered_params(), torch.no_grad():
            if rank == 0:
                model.mid.weight.mul_(2.0)
                model.head.bias.add_(1.0)  # persistent (whole on every rank)
        with opt.gathered_params():
            pass
    finally:
        logging.getLogger("zero_kernels").removeHandler(records)
    assert len(records.messages) == 1, records.messages
    assert re.search(r"different values of parameter '(mid\.weight|head\.bias)'.*modifier_rank=k", records.messages[0])


def all_unnamed_cases(rank: int, world: int) -> None:
    run_cases(rank, world, [(f"stage 3 {o}", unnamed_case, (o,)) for o in ({}, OFFLOADED)])


@pytest.mark.distributed
def test_an_edit_on_one_rank_without_modifier_rank_is_reported(spawn) -> None:
    spawn(all_unnamed_cases, 2, timeout_s=300)


@pytest.mark.parametrize("stage", (0, 3))
def test_a_modifier_rank_outside_the_group_is_refused(stage: int) -> None:
    model, _ = make_models(torch.float32)
    opt = make_opt(model, stage)
    with pytest.raises(ValueError, match=r"modifier_rank=1 is not a rank .* of 1 rank; allowed: None or 0\.\.0"):
        with opt.gathered_params(modifier_rank=1):
            pass
    with pytest.raises(TypeError, match="modifier_rank must be None or an int"):
        with opt.gathered_params(modifier_rank="0"):
            pass
