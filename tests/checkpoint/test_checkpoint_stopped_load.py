"""A checkpoint load that fails on one rank once it has begun writing (2 gloo ranks): every rank raises the same
``CheckpointError``, naming the rank and the file, and steps and saves are refused on every rank until a load
completes; the load repeated then leaves what a load that never failed leaves, bit for bit.

Where a tier keeps the state between steps (on disk, or split with the device by ``ratio``) its values are read from
the checkpoint's files again as they are written, one buffer at a time: a read that fails there (a file truncated or
removed since the check, an I/O error) stopped the load on that rank alone, after earlier buffers were written,
while the other ranks loaded; its ``OSError`` named no file, and the next step raised ``RanksDisagree`` (the Adam step
counts differ), or stepped on a state half loaded where the counts agreed. Any other failure there (a
``MemoryError``) did the same, and with ZeRO++'s quantized weights the ranks that completed waited in the
all-gather of the whole copies for the one that raised.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zero_kernels.checkpoint as ck
import zero_kernels.optim as zo
from tests.helpers.dist import run_ranks_checked
from zero_kernels.checkpoint import sharded
from zero_kernels.checkpoint.format import ShardReader

ROWS = 4
# (stage, where the state lives: "nvme" and "ratio" load it as it is read; "qwz": on the device, ZeRO++'s weights)
CASES = [(1, "nvme"), (2, "ratio"), (3, "nvme"), (1, "qwz")]


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 20), nn.Tanh(), nn.Linear(20, 4)).to(dtype)


def _built(stage: int, where: str, nvme: Path) -> tuple[nn.Module, zo.ShardedFusedAdam]:
    """A model and its optimizer; at stages 1-2 one param group per layer (a flat buffer each, as stage 3's
    units)."""
    model = _model(torch.float32 if where == "qwz" else torch.bfloat16)
    kw: dict[str, Any] = {"stage3_param_persistence_threshold": 0, "reduce_bucket_size": 128}
    if where == "nvme":
        nvme.mkdir(parents=True, exist_ok=True)
        kw.update(offload_optimizer={"device": "nvme", "nvme_path": str(nvme)}, sub_group_size=128)
    elif where == "ratio":
        kw["offload_optimizer"] = {"device": "cpu", "ratio": 0.5}
    else:
        kw["zero_quantized_weights"] = True
    params: Any = model if stage == 3 else [{"params": list(model[i].parameters())} for i in (0, 2, 4)]
    return model, zo.ShardedFusedAdam(params, lr=1e-2, stage=stage, **kw)


def _step(model: nn.Module, opt: zo.ShardedFusedAdam, step: int, rank: int, world: int) -> None:
    x = torch.randn(ROWS * world, 16, generator=torch.Generator().manual_seed(step))[rank * ROWS : (rank + 1) * ROWS]
    model(x.to(next(model.parameters()).dtype)).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model: nn.Module, opt: zo.ShardedFusedAdam) -> dict[str, torch.Tensor]:
    """Every parameter's value and state, whole (collectives)."""
    out = {f"{i}/{k}": t for i, e in opt.full_state_dict()["state"].items() for k, t in e.items()}
    with opt.gathered_params():
        out.update({name: p.detach().clone() for name, p in model.named_parameters()})
    return out


def _failing(rank: int, where: str) -> Any:
    """Patch this rank's load to fail once its second buffer is written: where the values are read as they are
    written, a read of the checkpoint's file (EIO), else a ``MemoryError``. Returns what puts it back."""
    apply, pread, move = sharded.BufferLoad.apply, ShardReader._pread, sharded._move
    applied: list[int] = []

    def counted(self: sharded.BufferLoad) -> None:
        applied.append(1)
        apply(self)

    def failing_read(self: ShardReader, offset: int, n: int) -> bytes:
        if len(applied) >= 2:
            raise OSError(5, "Input/output error")
        return pread(self, offset, n)

    def failing_move(dst: torch.Tensor, value: Any) -> None:
        if len(applied) >= 2:
            raise MemoryError("out of memory")
        move(dst, value)

    sharded.BufferLoad.apply = counted
    if rank == 1 and where == "qwz":
        sharded._move = failing_move
    elif rank == 1:
        ShardReader._pread = failing_read

    def restore() -> None:
        sharded.BufferLoad.apply, ShardReader._pread, sharded._move = apply, pread, move

    return restore


def _case(rank: int, world: int, stage: int, where: str, root: Path) -> list[str]:
    model, opt = _built(stage, where, root / f"nvme{rank}" / "source")
    for step in range(2):
        _step(model, opt, step, rank, world)
    ck.save(root / "ckpt", model, opt)
    runs = [_built(stage, where, root / f"nvme{rank}" / name) for name in ("clean", "failed")]
    for model, opt in runs:
        for step in range(3):
            _step(model, opt, step, rank, world)
    ck.load(root / "ckpt", *runs[0])
    model, opt = runs[1]
    problems = []
    restore = _failing(rank, where)
    try:
        ck.load(root / "ckpt", model, opt)
        problems.append("the load did not raise")
    except Exception as err:  # a rank that goes on from here alone would wait for the others
        named = "rank00001.bin failed: [Errno 5]" if where != "qwz" else "MemoryError: out of memory"
        if not str(err).startswith("rank 1: ") or named not in str(err) or "stopped part way" not in str(err):
            problems.append(f"unclear: {type(err).__name__}: {err}")
    finally:
        restore()
    if problems:
        return [f"stage {stage} {where}: {p}" for p in problems]
    try:
        _step(model, opt, 3, rank, world)
        problems.append("the step after it stepped")
    except RuntimeError as err:
        if "zk.checkpoint.load stopped part way (rank 1: " not in str(err):
            problems.append(f"the step raised: {err}")
    with pytest.raises(ck.CheckpointError, match="stopped part way.*nothing was written"):
        ck.save(root / "ckpt", model, opt)
    ck.load(root / "ckpt", model, opt)  # completes: steps resume
    for model, opt in runs:
        _step(model, opt, 3, rank, world)
    expected, got = (_snapshot(*run) for run in runs)
    problems += [
        f"{key} differs from a load that never failed" for key in expected if not torch.equal(got[key], expected[key])
    ]
    return [f"stage {stage} {where}: {p}" for p in problems]


def _body(rank: int, world: int, root: str) -> list[str]:
    problems = []
    for stage, where in CASES:
        problems += _case(rank, world, stage, where, Path(root) / f"{stage}{where}")
    return problems


@pytest.mark.distributed
def test_a_load_that_fails_on_one_rank_part_way_raises_on_every_rank_and_refuses_steps(tmp_path: Path) -> None:
    run_ranks_checked(_body, 2, str(tmp_path))
