"""Coming from DeepSpeed or the Hugging Face Trainer: "auto" values, the stage as a string, the
scheduler section, and DeepSpeed ZeRO checkpoints resumed here.

The DeepSpeed fixtures under ``tests/data/deepspeed`` were made by real DeepSpeed (two gloo ranks,
stages 1-3, fp32 and bf16 with fp32 master, and with a frozen parameter at stages 2-3;
``tests/data/make_deepspeed_fixtures.py``): each holds
a checkpoint after 4 steps and what DeepSpeed's own resumed run saw over the next 5 (losses, lr,
and ``zero_to_fp32`` weights before and after). No deepspeed is needed here.

Tolerances. fp32: the resumed run here differs from DeepSpeed's only by summation order (another
world size) and the fused kernel (<= 1.3e-6 relative per step), so losses agree to 1e-5 relative
and weights after 5 steps to 1e-5 relative (plus 1e-6 of the tensor's scale near zero). bf16: the
forward runs in bf16 on both sides, so losses agree to a few bf16 ulps (2e-2 relative) and the
bf16 weights to one bf16 ulp of their scale.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zero_kernels as zk
import zero_kernels.optim as zo
from tests.helpers.check import assert_close
from tests.helpers.dist import run_ranks
from tests.helpers.paths import DATA
from zero_kernels.__main__ import main as cli
from zero_kernels.checkpoint import CheckpointError
from zero_kernels.checkpoint.format import OBJECTS, TensorSource, resolve
from zero_kernels.checkpoint.metadata import read_metadata
from zero_kernels.checkpoint.objects import read_file
from zero_kernels.schedulers import WarmupDecayLR, WarmupLR

_spec = importlib.util.spec_from_file_location("make_deepspeed_fixtures", DATA / "make_deepspeed_fixtures.py")
fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixtures)
CASES = sorted(fixtures.CASES)


# ---------------------------------------------------------------- "auto" values and training_args
def _args(**changes: Any) -> types.SimpleNamespace:
    """A stand-in for transformers.TrainingArguments with non-default values (duck-typed)."""
    values = dict(
        per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=3e-4,
        adam_beta1=0.85, adam_beta2=0.98, adam_epsilon=1e-7, weight_decay=0.01, fp16=False, fp16_full_eval=False,
        bf16=True, bf16_full_eval=False, max_steps=200, warmup_steps=0.1,
    )  # fmt: skip
    values.update(changes)
    args = types.SimpleNamespace(**values)
    args.get_warmup_steps = lambda total: int(args.warmup_steps) if args.warmup_steps >= 1 else -(-total * 1 // 10)
    return args


HF_TEMPLATE = {
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto",
        },
    },
    "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": "auto"},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}  # fmt: skip


def _warnings(caplog: pytest.LogCaptureFixture) -> str:
    records = [r for r in caplog.records if r.name == "zero_kernels" and r.levelno >= logging.WARNING]
    return "\n".join(r.getMessage() for r in records)


def test_training_args_fill_every_auto_the_trainer_would(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        cfg = zk.ZeroConfig.from_deepspeed(HF_TEMPLATE, world_size=3, training_args=_args(), hidden_size=64)
    opt = cfg.optimizer
    assert (opt.lr, opt.betas, opt.eps, opt.weight_decay) == (3e-4, (0.85, 0.98), 1e-7, 0.01)
    assert (cfg.gradient_clipping, cfg.bf16, cfg.fp16.enabled) == (0.5, True, False)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size) == (4, 2, 24)
    assert cfg.zero.reduce_bucket_size == 64 * 64
    assert cfg.scheduler.type == "WarmupDecayLR"
    params = cfg.scheduler.params
    assert (params["warmup_min_lr"], params["warmup_max_lr"]) == (0.0, 3e-4)
    assert (params["total_num_steps"], params["warmup_num_steps"]) == (200, 20)  # max_steps; ceil(0.1 * 200)
    logged = _warnings(caplog)
    for line in (
        "optimizer.params.lr=0.0003 (from training_args.learning_rate)",
        "gradient_clipping=0.5 (from training_args.max_grad_norm)",
        "train_batch_size=24 (from training_args.",
        "scheduler.params.warmup_num_steps=20 (from training_args.warmup_steps)",
        "scheduler.params.warmup_min_lr=0.0 (as the Hugging Face Trainer fills it)",
        "zero_optimization.overlap_comm=None (DeepSpeed's default)",
    ):
        assert line in logged, f"{line!r} not logged at WARNING; got: {logged}"
    assert sum("auto" in r.getMessage() for r in caplog.records) == 1, "resolved values are logged in one record"


def test_training_args_give_warmup_max_lr_without_an_optimizer_section() -> None:
    """A config without an optimizer section (a client optimizer's, or one a Trainer subclass builds): "auto"
    warmup_max_lr is still the arguments' learning_rate, as the Trainer fills it and DeepSpeed then warms every group
    to it (it was each group's own lr)."""
    config = {**HF_TEMPLATE}
    del config["optimizer"]
    cfg = zk.ZeroConfig.from_deepspeed(config, world_size=3, training_args=_args(), hidden_size=64)
    assert cfg.scheduler.params["warmup_max_lr"] == 3e-4


def test_matches_the_hf_trainer_where_transformers_is_installed() -> None:
    """The values the Trainer's own DeepSpeed integration writes into the same template (it needs deepspeed)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("deepspeed")
    integration = pytest.importorskip("transformers.integrations.deepspeed")
    args = transformers.TrainingArguments(
        output_dir="unused", report_to=[], use_cpu=True, learning_rate=3e-4, adam_beta1=0.85, adam_beta2=0.98,
        adam_epsilon=1e-7, weight_decay=0.01, max_grad_norm=0.5, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, bf16=True, max_steps=200, warmup_steps=0.1,
    )  # fmt: skip
    trainer = integration.HfTrainerDeepSpeedConfig(json.loads(json.dumps(HF_TEMPLATE)))
    trainer.trainer_config_process(args)
    trainer.trainer_config_finalize(args, types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=64)), 200)
    theirs = trainer.config
    ours = zk.ZeroConfig.from_deepspeed(HF_TEMPLATE, world_size=args.world_size, training_args=args, hidden_size=64)
    opt, sched = theirs["optimizer"]["params"], theirs["scheduler"]["params"]
    assert (ours.optimizer.lr, ours.optimizer.eps, ours.optimizer.weight_decay) == (
        opt["lr"],
        opt["eps"],
        opt["weight_decay"],
    )
    assert list(ours.optimizer.betas) == list(opt["betas"])
    assert (ours.gradient_clipping, ours.bf16, ours.fp16.enabled) == (
        theirs["gradient_clipping"],
        theirs["bf16"]["enabled"],
        theirs["fp16"]["enabled"],
    )
    assert (ours.train_batch_size, ours.train_micro_batch_size_per_gpu, ours.gradient_accumulation_steps) == (
        theirs["train_batch_size"],
        theirs["train_micro_batch_size_per_gpu"],
        theirs["gradient_accumulation_steps"],
    )
    assert ours.zero.reduce_bucket_size == theirs["zero_optimization"]["reduce_bucket_size"]
    assert {k: ours.scheduler.params[k] for k in sched} == sched


def test_without_training_args_auto_takes_the_trainers_defaults() -> None:
    template = {**HF_TEMPLATE, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}}
    cfg = zk.ZeroConfig.from_deepspeed(template)
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.gradient_clipping) == (5e-5, 0.0, 1.0)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 1)
    assert cfg.scheduler.params["warmup_max_lr"] == 5e-5
    keyword = zk.ZeroConfig.from_deepspeed(template, training_args=_args(), lr=1e-2)  # keywords come first
    assert (keyword.optimizer.lr, keyword.scheduler.params["warmup_max_lr"]) == (1e-2, 1e-2)


@pytest.mark.parametrize(
    "config, kwargs, fragments",
    [
        (HF_TEMPLATE, {}, ("scheduler.params.total_num_steps is required by WarmupDecayLR", "total_num_steps=")),
        (
            {**HF_TEMPLATE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
            {"training_args": _args()},
            ("optimizer.params.lr=0.001", "training_args.learning_rate=0.0003", '"auto"'),
        ),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_stepz": 3}}}, {}, ("'warmup_num_stepz'",)),
        ({"scheduler": {"type": "warmuplr"}}, {}, ("scheduler.type='warmuplr'", "did you mean 'WarmupLR'")),
        (
            {"scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}}},
            {},
            ("scheduler.params.lr_range_test_step_size=0",),
        ),
        ({"scheduler": {"type": "WarmupLR"}}, {"training_args": object()}, ("training_args has no attribute",)),
        ({"scheduler": {"type": "WarmupLR"}}, {"total_num_steps": 5}, ("sets scheduler.params.total_num_steps",)),
    ],
)
def test_auto_and_scheduler_errors_name_the_key(config: dict, kwargs: dict, fragments: tuple) -> None:
    with pytest.raises(ValueError) as err:
        zk.ZeroConfig.from_deepspeed(config, **kwargs)
    for fragment in fragments:
        assert fragment in str(err.value), f"{fragment!r} missing from: {err.value}"


# ---------------------------------------------------------------- the stage as DeepSpeed reads it
def test_stage_given_as_a_string() -> None:
    for value, stage in (("2", 2), ("2.0", 2), (" 3 ", 3), (1.0, 1), ("0", 0)):
        assert zk.ZeroConfig.from_deepspeed({"zero_optimization": {"stage": value}}).stage == stage
    assert zo.ShardedFusedAdam(torch.nn.Linear(2, 2), stage="2").options.stage == 2
    for value in ("2.5", "4", "two", True, "", "auto"):
        with pytest.raises(ValueError, match="zero_optimization.stage") as err:
            zk.ZeroConfig.from_deepspeed({"zero_optimization": {"stage": value}})
        assert "from 0 to 3" in str(err.value)
    with pytest.raises(ValueError, match=r"zero_optimization.stage='5' is invalid: expected an integer from 0 to 3"):
        zo.ShardedFusedAdam(torch.nn.Linear(2, 2), stage="5")


# ---------------------------------------------------------------- initialize and the scheduler
def test_initialize_returns_the_scheduler_when_the_config_has_one() -> None:
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, "zero_optimization": {"stage": "1"}}
    model, opt = zk.initialize(torch.nn.Linear(3, 2), config)
    assert isinstance(opt, zo.ShardedFusedAdam)
    warmup = {"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_type": "linear"}}
    scheduled = {**config, "scheduler": warmup}
    model, opt, scheduler = zk.initialize(torch.nn.Linear(3, 2), scheduled)
    assert isinstance(scheduler, WarmupLR) and isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    assert seen == pytest.approx([0.0, 0.0, 0.05, 0.1])
    torch_sched = {**config, "scheduler": {"type": "StepLR", "params": {"step_size": 1, "gamma": 0.5}}}
    _, _, step_lr = zk.initialize(torch.nn.Linear(3, 2), torch_sched)
    assert isinstance(step_lr, torch.optim.lr_scheduler.StepLR)


def test_checkpoint_keeps_the_scheduler(tmp_path: Path) -> None:
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2}},
    }
    model, opt, scheduler = zk.initialize(torch.nn.Linear(3, 2), config)
    for _ in range(3):
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        scheduler.step()
    zk.checkpoint.save(tmp_path, model, opt, scheduler=scheduler)
    model2, opt2, scheduler2 = zk.initialize(torch.nn.Linear(3, 2), config)
    zk.checkpoint.load(tmp_path, model2, opt2, scheduler=scheduler2)
    assert isinstance(scheduler2, WarmupDecayLR)
    assert scheduler2.last_epoch == scheduler.last_epoch == 3
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    scheduler.step(), scheduler2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    bare = zk.initialize(torch.nn.Linear(3, 2), {"optimizer": config["optimizer"]})
    zk.checkpoint.save(tmp_path / "bare", *bare)
    with pytest.raises(CheckpointError, match="holds no scheduler state"):
        zk.checkpoint.load(tmp_path / "bare", model2, opt2, scheduler=scheduler2)


# ---------------------------------------------------------------- DeepSpeed checkpoints
@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("imported")
    return {case: zk.checkpoint.from_deepspeed(DATA / "deepspeed" / case / "ckpt", root / case) for case in CASES}


def _resumed(case: str) -> dict[str, Any]:
    return torch.load(DATA / "deepspeed" / case / "resumed.pt", weights_only=True)


def test_import_keeps_deepspeeds_fp32_weights_steps_and_groups(imported: dict[str, Path]) -> None:
    for case in CASES:
        version = resolve(imported[case])
        meta = read_metadata(version)
        before = _resumed(case)["weights_before"]  # DeepSpeed's own zero_to_fp32 of the checkpoint
        with TensorSource(version, meta) as src:
            for i, p in enumerate(meta["params"]):
                key = f"optim/{i}/master" if "bf16" in case else f"model/{p['name']}"
                assert torch.equal(src.full(key), before[p["name"]]), f"{case} {p['name']}"
                assert src.full(f"optim/{i}/exp_avg_sq").min() >= 0
                assert p["step"] == fixtures.STEPS_BEFORE
        if fixtures.CASES[case][2]:  # DeepSpeed keeps the frozen fc1.weight apart from the optimizer's state
            assert "fc1.weight" not in [p["name"] for p in meta["params"]]
            with TensorSource(version, meta) as src:
                assert torch.equal(src.full("model/fc1.weight").float(), before["fc1.weight"].float()), case
        assert [g["weight_decay"] for g in meta["param_groups"]] == [0.1, 0.0]
        weights_decay = [0 if p["name"].endswith("weight") else 1 for p in meta["params"]]
        assert [p["group"] for p in meta["params"]] == weights_decay, f"{case}: {fixtures.groups.__doc__}"
        book = read_file(version, OBJECTS, meta["objects"])
        assert meta["param_groups"][0]["betas"] == [0.9, 0.95] and book["param_groups"][0]["betas"] == (0.9, 0.95)
        assert book["lr_scheduler"] == {"last_batch_iteration": 3}, f"{case}: {book['lr_scheduler']}"
        assert meta["skipped_steps"] == 0, f"{case}: DeepSpeed's model states hold skipped_steps 0"


def test_import_keeps_deepspeeds_skipped_steps(imported: dict[str, Path], tmp_path: Path) -> None:
    """The fixture's ``skipped_steps`` (0) replaces the optimizer's count on load, as DeepSpeed's resume does; a
    model states file holding 3 gives 3, one without it none, one with a bad value a CheckpointError."""
    case = "stage2_fp32"
    info = json.loads((DATA / "deepspeed" / case / "case.json").read_text())
    config = {**info["config"], "zero_optimization": {"stage": 2}}

    def loaded(root: Path) -> int:
        model = fixtures.make_model()
        model, opt, scheduler = zk.initialize(model, config, model_parameters=fixtures.groups(model))
        opt.skipped_steps = 5
        zk.checkpoint.load(root, model, opt, scheduler=scheduler)
        return opt.skipped_steps

    assert loaded(imported[case]) == 0
    ds = tmp_path / "ds"
    shutil.copytree(DATA / "deepspeed" / case / "ckpt", ds)
    states = ds / "global_step4" / "mp_rank_00_model_states.pt"
    original = torch.load(states, weights_only=True)
    for value, expected in ((3, 3), (None, 5)):
        changed = {k: v for k, v in original.items() if k != "skipped_steps" or value is not None}
        if value is not None:
            changed["skipped_steps"] = value
        torch.save(changed, states)
        out = tmp_path / f"out{value}"
        version = zk.checkpoint.from_deepspeed(ds, out)
        assert read_metadata(version).get("skipped_steps") == value
        assert loaded(out) == expected
    torch.save({**original, "skipped_steps": -2}, states)
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt: skipped_steps must be an integer >= 0"):
        zk.checkpoint.from_deepspeed(ds, tmp_path / "bad")


def _resume(rank: int, world: int, stages: dict[str, int], imported: dict[str, str], out: str) -> None:
    results = {}
    rows = fixtures.ROWS // world
    for case, stage in stages.items():
        info = json.loads((DATA / "deepspeed" / case / "case.json").read_text())
        config = {**info["config"], "zero_optimization": {"stage": stage, "reduce_bucket_size": 16}}
        model = fixtures.make_model(info.get("frozen", False), info.get("frozen_biases", False))
        model, opt, scheduler = zk.initialize(model, config, model_parameters=fixtures.groups(model))
        zk.checkpoint.load(imported[case], model, opt, scheduler=scheduler)
        dtype = torch.bfloat16 if info["bf16"] else torch.float32
        losses, lrs = [], []
        for step in range(fixtures.STEPS_BEFORE, fixtures.STEPS_BEFORE + fixtures.STEPS_AFTER):
            x, y = fixtures.batch(step)
            lrs.append(opt.param_groups[0]["lr"])
            loss = model(x[rank * rows : (rank + 1) * rows].to(dtype), y[rank * rows : (rank + 1) * rows].to(dtype))
            loss.backward()
            opt.step()
            scheduler.step()
            opt.zero_grad()
            total = loss.detach().float().reshape(1)
            if world > 1:
                dist.all_reduce(total)
            losses.append(total.item() / world)
        with opt.gathered_params():
            weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        results[case] = {"losses": losses, "lrs": lrs, "weights": weights}
    if rank == 0:
        torch.save(results, out)


def _check_resumed(case: str, got: dict[str, Any], where: str) -> None:
    theirs = _resumed(case)
    assert got["lrs"] == pytest.approx(theirs["lrs"], rel=1e-12), f"{case} {where}: lr per step"
    bf16 = "bf16" in case
    assert_close(
        torch.tensor(got["losses"]), torch.tensor(theirs["losses"]), rtol=2e-2 if bf16 else 1e-5, what=f"{case} loss"
    )
    for name, value in got["weights"].items():
        expected = theirs["weights_after"][name]
        if bf16:
            expected = expected.to(torch.bfloat16).float()
        scale = expected.abs().max().item()
        assert_close(
            value, expected, rtol=0 if bf16 else 1e-5, atol=scale * (2**-7 if bf16 else 1e-6), what=f"{case} {name}"
        )


def test_resume_deepspeed_checkpoint_on_one_rank_matches_deepspeeds_run(imported: dict[str, Path]) -> None:
    """World 1 (DeepSpeed saved on 2), stage 0 for stage-1 checkpoints, else the same stage."""
    stages = {case: {1: 0, 2: 2, 3: 3}[fixtures.CASES[case][0]] for case in CASES}
    out = Path(imported[CASES[0]]).parent.parent / "world1.pt"
    _resume(0, 1, stages, {c: str(v) for c, v in imported.items()}, str(out))
    results = torch.load(out, weights_only=True)
    for case in CASES:
        _check_resumed(case, results[case], "world 1")


@pytest.mark.distributed
def test_resume_deepspeed_checkpoint_on_three_ranks_at_another_stage(imported: dict[str, Path]) -> None:
    """One checkpoint per DeepSpeed stage (both precisions covered), each at another stage on 3 ranks."""
    stages = {"stage1_fp32": 3, "stage2_bf16": 1, "stage3_fp32": 2, "stage3_frozen_bf16": 2, "stage2_frozen_fp32": 3}
    out = Path(imported[CASES[0]]).parent.parent / "world3.pt"
    run_ranks(_resume, 3, stages, {c: str(v) for c, v in imported.items()}, str(out))
    results = torch.load(out, weights_only=True)
    for case in stages:
        _check_resumed(case, results[case], "world 3")


def test_import_command_line_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ds = tmp_path / "ds"
    shutil.copytree(DATA / "deepspeed" / "stage2_fp32" / "ckpt", ds)
    assert cli(["import-deepspeed", str(ds), str(tmp_path / "out"), "--tag", "global_step4"]) == 0
    assert "saved by stage 2" in capsys.readouterr().out
    assert cli(["import-deepspeed", str(ds), str(tmp_path / "out"), "--tag", "global_step9"]) == 2
    assert "no checkpoint tag 'global_step9'; tags there: global_step4" in capsys.readouterr().err
    (ds / "latest").unlink()
    with pytest.raises(CheckpointError, match="no 'latest' file: pass the checkpoint's tag"):
        zk.checkpoint.from_deepspeed(ds, tmp_path / "out")
    optim = ds / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"client_state": _Unsafe(), "optimizer_state_dict": {}}, optim)
    with pytest.raises(CheckpointError, match=r"not safe to load \(global tests\.checkpoint\.test_migration\._Unsafe"):
        zk.checkpoint.from_deepspeed(ds, tmp_path / "out", tag="global_step4")
    optim.unlink()
    with pytest.raises(CheckpointError, match="saved by 2 ranks but holds optimizer state files for 1"):
        zk.checkpoint.from_deepspeed(ds, tmp_path / "out", tag="global_step4")


def test_a_missing_stage3_model_states_file_is_named(tmp_path: Path) -> None:
    """A stage-3 checkpoint without one rank's model states file: said so (it failed on a frozen parameter's size)."""
    ds = tmp_path / "ds"
    shutil.copytree(DATA / "deepspeed" / "stage3_frozen_fp32" / "ckpt", ds)
    (ds / "global_step4" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"lacks stage 3 model state files for ranks 0\.\.1 \(found ranks \[0"):
        zk.checkpoint.from_deepspeed(ds, tmp_path / "out")


def test_a_stage0_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    """DeepSpeed's stage 0 keeps its optimizer inside mp_rank_00_model_states.pt and writes no ZeRO optimizer files
    (seen with DeepSpeed 0.19.8, fp32 and bf16): refused naming stage 0 and where the weights are (it said "lacks
    optimizer state files for ranks 0..N-1 (found ranks [])")."""
    ds = tmp_path / "ds"
    shutil.copytree(DATA / "deepspeed" / "stage2_fp32" / "ckpt", ds)
    for optim in (ds / "global_step4").glob("zero_pp_rank_*_optim_states.pt"):
        optim.unlink()
    with pytest.raises(CheckpointError, match=r"a ZeRO stage 0 checkpoint.*stages 1, 2 and 3 can.*'module'"):
        zk.checkpoint.from_deepspeed(ds, tmp_path / "out")


def test_an_elastic_stage2_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    """DeepSpeed's ``elastic_checkpoint`` (stages 1-2) saves each group's lean Adam state as a list, not the torch
    optimizer's state_dict: refused saying so (it failed with "list indices must be integers or slices, not str")."""
    from zero_kernels.checkpoint import deepspeed as ds_import

    ds = tmp_path / "ds"
    shutil.copytree(DATA / "deepspeed" / "stage2_fp32" / "ckpt", ds)
    for path in (ds / "global_step4").glob("*optim_states.pt"):
        outer = ds_import._load(path)
        inner = outer["optimizer_state_dict"]
        base = inner["base_optimizer_state"]
        inner["base_optimizer_state"] = [base["state"][g] for g in sorted(base["state"])]
        inner["zero_stage"] = 2
        inner.pop("loss_scaler", None)
        outer.pop("param_slice_mappings", None)
        inner.pop("param_slice_mappings", None)
        torch.save(outer, path)
    with pytest.raises(CheckpointError, match="elastic_checkpoint"):
        zk.checkpoint.from_deepspeed(ds, tmp_path / "out")


def test_frozen_parameters_given_to_the_optimizer_are_named_with_what_to_do(imported: dict[str, Path]) -> None:
    """The param groups given to DeepSpeed may hold frozen parameters, which DeepSpeed keeps apart from its optimizer's
    state; the same groups here are refused naming the parameter as frozen and saying to give only those that train
    (it said "is in param group 0 here but not optimized in ...", with nothing to do)."""
    case = "stage2_frozen_fp32"
    info = json.loads((DATA / "deepspeed" / case / "case.json").read_text())
    model = fixtures.make_model(frozen=True)
    model, opt, scheduler = zk.initialize(model, info["config"], model_parameters=fixtures.groups(model, True))
    with pytest.raises(
        CheckpointError, match=r"'fc1.weight' is in param group 0 here .*\(frozen here.*requires_grad=True\)"
    ):
        zk.checkpoint.load(imported[case], model, opt, scheduler=scheduler)


def test_frozen_parameters_deepspeed_left_out_keep_the_models_values(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``save_checkpoint(exclude_frozen_parameters=True)`` (the HF Trainer's with a PEFT model) leaves the frozen
    parameters out: the load keeps the model's own values there, as DeepSpeed's does, and says so (it refused:
    "model tensor 'fc1.weight' is not in ...: it was saved from another model")."""
    from zero_kernels.checkpoint import deepspeed as ds_import

    case = "stage2_frozen_fp32"
    ds = tmp_path / "ds"
    shutil.copytree(DATA / "deepspeed" / case / "ckpt", ds)
    path = ds / "global_step4" / "mp_rank_00_model_states.pt"
    state = ds_import._load(path)
    del state["module"]["fc1.weight"], state["frozen_param_shapes"], state["frozen_param_fragments"]
    torch.save(state, path)
    zk.checkpoint.from_deepspeed(ds, tmp_path / "zk")
    model = fixtures.make_model(frozen=True)
    with torch.no_grad():
        model.fc1.weight.add_(1.0)  # the base weights the user loaded: not DeepSpeed's init
    base = model.fc1.weight.detach().clone()
    config = json.loads((DATA / "deepspeed" / case / "case.json").read_text())["config"]
    model, opt, scheduler = zk.initialize(model, config, model_parameters=fixtures.groups(model))
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        zk.checkpoint.load(tmp_path / "zk", model, opt, scheduler=scheduler)
    assert torch.equal(model.fc1.weight, base)
    before = _resumed(case)["weights_before"]
    for name in ("fc1.bias", "fc2.weight", "fc2.bias"):
        assert torch.equal(dict(model.named_parameters())[name], before[name])
    assert "exclude_frozen_parameters" in caplog.text and "fc1.weight" in caplog.text


class _Unsafe:
    """An object in a checkpoint file that the importer must refuse to unpickle."""

    def __init__(self) -> None:
        self.payload = "not data"


def test_fp16_dynamic_loss_scale_is_imported() -> None:
    """The mapping of DeepSpeed's DynamicLossScaler state, field by field (a real fp16 checkpoint: below)."""
    from zero_kernels.checkpoint import deepspeed as ds_import

    scaler = ds_import._DynamicLossScaler()
    scaler.__setstate__(dict(cur_scale=2.0**12, cur_iter=30, last_overflow_iter=9, scale_window=8, cur_hysteresis=1))
    state = ds_import._loss_scaler({"loss_scaler": scaler})
    assert state == {"scale": 4096.0, "good_steps": 30 - 9 - 1, "hysteresis_left": 1}
    static = ds_import._LossScaler()
    static.__setstate__({"cur_scale": 1.0, "dynamic": False})
    assert ds_import._loss_scaler({"loss_scaler": static}) is None


def _resume_fp16(rank: int, world: int, case: str, imported: str, out: str) -> None:
    info = json.loads((DATA / "deepspeed" / case / "case.json").read_text())
    model = fixtures.make_model()
    model, opt, scheduler = zk.initialize(model, info["config"], model_parameters=fixtures.groups(model))
    zk.checkpoint.load(imported, model, opt, scheduler=scheduler)
    got = {"skipped_at_load": opt.skipped_steps, "losses": [], "lrs": [], "loss_scales": []}
    rows = fixtures.ROWS // world
    for step in range(fixtures.STEPS_BEFORE, fixtures.STEPS_BEFORE + fixtures.STEPS_AFTER):
        x, y = fixtures.batch(step)
        got["lrs"].append(opt.param_groups[0]["lr"])
        loss = model(x[rank * rows : (rank + 1) * rows].half(), y[rank * rows : (rank + 1) * rows].half())
        opt.backward(loss)
        opt.step()
        scheduler.step()
        opt.zero_grad()
        total = loss.detach().float().reshape(1)
        dist.all_reduce(total)
        got["losses"].append(total.item() / world)
        got["loss_scales"].append(opt.loss_scale)
    got["skipped_steps"] = opt.skipped_steps
    with opt.gathered_params():
        got["weights"] = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(got, out)


@pytest.mark.distributed
def test_fp16_checkpoint_saved_before_any_applied_step_resumes_as_deepspeed(tmp_path: Path) -> None:
    """Every step before DeepSpeed's save overflowed the fp16 loss scale: its Adam never stepped and saved no state
    (``stage2_fp16_skipped``). The import gives step 0 and zero moments; resumed on DeepSpeed's 2 ranks, the run
    skips, scales and steps as DeepSpeed's did (loss scale, skipped_steps, lr, losses and weights)."""
    case = "stage2_fp16_skipped"
    theirs = _resumed(case)
    version = zk.checkpoint.from_deepspeed(DATA / "deepspeed" / case / "ckpt", tmp_path / "zk")
    assert [p["step"] for p in read_metadata(version)["params"]] == [0] * 4
    run_ranks(_resume_fp16, 2, case, str(tmp_path / "zk"), str(tmp_path / "got.pt"))
    got = torch.load(tmp_path / "got.pt", weights_only=True)
    assert got["skipped_at_load"] == fixtures.STEPS_BEFORE
    assert (got["loss_scales"], got["skipped_steps"]) == (theirs["loss_scales"], theirs["skipped_steps"])
    assert got["lrs"] == pytest.approx(theirs["lrs"], rel=1e-12)
    assert_close(torch.tensor(got["losses"]), torch.tensor(theirs["losses"]), rtol=2e-3, what=f"{case} loss")
    for name, value in got["weights"].items():
        expected = theirs["weights_after"][name].half().float()
        assert_close(value, expected, rtol=0, atol=expected.abs().max().item() * 2**-10, what=f"{case} {name}")
