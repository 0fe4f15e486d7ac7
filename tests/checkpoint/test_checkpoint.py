"""Sharded checkpoints against an uninterrupted single-process ``torch.optim.AdamW`` run.

One reference run trains ``STEPS_BEFORE`` steps (snapshot A) then ``STEPS_AFTER`` more (snapshot
B) on the whole batch. The sharded runs train on ``1/world`` of the same batch per rank, so their
averaged gradients equal the reference's up to summation order (see tests/helpers/lockstep.py for the
tolerances). Checkpoints cross world sizes and stages:

- world 3, stage 2 saves after A; world 2 loads it at stage 3 and at stage 0, compares with A,
  continues to B (stage 3) and saves again (stage 3 and stage 0 writers at world 2);
- one process loads each of these at stages 0 and 1 and compares with A or B, and continues;
- the consolidated file loads into a plain model and ``torch.optim.AdamW`` and continues to B.

Every parameter, buffer and Adam state tensor (m, v, step) is compared element by element (``compare``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zero_kernels.checkpoint as ck
import zero_kernels.checkpoint.cli as consolidate_cli
import zero_kernels.checkpoint.inspect_cli as inspect_cli
import zero_kernels.optim as zo
from tests.helpers import lockstep
from tests.helpers.check import assert_close
from tests.helpers.dist import run_ranks, run_ranks_checked
from tests.helpers.paths import pythonpath
from zero_kernels.__main__ import main as cli
from zero_kernels.checkpoint.format import ShardReader

ROWS = 6  # global batch: divisible by world sizes 1, 2 and 3
STEPS_BEFORE, STEPS_AFTER = 3, 2
LR, WD = 2e-2, 0.1
BUCKET = 13  # elements: parameters straddle buckets and shards
RTOL = 1e-5

Snapshot = dict[str, dict[str, torch.Tensor]]


class Net(nn.Module):
    """Awkward sizes (77, 1, 60, 6), a frozen parameter and a buffer that forward updates."""

    def __init__(self, mid: int = 5) -> None:
        super().__init__()
        self.tiny = nn.Parameter(torch.tensor([1.3]))
        self.frozen = nn.Parameter(torch.randn(mid), requires_grad=False)
        self.register_buffer("calls", torch.zeros(()))
        self.emb = nn.Linear(6, 11)
        self.mid = nn.Linear(11, mid)
        self.head = nn.Linear(mid, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.tanh(self.emb(x)) * self.tiny
        h = torch.tanh(self.mid(h) + self.frozen)
        return self.head(h).square().mean()


def make_net(mid: int = 5) -> Net:
    torch.manual_seed(0)
    return Net(mid)


def batch(step: int) -> torch.Tensor:
    return torch.randn(ROWS, 6, generator=torch.Generator().manual_seed(100 + step))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int = 0, world: int = 1) -> None:
    per, dtype = ROWS // world, model.emb.weight.dtype
    for step in steps:
        model(batch(step)[rank * per : (rank + 1) * per].to(dtype)).backward()
        opt.step()
        opt.zero_grad()


def snapshot(model: nn.Module, state: dict[int, dict[str, torch.Tensor]]) -> Snapshot:
    """Model tensors by state_dict key; Adam state by parameter name (``model.parameters()`` order)."""
    names = [n for n, _ in model.named_parameters()]
    out: Snapshot = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    for index, entry in state.items():
        out[names[int(index)]] = {k: torch.as_tensor(v).detach().clone().float() for k, v in entry.items()}
    return out


def zk_snapshot(model: nn.Module, opt: zo.ShardedFusedAdam) -> Snapshot:
    state = opt.full_state_dict()["state"]
    with opt.gathered_params():
        return snapshot(model, state)


def compare(actual: Snapshot, expected: Snapshot, what: str) -> None:
    """Element by element: ``rtol`` plus an ``atol`` of ``RTOL`` x the largest magnitude of that kind of tensor
    (model tensors, m, v, step) over the model, for elements that cancel out (m near zero)."""
    assert actual.keys() == expected.keys(), f"{what}: tensors {sorted(actual)} != {sorted(expected)}"
    scale: dict[str, float] = {}
    for group in expected.values():
        for kind, e in group.items():
            kind = "model" if group is expected["model"] else kind
            scale[kind] = max(scale.get(kind, 0.0), float(e.abs().max()) if e.numel() else 0.0)
    for group in expected:
        assert actual[group].keys() == expected[group].keys(), f"{what} {group}: {actual[group].keys()}"
        for name, e in expected[group].items():
            atol = RTOL * scale["model" if group == "model" else name]
            assert_close(actual[group][name], e, rtol=RTOL, atol=atol, what=f"{what}: {group} {name}")


def reference() -> tuple[Snapshot, Snapshot]:
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    train(model, opt, range(STEPS_BEFORE))
    a = snapshot(model, opt.state_dict()["state"])
    train(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    return a, snapshot(model, opt.state_dict()["state"])


def zk_opt(model: nn.Module, stage: int, lr: float = LR, **zero: Any) -> zo.ShardedFusedAdam:
    """An optimizer to load into: a wrong ``lr`` checks that the saved hyper-parameters come back."""
    zero.setdefault("reduce_bucket_size", BUCKET)
    if stage == 3:
        zero.setdefault("stage3_param_persistence_threshold", 2)
    return zo.ShardedFusedAdam(model, lr=lr, weight_decay=WD, stage=stage, **zero)


# ---------------------------------------------------------------- rank functions
def _save_world3(rank: int, world: int, root: str) -> None:
    model = make_net()
    opt = zk_opt(model, stage=2)
    train(model, opt, range(STEPS_BEFORE), rank, world)
    ck.save(root, model, opt, extra={"step": STEPS_BEFORE, "note": "after A"})


def _load_world2(rank: int, world: int, root: str, roots: dict[str, str], a: Snapshot, b: Snapshot) -> None:
    model = make_net()
    opt = zk_opt(model, stage=3, lr=0.5)
    read = _count_reads()
    assert ck.load(root, model, opt) == {"step": STEPS_BEFORE, "note": "after A"}
    total = sum(p.stat().st_size for p in Path(root).glob("v*/rank*.bin"))
    assert sum(read) < 0.6 * total, f"rank {rank} of 2 at stage 3 read {sum(read)} of the {total} bytes saved"
    assert opt.param_groups[0]["lr"] == LR
    compare(zk_snapshot(model, opt), a, f"world 2 stage 3 rank {rank} loaded")
    train(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), rank, world)
    compare(zk_snapshot(model, opt), b, f"world 2 stage 3 rank {rank} continued")
    ck.save(roots["stage3"], model, opt)
    model0 = make_net()
    opt0 = zk_opt(model0, stage=0, reduce_bucket_size=7)
    ck.load(root, model0, opt0)
    compare(zk_snapshot(model0, opt0), a, f"world 2 stage 0 rank {rank} loaded")
    ck.save(roots["stage0"], model0, opt0)


def _count_reads() -> list[int]:
    """Record the size of every byte range read from a rank file from now on (in this process)."""
    sizes: list[int] = []
    read = ShardReader.read

    def counted(self: ShardReader, offset: int, n: int) -> bytes:
        sizes.append(n)
        return read(self, offset, n)

    ShardReader.read = counted
    return sizes


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference snapshots and the checkpoints of the sharded runs (two spawns in all)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    a, b = reference()
    roots = {"w3s2": str(tmp / "w3s2"), "stage3": str(tmp / "w2s3"), "stage0": str(tmp / "w2s0")}
    run_ranks(_save_world3, 3, roots["w3s2"])
    run_ranks(_load_world2, 2, roots["w3s2"], roots, a, b)
    return {"a": a, "b": b, "tmp": tmp, **roots}


# ---------------------------------------------------------------- tests
@pytest.mark.distributed
def test_any_world_size_and_stage_matches_an_uninterrupted_run(runs: dict[str, Any]) -> None:
    for stage in (0, 1):
        model = make_net()
        opt = zk_opt(model, stage=stage, lr=0.5)
        ck.load(runs["w3s2"], model, opt)
        compare(zk_snapshot(model, opt), runs["a"], f"world 3 stage 2 -> world 1 stage {stage}")
        train(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
        compare(zk_snapshot(model, opt), runs["b"], f"world 1 stage {stage} continued")
    for root, want in ((runs["stage3"], "b"), (runs["stage0"], "a")):
        model = make_net()
        opt = zk_opt(model, stage=1, reduce_bucket_size=1000)
        assert ck.load(root, model, opt) is None
        compare(zk_snapshot(model, opt), runs[want], f"{root} -> world 1 stage 1")


@pytest.mark.distributed
def test_each_rank_writes_only_its_part(runs: dict[str, Any]) -> None:
    version = Path(runs["w3s2"]) / "v000001"
    meta = json.loads((version / "metadata.json").read_text())
    assert (meta["world_size"], meta["stage"], len(meta["files"])) == (3, 2, 3)
    total = sum(4 * torch.Size(t["shape"]).numel() for t in meta["tensors"].values())
    sizes = [(version / f["name"]).stat().st_size for f in meta["files"]]
    assert sum(sizes) == total, f"the rank files hold {sum(sizes)} bytes, the tensors {total}: no duplicates"
    assert max(sizes) <= total / 3 + 4 * 13, f"rank files {sizes}: each about a third of {total}"
    sizes0 = [p.stat().st_size for p in (Path(runs["stage0"]) / "v000001").glob("rank*.bin")]
    assert len(sizes0) == 2 and max(sizes0) < 0.6 * sum(sizes0), f"stage 0 at world 2 writes halves: {sizes0}"


@pytest.mark.distributed  # the runs fixture spawns
def test_consolidated_file_continues_like_adamw(runs: dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    out = runs["tmp"] / "consolidated.pt"
    parser = argparse.ArgumentParser()
    consolidate_cli.add_arguments(parser)
    assert consolidate_cli.run(parser.parse_args([runs["w3s2"], str(out)])) == 0
    saved = torch.load(out, weights_only=True)
    model = Net()
    model.load_state_dict(saved["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    opt.load_state_dict(saved["optimizer"])
    assert opt.param_groups[0]["lr"] == LR and opt.param_groups[0]["weight_decay"] == WD
    compare(snapshot(model, opt.state_dict()["state"]), runs["a"], "consolidated")
    train(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    compare(snapshot(model, opt.state_dict()["state"]), runs["b"], "consolidated, continued with AdamW")

    parser = argparse.ArgumentParser()
    inspect_cli.add_arguments(parser)
    assert inspect_cli.run(parser.parse_args([runs["w3s2"], "--verify"])) == 0
    text = capsys.readouterr().out
    assert "stage 2 on 3 ranks" in text and "3 shard files" in text, text
    assert "mid.weight  (5, 11)  float32  3" in text and "frozen  (5,)  float32  -" in text, text
    assert "every checksum matches" in text, text


def test_inspect_counts_one_rank_and_one_file_in_the_singular(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = make_net()
    opt = zk_opt(model, stage=1)
    train(model, opt, range(1))
    ck.save(tmp_path, model, opt)
    parser = argparse.ArgumentParser()
    inspect_cli.add_arguments(parser)
    assert inspect_cli.run(parser.parse_args([str(tmp_path)])) == 0
    text = capsys.readouterr().out
    assert "saved by stage 1 on 1 rank\n1 shard file, " in text, text


def _trained_one_step() -> tuple[nn.Module, zo.ShardedFusedAdam, Snapshot]:
    model = make_net()
    opt = zk_opt(model, stage=1)
    train(model, opt, range(1))
    return model, opt, zk_snapshot(model, opt)


def _broken(runs: dict[str, Any], name: str, damage) -> Path:
    root = runs["tmp"] / f"broken-{name}"
    shutil.copytree(runs["w3s2"], root)
    damage(root / "v000001")
    return root


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _set_version(version: Path) -> None:
    meta = json.loads((version / "metadata.json").read_text())
    meta["version"] = 99
    (version / "metadata.json").write_text(json.dumps(meta))


@pytest.mark.distributed  # the runs fixture spawns
def test_bad_checkpoints_raise_and_change_nothing(runs: dict[str, Any]) -> None:
    cases = [
        ("missing", lambda v: (v / "rank00001.bin").unlink(), "rank00001.bin is missing"),
        ("truncated", lambda v: os.truncate(v / "rank00002.bin", 100), "truncated"),
        ("corrupted", lambda v: _flip_byte(v / "rank00000.bin", 150), "corrupted \\(checksum mismatch"),
        ("version", _set_version, "format version 99"),
        ("metadata", lambda v: (v / "metadata.json").write_text("{"), "metadata.json cannot be read"),
        ("extra", lambda v: _flip_byte(v / "extra.pt", 40), "extra.pt is truncated or corrupted"),
    ]
    model, opt, before = _trained_one_step()
    for name, damage, message in cases:
        with pytest.raises(ck.CheckpointError, match=message):
            ck.load(_broken(runs, name, damage), model, opt)
        compare(zk_snapshot(model, opt), before, f"after a failed load ({name})")
    with pytest.raises(ck.CheckpointError, match="'frozen' has shape \\(4,\\) here but \\(5,\\)"):
        other = make_net(mid=4)
        ck.load(runs["w3s2"], other, zk_opt(other, stage=1))
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        ck.load(runs["tmp"] / "nowhere", model, opt)
    compare(zk_snapshot(model, opt), before, "after failed loads")
    out = runs["tmp"] / "unused.pt"
    with pytest.raises(ck.CheckpointError, match="truncated"):
        ck.consolidate(_broken(runs, "consolidate", lambda v: os.truncate(v / "rank00000.bin", 8)), out)
    assert not out.exists() and not out.with_name("unused.pt.tmp").exists()


# ---------------------------------------------------------------- a save killed midway
def crash_save(root: str, kill_at: str) -> None:
    """Save after A, take one more step, then save again and die (``os._exit``) at ``kill_at``."""
    model = make_net()
    opt = zk_opt(model, stage=2)
    train(model, opt, range(STEPS_BEFORE))
    ck.save(root, model, opt)
    train(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + 1))
    publish = ck.sharded.publish  # save() and what it calls live in checkpoint/sharded.py

    def dying(tmp: Path, final: Path) -> None:
        if final.name == kill_at:
            os._exit(17)
        publish(tmp, final)

    ck.sharded.publish = dying
    ck.save(root, model, opt)


def _crash(root: Path, kill_at: str) -> subprocess.Popen:
    code = f"import tests.checkpoint.test_checkpoint as t; t.crash_save({str(root)!r}, {kill_at!r})"
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE)


def test_a_complete_version_latest_does_not_name_is_loaded_by_path_and_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A save killed after renaming its version into place and before naming it ``latest`` (that save never
    returned): loading the root takes the version ``latest`` names and a warning names the newer one, which loads
    by its path."""
    model = make_net()
    opt = zk_opt(model, stage=2)
    train(model, opt, range(STEPS_BEFORE))
    ck.save(tmp_path, model, opt)
    first = zk_snapshot(model, opt)
    train(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + 1))
    ck.save(tmp_path, model, opt)
    second = zk_snapshot(model, opt)
    (tmp_path / "latest").write_text("v000001")  # what the kill leaves: v000002 in place, latest not yet moved
    for where, want, warned in ((tmp_path, first, True), (tmp_path / "v000002", second, False)):
        caplog.clear()
        fresh = make_net()
        fresh_opt = zk_opt(fresh, stage=1, lr=0.5)
        with caplog.at_level("WARNING", logger="zero_kernels"):
            ck.load(where, fresh, fresh_opt)
        compare(zk_snapshot(fresh, fresh_opt), want, f"loaded from {where.name}")
        newer = [r.getMessage() for r in caplog.records if "v000002 beside it is complete but newer" in r.getMessage()]
        assert bool(newer) == warned, caplog.text
        assert not warned or str(tmp_path / "v000002") in newer[0]


@pytest.mark.distributed  # the runs fixture spawns
def test_save_killed_midway_leaves_the_previous_checkpoint(runs: dict[str, Any], tmp_path: Path) -> None:
    points = {"shard": "rank00000.bin", "rename": "v000002"}  # the shard file not renamed; the version not renamed
    procs = {name: _crash(tmp_path / name, kill_at) for name, kill_at in points.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 17, f"kill at {name}: exit status {proc.returncode}: {err.decode()[-2000:]}"
        root = tmp_path / name
        assert (root / "latest").read_text() == "v000001" and (root / ".tmp-v000002").is_dir()
        model = make_net()
        opt = zk_opt(model, stage=0, lr=0.5)
        ck.load(root, model, opt)
        compare(zk_snapshot(model, opt), runs["a"], f"previous checkpoint after a kill at {name}")
        with pytest.raises(ck.CheckpointError, match="a save that did not finish"):
            ck.load(root / ".tmp-v000002", model, opt)
        assert ck.save(root, model, opt).name == "v000003" and (root / "latest").read_text() == "v000003"
        again = make_net()
        opt_again = zk_opt(again, stage=1)
        ck.load(root, again, opt_again)
        compare(zk_snapshot(again, opt_again), runs["a"], f"a new save after a kill at {name}")


def test_bf16_parameters_keep_their_fp32_master(tmp_path: Path) -> None:
    """The fp32 master comes back: bf16 runs loaded at stages 0 and 2 continue bit for bit like the saved
    stage 1 run, and an fp32 model loads the master itself (rounding to the saved bf16 values)."""
    model = make_net().to(torch.bfloat16)
    opt = zk_opt(model, stage=1)
    train(model, opt, range(STEPS_BEFORE))
    ck.save(tmp_path, model, opt)
    fp32 = make_net()
    ck.load(tmp_path, fp32, zk_opt(fp32, stage=0))
    saved = dict(model.named_parameters())
    for name, p in fp32.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.to(torch.bfloat16), saved[name].detach()), name
    assert not all(torch.equal(p, saved[n].float()) for n, p in fp32.named_parameters()), "fp32 got the bf16 values"
    loaded = {stage: make_net().to(torch.bfloat16) for stage in (0, 2)}
    opts = {stage: zk_opt(m, stage=stage, lr=0.5) for stage, m in loaded.items()}
    for stage, m in loaded.items():
        ck.load(tmp_path, m, opts[stage])
        train(m, opts[stage], range(STEPS_BEFORE, STEPS_BEFORE + 2))
    train(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + 2))
    for stage, m in loaded.items():
        for name, p in m.named_parameters():
            assert torch.equal(p, saved[name]), f"bf16 loaded at stage {stage}: {name} differs after 2 steps"


def test_consolidate_writes_a_bf16_parameter_as_its_fp32_master(tmp_path: Path) -> None:
    """As DeepSpeed's ``zero_to_fp32.py``: the consolidated model holds a trained bf16 parameter's fp32 master,
    which rounds to the trained bf16 weight."""
    model = make_net().to(torch.bfloat16)
    opt = zk_opt(model, stage=1)
    train(model, opt, range(STEPS_BEFORE))
    ck.save(tmp_path / "ck", model, opt)
    out = torch.load(ck.consolidate(tmp_path / "ck", tmp_path / "out.pt"), weights_only=True)["model"]
    trained = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    for name, p in trained.items():
        assert out[name].dtype == torch.float32 and torch.equal(out[name].to(torch.bfloat16), p), name
    assert not all(torch.equal(out[name], p.float()) for name, p in trained.items()), "the bf16 values"


def test_a_checkpoint_of_the_other_weight_decay_mode_leaves_the_optimizers_own(tmp_path: Path) -> None:
    """Saved with ``adam_w_mode=False`` and loaded into an AdamW-mode optimizer: its groups keep their own
    ``decoupled_weight_decay`` (one mode for all groups: a group saying the other is refused at the step), and it
    steps."""
    model = make_net()
    opt = zk_opt(model, stage=1, adam_w_mode=False)
    train(model, opt, range(STEPS_BEFORE))
    ck.save(tmp_path, model, opt)
    other = make_net()
    other_opt = zk_opt(other, stage=1)
    ck.load(tmp_path, other, other_opt)
    assert all(group["decoupled_weight_decay"] is True for group in other_opt.param_groups)
    train(other, other_opt, range(STEPS_BEFORE, STEPS_BEFORE + 1))


def test_a_maximum_the_checkpoint_lacks_restarts_at_zero_in_an_optimizer_that_had_one(tmp_path: Path) -> None:
    """A checkpoint saved without AMSGrad loaded into an AMSGrad optimizer that trained already, then AMSGrad switched
    on again (the load gives the saved groups' ``amsgrad``): its maximum starts again from zeros, as in a new
    optimizer loading the same checkpoint (not from the maximum it had)."""
    model = make_net()
    opt = zk_opt(model, stage=1)
    train(model, opt, range(STEPS_BEFORE))
    ck.save(tmp_path, model, opt)
    fresh, used = make_net(), make_net()
    opts = {"fresh": zk_opt(fresh, stage=1, amsgrad=True), "used": zk_opt(used, stage=1, amsgrad=True)}
    train(used, opts["used"], range(STEPS_BEFORE, STEPS_BEFORE + 2))
    for m, o in ((fresh, opts["fresh"]), (used, opts["used"])):
        ck.load(tmp_path, m, o)
        for group in o.param_groups:
            group["amsgrad"] = True
        train(m, o, range(STEPS_BEFORE, STEPS_BEFORE + 2))
    for (name, p), q in zip(fresh.named_parameters(), used.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize(
    "saved_dtype, loaded_dtype", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)]
)
def test_another_low_precision_dtype_loads_the_fp32_master(
    tmp_path: Path, saved_dtype: torch.dtype, loaded_dtype: torch.dtype
) -> None:
    """bf16 saved, fp16 loaded (and the reverse): the parameters are the saved fp32 master rounded to the new
    dtype and the master stays the saved one, also once the optimizer reads it (a state dict, a step)."""
    model = make_net().to(saved_dtype)
    opt = zk_opt(model, stage=1)
    train(model, opt, range(STEPS_BEFORE))
    ck.save(tmp_path, model, opt)
    masters = {n: s["master"] for n, s in zk_snapshot(model, opt).items() if "master" in s}
    assert masters, "the saved run has no fp32 master"
    loaded = make_net().to(loaded_dtype)
    loaded_opt = zk_opt(loaded, stage=2)
    ck.load(tmp_path, loaded, loaded_opt)
    params = dict(loaded.named_parameters())
    for name, master in masters.items():
        assert torch.equal(params[name].detach(), master.view(params[name].shape).to(loaded_dtype)), name
    got = zk_snapshot(loaded, loaded_opt)
    for name, master in masters.items():
        assert torch.equal(got[name]["master"], master), f"{name}: the saved fp32 master was replaced"


def _batchnorm_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))


def _save_rank_local_buffers(rank: int, world: int, root: str) -> None:
    """Each rank's BatchNorm sees its own data (no buffer broadcast): the running statistics differ by rank."""
    model = _batchnorm_net()
    opt = zk_opt(model, stage=2)
    for step in range(STEPS_BEFORE):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * rank + step)) + 3 * rank
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    ck.save(root, model, opt)
    torch.save(model[1].state_dict(), Path(root) / f"buffers{rank}.pt")
    torch.distributed.barrier()
    loaded = _batchnorm_net()
    ck.load(root, loaded, zk_opt(loaded, stage=1))
    rank0 = torch.load(Path(root) / "buffers0.pt")
    for key, value in loaded[1].state_dict().items():
        assert torch.equal(value, rank0[key]), f"rank {rank} loaded {key} that is not rank 0's"


@pytest.mark.distributed
def test_buffers_that_differ_by_rank_are_saved_as_rank_0s(tmp_path: Path) -> None:
    """As DeepSpeed (the module of data-parallel rank 0) and ``zk.save_pretrained``: rank 0's buffers, whole, not
    a splice of every rank's piece; loaded at world 2 on every rank and at world 1."""
    run_ranks(_save_rank_local_buffers, 2, str(tmp_path))
    rank0, rank1 = (torch.load(tmp_path / f"buffers{r}.pt") for r in range(2))
    assert not torch.equal(rank0["running_mean"], rank1["running_mean"]), "the ranks' statistics are the same"
    loaded = _batchnorm_net()
    ck.load(tmp_path, loaded, zk_opt(loaded, stage=0))
    for key, value in loaded[1].state_dict().items():
        assert torch.equal(value, rank0[key]), f"world 1 loaded {key} that is not rank 0's"


def test_consolidate_into_a_directory_or_a_missing_one_is_a_command_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An existing directory as OUT (DeepSpeed's ``zero_to_fp32.py`` takes one), a missing parent directory, and a
    file that cannot be put in place: the command's ``error:`` line, exit status 2, and no ``OUT.tmp`` left."""
    model, opt, _ = _trained_one_step()
    ck.save(tmp_path / "ckpt", model, opt)
    (tmp_path / "out").mkdir()
    cases = {
        "out": "is a directory; give the file to write, such as",
        "missing/out.pt": "the directory of OUT .* does not exist",
        "replaced.pt": "cannot replace .*replaced.pt",
    }
    for out, pattern in cases.items():
        if out == "replaced.pt":
            monkeypatch.setattr(os, "replace", _refuse)
        assert cli(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / out)]) == 2, out
        err = capsys.readouterr().err
        assert re.search(f"^python -m zero_kernels consolidate: error: .*{pattern}", err), err
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["ckpt", "out"] and not any((tmp_path / "out").iterdir()), f"left behind: {left}"


def _refuse(src: Any, dst: Any) -> None:
    raise PermissionError(f"cannot replace {dst}")


FP16_SKIPS = dict(enabled=True, loss_scale=0, initial_scale_power=3, hysteresis=2)


def _fp16_linear(stage: int, skipped: int = 0) -> tuple[nn.Module, zo.ShardedFusedAdam]:
    torch.manual_seed(0)
    model = nn.Linear(5, 3).half()
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=5, fp16=FP16_SKIPS)
    opt.skipped_steps = skipped
    return model, opt


def _save_and_load_skips(rank: int, world: int, root: str) -> list[str]:
    """4 fp16 steps at stage 2, the 2nd and 3rd overflowing on the last rank only (skipped on every rank); saved,
    then loaded into a fresh optimizer on every rank."""
    model, opt = _fp16_linear(stage=2)
    for step in range(4):
        x = torch.randn(2, 5).half()
        if step in (1, 2) and rank == world - 1:
            x[0, 0] = float("inf")
        opt.backward(model(x).float().sum())
        opt.step()
        opt.zero_grad()
    ck.save(root, model, opt)
    model2, opt2 = _fp16_linear(stage=2, skipped=7)
    ck.load(root, model2, opt2)
    counts = (opt.skipped_steps, opt2.skipped_steps, opt2.applied_steps, opt2.loss_scale)
    return [] if counts == (2, 2, 0, opt.loss_scale) else [f"rank {rank}: (saved, loaded, applied, scale) {counts}"]


@pytest.mark.distributed
def test_skipped_steps_are_restored_at_any_world_size(tmp_path: Path) -> None:
    """As DeepSpeed's checkpoint: ``skipped_steps`` (the same on every rank) is saved and restored, on 2 ranks and
    into one process at another stage; a checkpoint saved before it was kept leaves the count as it is."""
    run_ranks_checked(_save_and_load_skips, 2, str(tmp_path))
    version = tmp_path / "v000001"
    meta = json.loads((version / "metadata.json").read_text())
    assert meta["skipped_steps"] == 2
    model, opt = _fp16_linear(stage=3, skipped=7)
    ck.load(tmp_path, model, opt)
    assert (opt.skipped_steps, opt.applied_steps) == (2, 0)
    scale = opt.loss_scale
    out = ck.consolidate(tmp_path, tmp_path / "whole.pt")  # the consolidated file carries them too
    model, opt = _fp16_linear(stage=2, skipped=7)
    opt.load_state_dict(torch.load(out, weights_only=True)["optimizer"])
    assert (opt.skipped_steps, opt.loss_scale) == (2, scale), "from the consolidated file"
    del meta["skipped_steps"]
    (version / "metadata.json").write_text(json.dumps(meta))
    model, opt = _fp16_linear(stage=1)
    ck.load(tmp_path, model, opt)
    assert opt.skipped_steps == 0 and opt.loss_scale == 4.0


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_the_consolidated_state_has_adamws_entries(tmp_path: Path, adam_w_mode: bool) -> None:
    """Two param groups, two steps in which ``extra`` (never called) had no gradient: the consolidated optimizer
    state has an entry for exactly the parameters ``torch.optim.AdamW``'s ``state_dict()`` has one for after the same
    steps (``torch.optim.Adam``'s with ``adam_w_mode=False``), each with its values element by element, and its
    param groups number the same parameters with the same hyper-parameters and decay mode (stage 2, one rank)."""
    model, ref = lockstep.make_models(torch.float32)
    groups = lockstep.two_groups(model)
    opt = zo.ShardedFusedAdam(groups, lr=lockstep.LR, stage=2, reduce_bucket_size=lockstep.BUCKET,
                              weight_decay=0.01, adam_w_mode=adam_w_mode)  # fmt: skip
    kind = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ropt = kind(lockstep.two_groups(ref), lr=lockstep.LR, weight_decay=0.01)
    for step in range(2):
        for m, o in ((model, opt), (ref, ropt)):
            o.zero_grad()
            m(lockstep.batch(step, lockstep.ROWS)).backward()
            o.step()
    ck.save(tmp_path / "ck", model, opt)
    got = torch.load(ck.consolidate(tmp_path / "ck", tmp_path / "out.pt"), weights_only=True)["optimizer"]
    expected = ropt.state_dict()
    assert sorted(got["state"]) == sorted(expected["state"])
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            scale = value.abs().max().item()
            assert_close(got["state"][index][key], value, rtol=1e-5, atol=1e-6 * scale, what=f"state {index} {key}")
    keys = ("params", "lr", "weight_decay", "decoupled_weight_decay")
    assert [{k: g[k] for k in keys} for g in got["param_groups"]] == [
        {k: g[k] for k in keys} for g in expected["param_groups"]
    ]
