"""qwZ (``zero_quantized_weights``): a run resumed from ``full_state_dict()``, a consolidated ``state_dict()`` or
this rank's ``state_dict()`` shard, with the weights given inside ``gathered_params()`` before, after or with the
load, goes on bit for bit as the run that saved it. After a step each rank holds the other ranks' parts of the
parameters as the int8 all-gather left them (dequantized); the state dicts record which param groups a step had sent
so, and the load makes the new optimizer's copies the same, as ``zk.checkpoint.load`` does (inside the block they
stay exact until its end)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_kernels as zk
from tests.helpers.dist import run_ranks_checked

STEPS, SAVED = 4, 2


def _build(stage: int, dtype: torch.dtype, quantized: bool = True) -> tuple[nn.Module, zk.ShardedFusedAdam]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 3e-2}]
    return model, zk.ShardedFusedAdam(
        groups, module=model, lr=1e-2, stage=stage, reduce_bucket_size=64, zero_quantized_weights=quantized
    )


def _train(model: nn.Module, opt: zk.ShardedFusedAdam, steps: range, rank: int, dtype: torch.dtype) -> None:
    for step in steps:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank)).to(dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


def _weights(model: nn.Module, opt: zk.ShardedFusedAdam) -> dict[str, torch.Tensor]:
    with opt.gathered_params():
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def _inexact(model: nn.Module, weights: dict[str, torch.Tensor], what: str) -> list[str]:
    return [f"{what}: {name} not exact" for name, p in model.named_parameters() if not torch.equal(p, weights[name])]


def _resumed(rank: int, world: int, stage: int, dtype: torch.dtype) -> list[str]:
    model, opt = _build(stage, dtype)
    _train(model, opt, range(SAVED), rank, dtype)
    saved_weights, shard = _weights(model, opt), opt.state_dict()
    states = {"full_state_dict": opt.full_state_dict(), "state_dict": shard}
    opt.consolidate_state_dict(to=0)
    consolidated = [opt.state_dict() if rank == 0 else None]  # as rank 0 would write it for every rank to read
    dist.broadcast_object_list(consolidated, src=0)
    states["consolidated"] = consolidated[0]
    _train(model, opt, range(SAVED, STEPS), rank, dtype)
    expected = _weights(model, opt)
    found = []
    for kind, state in states.items():
        for order in ("weights first", "state first", "inside the block"):
            again, opt2 = _build(stage, dtype)
            if order == "state first":
                opt2.load_state_dict(state)
            with opt2.gathered_params():
                for name, p in again.named_parameters():
                    p.data.copy_(saved_weights[name])
                if order == "inside the block":
                    opt2.load_state_dict(state)
                    found += _inexact(again, saved_weights, f"stage {stage} {kind}: inside the block after the load")
            if order == "weights first":
                opt2.load_state_dict(state)
            _train(again, opt2, range(SAVED, STEPS), rank, dtype)
            for name, p in _weights(again, opt2).items():
                if not torch.equal(p, expected[name]):
                    error = (p.float() - expected[name].float()).abs().max().item()
                    found.append(f"stage {stage} {dtype} {kind} ({order}): {name} {error:.3g}")
    return found


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_state_dict_resume_with_quantized_weights_is_bit_for_bit(stage: int) -> None:
    run_ranks_checked(_resumed, 2, stage, torch.bfloat16 if stage == 2 else torch.float32)


def test_a_malformed_dequantized_record_is_refused_before_anything_loads() -> None:
    model, opt = _build(1, torch.float32)
    _train(model, opt, range(1), 0, torch.float32)
    saved = opt.state_dict()
    assert saved["zero_kernels.sharded"]["dequantized"] == []  # one rank: no quantized all-gather
    _, fresh = _build(1, torch.float32)
    for bad, message in ((True, " must be a list of param group indices"), ([0, 2], " names param group 2, of 2"),
                         ([-1], r"\[0\] must be an integer >= 0")):  # fmt: skip
        wrong = dict(saved, **{"zero_kernels.sharded": dict(saved["zero_kernels.sharded"], dequantized=bad)})
        with pytest.raises(ValueError, match=r"\['dequantized'\]" + message):
            fresh.load_state_dict(wrong)
        assert not fresh.state, "a refused load loaded some state"


def _record_of_a_run_without_qwz(rank: int, world: int) -> list[str]:
    model, opt = _build(1, torch.float32)
    _train(model, opt, range(SAVED), rank, torch.float32)
    full = opt.full_state_dict()
    again, plain = _build(1, torch.float32, quantized=False)
    plain.load_state_dict(full)
    records = {"loaded": plain.full_state_dict()["zero_kernels.sharded"]["dequantized"]}
    _train(again, plain, range(SAVED, STEPS), rank, torch.float32)
    records["after its steps"] = plain.state_dict()["zero_kernels.sharded"]["dequantized"]
    return [f"{when}: a run without qwZ records {record}" for when, record in records.items() if record != []]


@pytest.mark.distributed
def test_a_run_without_quantized_weights_records_no_dequantized_groups() -> None:
    """A run without qwZ holds every rank's parameters exact, also after loading the state of a run with it: its
    state dicts say so, for a run with qwZ that loads them to keep them exact."""
    run_ranks_checked(_record_of_a_run_without_qwz, 2)
