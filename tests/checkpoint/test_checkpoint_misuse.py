"""Checkpoints used in ways that cannot work: each raises a clear error (or warns) and changes nothing.

- ``checkpoint.load`` inside stage 3's ``gathered_params()``: the block's end would write the values
  gathered before the load back over the loaded shards (the checkpoint's Adam state with the old weights).
  It raises on every rank before anything changes; loaded after the block, the model and the state are the
  checkpoint's, bit for bit (2 gloo ranks, fp32 and bf16 parameters). ``checkpoint.save`` there would save the
  weights from before the block's edits, which reach the shards at its end: it raises on every rank and writes
  nothing; saved after the block, the checkpoint holds the edits. The state dicts read there hold them.
- A checkpoint whose optimized parameters differ from the optimizer's (one frozen on one side only: fine-tuning
  from pretraining) names that parameter, not only the counts; a saved param group that holds no parameter (an
  imported DeepSpeed group of frozen parameters) missing from the optimizer is named, with the empty group to give.
- ``consolidate`` of a checkpoint saved inside a gradient accumulation window, which it cannot carry, warns
  naming the window (micro-step, ranks holding gradients); ``inspect`` shows the window.
- A folder that is not a checkpoint but holds one in a sub-folder (a Hugging Face Trainer ``checkpoint-N`` folder
  written by ``ZeroTrainer``, whose sharded checkpoint is ``checkpoint-N/zero_kernels``) is refused naming that
  sub-folder, by ``load``, ``consolidate`` and ``inspect`` alike; a root whose ``latest`` file is gone, naming its
  newest version (it named the oldest).
- A model holding tensors another stage-3 optimizer shards (a GAN's wrapper, each part with its own optimizer),
  saved or loaded with one of them: those tensors are empty here; refused naming one and what to save instead (the
  save failed inside with an error about reading a freed parameter's ``.data``, the load said the checkpoint came
  from another model); each part saved with its own module resumes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import zero_kernels.checkpoint as ck
import zero_kernels.optim as zo
from tests.helpers.dist import run_ranks_checked
from zero_kernels.__main__ import main as cli

ROWS = 4
Snapshot = dict[str, torch.Tensor]


def make_net(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 20), nn.Tanh(), nn.Linear(20, 5), nn.Tanh(), nn.Linear(5, 1)).to(dtype)


def make_opt(model: nn.Module, stage: int, lr: float = 1e-2) -> zo.ShardedFusedAdam:
    return zo.ShardedFusedAdam(
        model, lr=lr, weight_decay=0.1, stage=stage, reduce_bucket_size=30, stage3_param_persistence_threshold=4
    )


def train(model: nn.Module, opt: zo.ShardedFusedAdam, steps: range, rank: int, world: int) -> None:
    dtype = next(model.parameters()).dtype
    for step in steps:
        x = torch.randn(ROWS * world, 6, generator=torch.Generator().manual_seed(100 + step))
        model(x[rank * ROWS : (rank + 1) * ROWS].to(dtype)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


def snapshot(model: nn.Module, opt: zo.ShardedFusedAdam) -> Snapshot:
    """Every model tensor, Adam state entry (fp32 masters included) and the first group's lr."""
    out = {f"state {i} {k}": torch.as_tensor(v).clone() for i, e in opt.full_state_dict()["state"].items()
           for k, v in e.items()}  # fmt: skip
    with opt.gathered_params():
        out.update({k: v.detach().clone() for k, v in model.state_dict().items()})
    out["lr"] = torch.tensor(opt.param_groups[0]["lr"])
    return out


def differences(got: Snapshot, expected: Snapshot) -> list[str]:
    return [k for k in expected if k not in got or not torch.equal(got[k], expected[k])]


def _load_inside_gathered(rank: int, world: int, root: str, dtype: torch.dtype) -> list[str]:
    model = make_net(dtype)
    opt = make_opt(model, 3)
    train(model, opt, range(2), rank, world)
    ck.save(root, model, opt)
    saved = snapshot(model, opt)
    model = make_net(dtype)
    opt = make_opt(model, 3, lr=0.5)
    train(model, opt, range(1), rank, world)
    before = snapshot(model, opt)
    problems = []
    try:
        with opt.gathered_params():
            ck.load(root, model, opt)
        problems.append(f"{dtype}: load inside gathered_params() did not raise")
    except ck.CheckpointError as err:
        if "inside gathered_params()" not in str(err) or "nothing was changed" not in str(err):
            problems.append(f"{dtype}: unclear error: {err}")
    changed = differences(snapshot(model, opt), before)
    if changed:
        problems.append(f"{dtype}: the refused load changed {changed}")
    ck.load(root, model, opt)
    wrong = differences(snapshot(model, opt), saved)
    if wrong:
        problems.append(f"{dtype}: loaded after the block, these differ from the checkpoint: {wrong}")
    return problems


def _save_inside_gathered(rank: int, world: int, root: Path, dtype: torch.dtype) -> list[str]:
    """An edit made in the block reaches the shards only at its end: a save there is refused, writing nothing; a
    save after the block holds the edit."""
    model = make_net(dtype)
    opt = make_opt(model, 3)
    train(model, opt, range(1), rank, world)
    problems = []
    try:
        with opt.gathered_params():
            with torch.no_grad():
                model[0].weight.fill_(0.125)
            ck.save(root, model, opt)
        problems.append(f"{dtype}: save inside gathered_params() did not raise")
    except ck.CheckpointError as err:
        if "save was called inside gathered_params()" not in str(err) or "nothing was written" not in str(err):
            problems.append(f"{dtype}: unclear error: {err}")
    if root.exists():
        problems.append(f"{dtype}: the refused save left {sorted(p.name for p in root.iterdir())}")
    edited = snapshot(model, opt)
    if not torch.equal(edited["0.weight"], torch.full_like(edited["0.weight"], 0.125)):
        problems.append(f"{dtype}: the edit did not reach the model after the block")
    ck.save(root, model, opt)
    model = make_net(dtype)
    opt = make_opt(model, 3)
    ck.load(root, model, opt)
    wrong = differences(snapshot(model, opt), edited)
    if wrong:
        problems.append(f"{dtype}: saved after the block, these differ from the edited model: {wrong}")
    return problems


def _edited_master(opt: zo.ShardedFusedAdam, read: str, value: float) -> bool:
    state = opt.full_state_dict()["state"] if read == "full" else opt.state_dict()["state"]
    return torch.equal(state[0]["master"], torch.full_like(state[0]["master"], value))


def _state_read_inside_gathered(rank: int, world: int) -> list[str]:
    """Unlike a save, the state dicts read the block's edits (``live_param_shard``): the bf16 parameter's fp32
    master, in the full and the consolidated state, is the edit inside the block; this rank's shard (by buffer)
    is already what it is after the block."""
    model = make_net(torch.bfloat16)
    opt = make_opt(model, 3)
    train(model, opt, range(1), rank, world)
    problems = []
    with opt.gathered_params():
        with torch.no_grad():
            model[0].weight.fill_(0.125)
        shard = opt.state_dict()["state"]
        if not _edited_master(opt, "full", 0.125):
            problems.append("inside gathered_params(), full_state_dict() misses the block's edit")
    after = opt.state_dict()["state"]
    if any(not torch.equal(v, after[i][k]) for i, e in shard.items() for k, v in e.items()):
        problems.append("inside gathered_params(), state_dict() differs from after the block")
    with opt.gathered_params():
        with torch.no_grad():
            model[0].weight.fill_(0.25)
        opt.consolidate_state_dict(0)
        if rank == 0 and not _edited_master(opt, "consolidated", 0.25):
            problems.append("inside gathered_params(), consolidate_state_dict() misses the block's edit")
    return problems


def _gathered_body(rank: int, world: int, tmp: str) -> list[str]:
    problems = _state_read_inside_gathered(rank, world)
    for dtype in (torch.float32, torch.bfloat16):
        problems += _load_inside_gathered(rank, world, f"{tmp}/{dtype}", dtype)
        problems += _save_inside_gathered(rank, world, Path(tmp) / f"saved inside {dtype}", dtype)
    return problems


@pytest.mark.distributed
def test_load_or_save_inside_gathered_params_raises_on_every_rank_and_changes_nothing(tmp_path: Path) -> None:
    """Stage 3, 2 ranks, fp32 and bf16 parameters."""
    run_ranks_checked(_gathered_body, 2, str(tmp_path), timeout_s=300)


def _frozen(name: str) -> tuple[nn.Module, zo.ShardedFusedAdam]:
    model = make_net()
    if name:
        model.get_parameter(name).requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    return model, zo.ShardedFusedAdam(params, module=model, lr=1e-2, stage=2, reduce_bucket_size=30)


@pytest.mark.parametrize(
    ("saved", "loading", "pattern"),
    [
        ("", "2.weight", r"parameter '2.weight' is in param group 0 in .* but not optimized here \(frozen"),
        ("2.weight", "", r"parameter '2.weight' is in param group 0 here but not optimized in "),
    ],
    ids=["frozen-when-loading", "frozen-when-saved"],
)
def test_another_trainable_set_names_the_parameter(tmp_path: Path, saved: str, loading: str, pattern: str) -> None:
    model, opt = _frozen(saved)
    train(model, opt, range(2), 0, 1)
    ck.save(tmp_path, model, opt)
    model, opt = _frozen(loading)
    train(model, opt, range(1), 0, 1)
    before = snapshot(model, opt)
    with pytest.raises(ck.CheckpointError, match=pattern):
        ck.load(tmp_path, model, opt)
    assert not differences(snapshot(model, opt), before), "a refused load changed the model or the optimizer"


def _saved_mid_window(root: Path, micro: int) -> None:
    """One step of three micro-batches, then ``micro`` micro-batches of the next (0: at the step boundary)."""
    model = make_net()
    opt = zo.ShardedFusedAdam(model, lr=1e-2, stage=2, reduce_bucket_size=30, gradient_accumulation_steps=3)
    for m in range(3 + micro):
        model(torch.randn(ROWS, 6, generator=torch.Generator().manual_seed(m))).square().mean().backward()
        opt.step()
    ck.save(root, model, opt)


@pytest.mark.parametrize("first", [False, True])
def test_a_saved_param_group_with_no_parameter_is_named(tmp_path: Path, first: bool) -> None:
    """A checkpoint with a param group that holds no parameter (a DeepSpeed run's group of frozen biases, imported:
    import-deepspeed keeps it) loaded by an optimizer without that group was refused with the counts alone ('2 param
    groups with 2 parameters; this optimizer has 1 with 2'), or, the empty group first, with the first parameter's
    group index alone; either names the empty group and what to give."""

    def make(empty: bool) -> tuple[nn.Module, zo.ShardedFusedAdam]:
        model = make_net()
        weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith("weight"))
        groups = [{"params": weights}]
        if empty:
            groups.insert(0 if first else 1, {"params": []})
        return model, zo.ShardedFusedAdam(groups, module=model, lr=1e-2, stage=2)

    model, opt = make(empty=True)
    model(torch.randn(3, 6)).square().mean().backward()
    opt.step()
    ck.save(tmp_path, model, opt)
    model, opt = make(empty=False)
    hint = rf"param group {0 if first else 1} there holds no parameter.*\{{'params': \[\]\}}"
    with pytest.raises(ck.CheckpointError, match=hint):
        ck.load(tmp_path, model, opt)


@pytest.mark.parametrize("micro", [0, 1])
def test_consolidate_and_inspect_show_a_window_they_cannot_carry(
    tmp_path: Path, micro: int, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture
) -> None:
    _saved_mid_window(tmp_path / "ckpt", micro)
    caplog.clear()  # the save's own warning of a window
    with caplog.at_level("WARNING", logger="zero_kernels"):
        assert cli(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out.pt")]) == 0
    assert cli(["inspect", str(tmp_path / "ckpt")]) == 0
    shown = capsys.readouterr().out
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if micro == 0:
        assert not warnings, warnings
        assert "accumulation window: none (saved at a step boundary)" in shown, shown
        return
    window = "open at micro-step 1 of the step; 1 rank of 1 held gradients of its earlier backward passes"
    assert len(warnings) == 1 and f"accumulation window ({window}); those gradients are not in" in warnings[0], warnings
    assert f"accumulation window: {window}" in shown, shown


def test_loading_without_an_optimizer_says_how_to_load_the_weights_alone(tmp_path: Path) -> None:
    """``ck.load(dir, model, None)`` (DeepSpeed's ``load_module_only``) is refused, naming consolidate; doing what
    the message says gives the saved weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    opt = zo.ShardedFusedAdam(model, lr=1e-2, stage=2)
    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    ck.save(tmp_path / "ckpt", model, opt)
    fresh = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    with pytest.raises(TypeError, match=r"got NoneType. For the model's weights alone: zk.checkpoint.consolidate"):
        ck.load(tmp_path / "ckpt", fresh, None)
    ck.consolidate(tmp_path / "ckpt", tmp_path / "out.pt")
    fresh.load_state_dict(torch.load(tmp_path / "out.pt")["model"])
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_a_folder_holding_a_checkpoint_names_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A Trainer checkpoint folder (``ZeroTrainer`` writes the sharded checkpoint into its ``zero_kernels``
    sub-folder) given where the checkpoint is expected: the error names the sub-folder to pass."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    opt = zo.ShardedFusedAdam(model, lr=1e-2, stage=1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    folder = tmp_path / "checkpoint-10"
    ck.save(folder / "zero_kernels", model, opt)
    inner = str(folder / "zero_kernels")
    with pytest.raises(ck.CheckpointError, match="not a checkpoint") as raised:
        ck.load(folder, model, opt)
    assert f"pass {inner}" in str(raised.value)
    assert cli(["consolidate", str(folder), str(tmp_path / "out.pt")]) == 2
    assert cli(["inspect", str(folder)]) == 2
    assert capsys.readouterr().err.count(f"pass {inner}") == 2
    ck.consolidate(inner, tmp_path / "out.pt")  # what the message says works


def test_a_root_without_its_latest_file_names_its_newest_version(tmp_path: Path) -> None:
    """A root whose ``latest`` file is gone (copied without it) holds complete versions: the error names the newest
    one, not the oldest (following it resumed from two steps before the last save)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    opt = zo.ShardedFusedAdam(model, lr=1e-2, stage=1)
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        ck.save(tmp_path, model, opt)
    (tmp_path / "latest").unlink()
    with pytest.raises(ck.CheckpointError, match="not a checkpoint") as raised:
        ck.load(tmp_path, model, opt)
    assert f"pass the newest, {tmp_path / 'v000003'}" in str(raised.value)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_checkpoint_of_the_other_decay_mode_loads_with_a_warning_and_trains(
    tmp_path: Path, stage: int, caplog: pytest.LogCaptureFixture
) -> None:
    """An Adam-mode (L2) checkpoint loaded into an AdamW-mode optimizer keeps the optimizer's mode, as
    ``load_state_dict`` does, with its WARNING; the groups took the saved ``decoupled_weight_decay``, and every step
    after the load raised."""
    model = make_net()
    adam = zo.ShardedFusedAdam(model, lr=1e-2, weight_decay=0.1, stage=stage, adam_w_mode=False,
                               reduce_bucket_size=30, stage3_param_persistence_threshold=4)  # fmt: skip
    train(model, adam, range(2), 0, 1)
    ck.save(tmp_path, model, adam)
    again = make_net()
    opt = make_opt(again, stage)
    with caplog.at_level("WARNING", logger="zero_kernels"):
        ck.load(tmp_path, again, opt)
    assert "zero_kernels.checkpoint.load: param group 0 was saved with L2 weight decay" in caplog.text
    assert opt.param_groups[0]["decoupled_weight_decay"] is True
    train(again, opt, range(2, 4), 0, 1)
    assert opt.applied_steps == 2


def _memory_error_body(rank: int, world: int, root: str) -> list[str]:
    """Rank 1 runs out of memory writing its file: every rank raises the same CheckpointError, the last version
    stays the latest, and the next save works (a MemoryError escaped on rank 1 alone, and rank 0 waited for it)."""
    import zero_kernels.checkpoint.sharded as sharded

    model = make_net()
    opt = make_opt(model, 2)
    train(model, opt, range(2), rank, world)
    ck.save(root, model, opt)
    write = sharded._write_rank_file

    def failing(*args, **kwargs):
        if rank == 1:
            raise MemoryError("out of memory")
        return write(*args, **kwargs)

    sharded._write_rank_file = failing
    try:
        ck.save(root, model, opt)
        problems = ["the failed save did not raise"]
    except ck.CheckpointError as err:
        problems = [] if "rank 1: MemoryError: out of memory" in str(err) else [f"unclear: {err}"]
    finally:
        sharded._write_rank_file = write
    problems += [] if (Path(root) / "latest").read_text() == "v000001" else ["latest moved"]
    ck.save(root, model, opt)
    return problems


@pytest.mark.distributed
def test_a_memory_error_on_one_rank_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    run_ranks_checked(_memory_error_body, 2, str(tmp_path))


def _gan(stage: int) -> tuple[nn.ModuleDict, zo.ShardedFusedAdam, zo.ShardedFusedAdam]:
    torch.manual_seed(0)
    model = nn.ModuleDict({"generator": nn.Linear(3, 6), "discriminator": nn.Linear(6, 1)})
    kw = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}  # shard even these tiny tensors
    opts = [zo.ShardedFusedAdam(model[part], lr=1e-2, stage=stage, **kw) for part in ("generator", "discriminator")]
    model["discriminator"](model["generator"](torch.randn(4, 3))).mean().backward()
    for opt in opts:
        opt.step()
    return model, *opts


def test_a_model_part_of_which_another_stage3_optimizer_trains_is_refused_naming_it(tmp_path: Path) -> None:
    model, opt_g, opt_d = _gan(2)
    ck.save(tmp_path / "stage2", model, opt_g)  # at stages 0-2 the whole wrapper's values are there to save
    model, opt_g, opt_d = _gan(3)
    refused = r"{}: model tensor 'discriminator.weight' is trained by another ShardedFusedAdam, at stage 3"
    with pytest.raises(ck.CheckpointError, match=refused.format("save")):
        ck.save(tmp_path / "wrapper", model, opt_g)
    assert not (tmp_path / "wrapper").exists()
    with pytest.raises(ck.CheckpointError, match=refused.format("load")):
        ck.load(tmp_path / "stage2", model, opt_g)
    ck.save(tmp_path / "g", model["generator"], opt_g)
    with opt_g.gathered_params():
        saved = model["generator"].weight.detach().clone()
    fresh = nn.Linear(3, 6)
    ck.load(tmp_path / "g", fresh, zo.ShardedFusedAdam(fresh, lr=1e-2, stage=1))
    assert torch.equal(fresh.weight.detach(), saved)
