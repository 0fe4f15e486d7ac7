"""ShardedFusedAdam's optimizer contract: state dicts, memory report, fp16 loss scaling, bad input.

Every case runs at every stage; stage 3 frees parameters between uses, so the tests read and write
whole parameters (``model.state_dict()``, comparisons) inside ``opt.gathered_params()``.
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

import zero_kernels.optim as zo
from tests.helpers.check import assert_close
from tests.helpers.lockstep import BUCKET, LR, ROWS, STAGES, Net, batch, compare, make_models
from tests.helpers.paths import DATA
from zero_kernels.config import FP16Config
from zero_kernels.entry import initialize as zk_initialize
from zero_kernels.planner import estimate_memory
from zero_kernels.precision import LossScaleError, LossScaler
from zero_kernels.stages.outcome import StepResult


def train(model: Net, opt: torch.optim.Optimizer, rank: int, world: int, steps: range) -> None:
    for step in steps:
        x = batch(step, world * ROWS)
        model(x[rank * ROWS : (rank + 1) * ROWS]).backward()
        opt.step()
        opt.zero_grad()


def resume_case(rank: int, world: int, stage: int, path: str) -> None:
    """Save after 2 steps, load into a fresh model + optimizer, continue: bit-identical to no break."""
    model, _ = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=BUCKET)
    train(model, opt, rank, world, range(2))
    with opt.gathered_params():
        saved_model = copy.deepcopy(model.state_dict())
    saved_opt, full = opt.state_dict(), opt.full_state_dict()
    shapes = [tuple(p.shape) for p in make_models(torch.float32)[0].parameters()]
    assert saved_opt["zero_kernels.sharded"]["shapes"] == shapes, f"stage {stage}: shapes in the sharded state"
    assert all(full["state"][i]["exp_avg"].shape == shapes[i] for i in full["state"]), f"stage {stage}: full shapes"
    train(model, opt, rank, world, range(2, 4))
    fresh, _ = make_models(torch.float32)
    fresh.load_state_dict(saved_model)
    opt2 = zo.ShardedFusedAdam(fresh, lr=LR, stage=stage, reduce_bucket_size=BUCKET)
    opt2.load_state_dict(saved_opt)
    train(fresh, opt2, rank, world, range(2, 4))
    with opt.gathered_params(), opt2.gathered_params():
        for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
            assert torch.equal(p, q), f"stage {stage} resume: {name} differs"
    if rank == 0:
        torch.save({"model": saved_model, "opt": full}, path)


def full_into_adamw_case(rank: int, world: int, stage: int, path: str) -> None:
    """A full state saved on another world size/stage loads into torch AdamW and into us; both continue alike."""
    saved = torch.load(path)
    model, ref = make_models(torch.float32)
    model.load_state_dict(saved["model"])
    ref.load_state_dict(saved["model"])
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=BUCKET + 4)
    opt.load_state_dict(saved["opt"])
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    ropt.load_state_dict(saved["opt"])
    for step in range(2, 4):
        x = batch(step, world * ROWS)
        model(x[rank * ROWS : (rank + 1) * ROWS]).backward()
        ref(x).backward()
        opt.step(), ropt.step(), opt.zero_grad(), ropt.zero_grad()
        with opt.gathered_params():
            compare(model, ref, f"stage {stage} from full state, step {step}")
    mine = opt.full_state_dict()
    for index, entry in ropt.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(mine["state"][index][key], entry[key], rtol=1e-5, atol=1e-9, what=f"state {index} {key}")
        assert float(mine["state"][index]["step"]) == float(entry["step"])


def memory_case(rank: int, world: int, stage: int) -> None:
    """memory_report() within 5% of the planner's fp32 estimate; backward holds a few gradient buckets at most."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 200), nn.Linear(200, 101))
    psi = sum(p.numel() for p in model.parameters())
    bucket = 4_000
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=bucket,
                              stage3_param_persistence_threshold=0)  # fmt: skip
    estimate = estimate_memory(psi, world, stage, param_dtype="fp32", master_weights=False)
    for _ in range(2):
        model(torch.randn(4, 300)).square().mean().backward()
        during = opt.memory_report()["grads"]
        opt.step()
        opt.zero_grad()
    if stage >= 2:  # the reduced shard, and the scratch buckets of the reductions still in flight
        bound = estimate.grads + opt._pipeline.max_inflight * 4 * bucket
        assert during <= bound, f"stage {stage}: {during} gradient bytes held after backward, at most {bound}"
    report = opt.memory_report()
    for key in ("params", "grads", "optimizer"):
        want = getattr(estimate, key)
        assert abs(report[key] - want) <= 0.05 * want, f"stage {stage} {key}: {report[key]} vs planner {want}"
    # idle gradient buckets kept for reuse: at most pool_limit() of the largest bucket, and no more than the shard;
    # stage 1 (on several ranks): its reduced gradient shard, and idle scratch buckets no larger than it
    limit = opt._pipeline.pool_limit(torch.device("cpu")) if stage >= 2 else 0
    bound = limit * 4 * max(b.numel for buf in opt._pipeline.buffers for b in buf.layout.buckets)
    shard = 4 * sum(buf.layout.shard_numel for buf in opt._pipeline.buffers)
    bound = min(bound, report["grads"]) if stage >= 2 else 2 * shard if stage == 1 and world > 1 else 0
    pooled = report["buffers"]
    assert (0 < pooled <= bound) if bound else pooled == 0, f"stage {stage}: {pooled} B pooled, bound {bound}"


def fp16_case(rank: int, world: int, stage: int) -> None:
    """An inf on one rank skips the step everywhere and lowers the scale after the hysteresis."""
    torch.manual_seed(0)
    model = nn.Linear(7, 3).half()
    before = [p.detach().clone() for p in model.parameters()]
    fp16 = dict(enabled=True, loss_scale=0, initial_scale_power=4, loss_scale_window=2, hysteresis=2)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=5, fp16=fp16)
    scales = []
    for step in range(4):
        x = torch.randn(2, 7).half()
        if step < 2 and rank == world - 1:
            x[0, 0] = math.inf
        opt.backward(model(x).float().square().mean())
        opt.step()
        opt.zero_grad()
        scales.append(opt.loss_scale)
        with opt.gathered_params():
            unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        if step < 2:
            assert opt.last_step.skipped, f"stage {stage} step {step}: overflow not detected"
            assert unchanged, f"stage {stage}: a skipped step changed params"
        else:
            assert not opt.last_step.skipped
    assert scales == [16.0, 8.0, 8.0, 8.0], f"stage {stage} loss scales {scales}"  # DeepSpeed's: 16 after 3 good
    assert not unchanged, f"stage {stage}: good steps did not update"
    assert opt.skipped_steps == 2, f"stage {stage}: skipped_steps {opt.skipped_steps}"
    fresh = zo.ShardedFusedAdam(nn.Linear(7, 3).half(), lr=LR, stage=stage, reduce_bucket_size=5, fp16=fp16)
    fresh.load_state_dict(opt.state_dict())  # this rank's shard where there are several
    assert (fresh.skipped_steps, fresh.applied_steps) == (2, 0), f"stage {stage}: {fresh.skipped_steps} skipped"
    full = opt.full_state_dict()
    opt.consolidate_state_dict(to=0)
    whole = opt.state_dict() if rank == 0 else full  # rank 0: the consolidated state
    for name, state_dict in (("full_state_dict()", full), ("the consolidated state_dict()", whole)):
        again = zo.ShardedFusedAdam(nn.Linear(7, 3).half(), lr=LR, stage=stage, reduce_bucket_size=5, fp16=fp16)
        again.load_state_dict(state_dict)
        what = f"stage {stage}, {name}"
        assert again.skipped_steps == 2, f"{what}: {again.skipped_steps} skipped"
        assert again.loss_scaler.state_dict() == opt.loss_scaler.state_dict(), f"{what}: the loss scaler"


def bad_input_case(rank: int, world: int, stage: int) -> None:
    """Each error is clear and leaves the optimizer usable."""
    model, ref = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=BUCKET)
    n_buffers = len(opt._pipeline.buffers)
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [model.head.bias]})
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(3))], "lr": -1.0})
    if stage == 3:
        with pytest.raises(ValueError, match="not parameters of the model"):
            opt.add_param_group({"params": [nn.Parameter(torch.ones(3))]})
    assert len(opt.param_groups) == 1 and len(opt._pipeline.buffers) == n_buffers, "a rejected group was kept"
    other = nn.Sequential(nn.Linear(6, 11), nn.Linear(11, 4))
    other_opt = zo.ShardedFusedAdam(other, lr=LR, stage=stage, reduce_bucket_size=BUCKET)
    with pytest.raises(ValueError, match="param groups|parameters in the state"):
        opt.load_state_dict(other_opt.state_dict())
    bigger = Net()
    bigger.mid = nn.Linear(11, 6)
    bigger.frozen = nn.Parameter(torch.randn(6), requires_grad=False)
    bigger.extra, bigger.head = nn.Linear(6, 6), nn.Linear(6, 1)
    bigger_opt = zo.ShardedFusedAdam(bigger, lr=LR, stage=stage, reduce_bucket_size=BUCKET)
    train(bigger, bigger_opt, rank, world, range(1))
    with pytest.raises(ValueError, match=r"'mid.weight'.*\(6, 11\) in the state but \(5, 11\)"):
        opt.load_state_dict(bigger_opt.full_state_dict())
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    train(model, opt, rank, world, range(2))
    for step in range(2):
        x = batch(step, world * ROWS)
        ref(x).backward()
        ropt.step(), ropt.zero_grad()
    with opt.gathered_params():
        compare(model, ref, f"stage {stage} after rejected inputs")
    skewed = Net()
    with torch.no_grad():
        skewed.head.bias.fill_(float(rank))
    if world > 1:
        # the quantized-weights cause is named only where a qwZ gather ran in this process (none here)
        with pytest.raises(
            ValueError,
            match=r"'head.bias'.*different values on some rank: every rank must start "
            r"from the same model \(same seed, or broadcast rank 0's parameters first\)$",
        ):
            zo.ShardedFusedAdam(skewed, stage=stage)
    torch.manual_seed(7)
    permuted = Net()  # the same values, in another order on rank 1: the plain sum cannot tell
    if rank == 1:
        with torch.no_grad():
            permuted.mid.weight.copy_(permuted.mid.weight.flip(0))
    if world > 1:
        with pytest.raises(ValueError, match="'mid.weight'.*different values on some rank"):
            zo.ShardedFusedAdam(permuted, stage=stage)


def contract_cases(rank: int, world: int, path: str) -> None:
    for stage in STAGES:
        resume_case(rank, world, stage, f"{path}.{stage}")
        memory_case(rank, world, stage)
        fp16_case(rank, world, stage)
        bad_input_case(rank, world, stage)


def reload_cases(rank: int, world: int, path: str) -> None:
    for stage in STAGES:
        full_into_adamw_case(rank, world, stage, f"{path}.{STAGES[(stage - 1) % len(STAGES)]}")


@pytest.mark.distributed
def test_contract_then_reload_at_another_world_size(spawn, tmp_path) -> None:
    path = str(tmp_path / "state")
    spawn(contract_cases, 2, path)
    spawn(reload_cases, 3, path)


def test_argument_checks_match_adamw() -> None:
    model = Net()
    for kwargs in ({"lr": -1.0}, {"eps": -1.0}, {"betas": (1.0, 0.9)}, {"betas": (0.9, -0.1)}, {"weight_decay": -1}):
        with pytest.raises(ValueError) as ours:
            zo.ShardedFusedAdam(model.parameters(), **kwargs)
        with pytest.raises(ValueError) as theirs:
            torch.optim.AdamW(model.parameters(), **kwargs)
        assert str(ours.value) == str(theirs.value)
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        zo.ShardedFusedAdam(model.parameters(), reduce_bucket_size=-5)
    with pytest.raises(ValueError, match="stage 3 gathers parameters with module hooks"):
        zo.ShardedFusedAdam(model.parameters(), stage=3)
    with pytest.raises(ValueError, match="module= names another model"):
        zo.ShardedFusedAdam(model, module=Net())
    with pytest.raises(ValueError, match="module must be an nn.Module"):
        zo.ShardedFusedAdam(model.parameters(), module=list(model.parameters()))
    with pytest.raises(ValueError, match="zero_optimization.stage"):
        zo.ShardedFusedAdam(model.parameters(), stage=4)


def test_initialize_reads_deepspeed_config() -> None:
    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "weight_decay": 0.05, "adam_w_mode": False}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 17},
        "gradient_clipping": 0.5,
        "bf16": {"enabled": True},
    }
    model, opt = zk_initialize(Net(), config)
    assert isinstance(opt, zo.ShardedFusedAdam) and opt.options.stage == 2
    assert opt.options.reduce_bucket_size == 17 and opt.max_grad_norm == 0.5 and not opt.adam_w_mode
    assert opt.param_groups[0]["lr"] == 3e-3 and opt.param_groups[0]["weight_decay"] == 0.05
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_initialize_passes_param_groups_with_the_model() -> None:
    """DeepSpeed's model_parameters: param groups at stage 3, which also needs the model."""
    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3},
    }
    net = Net()
    named = list(net.named_parameters())
    groups = [{"params": [p for n, p in named if n.endswith("weight")]},
              {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0}]  # fmt: skip
    model, opt = zk_initialize(net, config, model_parameters=groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0] and opt.options.stage == 3
    model(batch(0, ROWS)).backward()
    opt.step()
    with opt.gathered_params():
        assert [tuple(p.shape) for p in model.parameters()] == [tuple(p.shape) for p in Net().parameters()]


@pytest.mark.parametrize("stage", [1, 3])
def test_initialize_passes_amsgrad_and_maximize(stage: int) -> None:
    """DeepSpeed hands these params to torch.optim.AdamW (torch_adam): the same steps as AdamW with them;
    foreach, fused and fp32_optimizer_states true change nothing."""
    flags = {"torch_adam": True, "amsgrad": True, "maximize": True, "foreach": True, "fused": False}
    hyper = {"lr": LR, "betas": [0.9, 0.5], "weight_decay": 0.05}  # a short beta2: the running max of v matters
    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "optimizer": {"type": "AdamW", "params": {**hyper, **flags, "fp32_optimizer_states": True}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,  # the default 1.0 clips; AdamW does not
    }
    model, ref = make_models(torch.float32)
    model, opt = zk_initialize(model, config)
    adamw = torch.optim.AdamW(ref.parameters(), **{**hyper, "betas": (0.9, 0.5)}, amsgrad=True, maximize=True)
    for step in range(5):
        x = batch(step, ROWS)
        model(x).backward()
        ref(x).backward()
        for o in (opt, adamw):
            o.step()
            o.zero_grad()
    assert all(g["amsgrad"] and g["maximize"] for g in opt.param_groups)
    with opt.gathered_params():
        compare(model, ref, f"stage {stage}")


TRACES = DATA / "deepspeed" / "loss_scale_traces.json"  # make_loss_scale_traces.py


def test_loss_scaler_follows_deepspeed_step_by_step() -> None:
    """30 overflow sequences under 6 fp16 configs, replayed through DeepSpeed 0.19.8's DynamicLossScaler:
    the same scale and hysteresis after every step, and an error at the same step where DeepSpeed stops."""
    cases = json.loads(TRACES.read_text())["cases"]
    assert len(cases) == 30 and sum(c["raised_at"] is not None for c in cases) > 5
    for n, case in enumerate(cases):
        fp16 = FP16Config(enabled=True, loss_scale=0, **case["fp16"])
        scaler = LossScaler.from_fp16_config(fp16)
        scales, hysteresis_left, raised_at = [], [], None
        for step, overflow in enumerate(case["overflows"]):
            before = scaler.state_dict()
            try:
                scaler.update(overflow)
            except LossScaleError:
                assert scaler.state_dict() == before, f"case {n}: a refused update changed the scaler"
                raised_at = step
                break
            scales.append(scaler.scale)
            hysteresis_left.append(scaler.hysteresis_left)
        what = f"case {n} {case['fp16']}"
        assert scales == case["scales"], f"{what}: scales {scales} != DeepSpeed's {case['scales']}"
        assert hysteresis_left == case["hysteresis_left"], f"{what}: hysteresis {hysteresis_left}"
        assert raised_at == case["raised_at"], f"{what}: raised at step {raised_at}, DeepSpeed at {case['raised_at']}"


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_accumulation_keeps_deepspeeds_headroom(stage: int) -> None:
    """fp16, 32 micro-steps at DeepSpeed's default scale 2**16: opt.backward divides the loss by the accumulation
    steps before scaling (as engine.backward), so the bias gradient 0.25 sums to 0.25 * 2**16 over the window,
    where 32x that (the loss scaled only) would overflow fp16 and skip every step. Each update matches AdamW
    within the fp16 tolerance (twice torch's own error on fp16 against an fp32 reference)."""
    micro, steps = 32, 3
    torch.manual_seed(0)
    model = nn.Linear(8, 4).half()
    ref, low = copy.deepcopy(model).float(), copy.deepcopy(model)
    fp16 = dict(enabled=True, loss_scale=0, initial_scale_power=16)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage, fp16=fp16, gradient_accumulation_steps=micro)
    refs = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (ref, low)]
    for k in range(steps * micro):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(k))
        opt.backward(model(x.half()).float().mean())
        opt.step()
        opt.zero_grad()
        for m, o in zip((ref, low), refs):
            (m(x.to(m.weight.dtype)).float().mean() / micro).backward()
            if k % micro == micro - 1:
                o.step(), o.zero_grad()
    assert opt.skipped_steps == 0 and opt.applied_steps == steps, f"stage {stage}: {opt.skipped_steps} skipped"
    assert opt.loss_scale == 2.0**16, f"stage {stage}: loss scale {opt.loss_scale}"
    with opt.gathered_params():
        compare(model, ref, f"stage {stage}", torch_low=low)


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_refuses_a_plain_backward(stage: int) -> None:
    """fp16 loss scaling needs opt.backward(loss): a loss.backward() would be divided by the loss scale at the
    step, which DeepSpeed refuses ("Loss scaling is required"); the step raises and updates nothing, also when
    only one micro-step of a window ran it. Without fp16 a plain backward trains."""
    torch.manual_seed(0)
    for micro, plain_at in ((1, 0), (2, 1)):
        model = nn.Linear(5, 3).half()
        before = [p.detach().clone() for p in model.parameters()]
        opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage, fp16={"enabled": True}, gradient_accumulation_steps=micro)
        for k in range(micro):
            loss = model(torch.randn(2, 5).half()).float().mean()
            loss.backward() if k == plain_at else opt.backward(loss)
            if k < micro - 1:
                opt.step()
        with pytest.raises(RuntimeError, match=r"loss scaling is required.*call opt.backward\(loss\)"):
            opt.step()
        with opt.gathered_params():
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), f"stage {stage}: updated"
        opt.zero_grad()
        opt.backward(model(torch.randn(2, 5).half()).float().mean())
        for _ in range(micro):
            opt.step()
        assert opt.applied_steps == 1, f"stage {stage}: opt.backward after the refusal did not train"
    model = nn.Linear(5, 3)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage)
    model(torch.randn(2, 5)).mean().backward()
    opt.step()
    assert opt.applied_steps == 1


def test_backward_takes_deepspeeds_scale_wrt_gas_true_and_refuses_false() -> None:
    """A DeepSpeed loop's engine.backward(loss, scale_wrt_gas=...) translated to opt.backward: True (DeepSpeed's
    default) trains as without it; False, whose gradients DeepSpeed leaves undivided, was passed on to
    Tensor.backward, which failed with 'unexpected keyword argument'; it is refused saying what to pass instead."""
    weights = []
    for kwargs in ({}, {"scale_wrt_gas": True}):
        torch.manual_seed(0)
        model = nn.Linear(5, 3).half()
        fp16 = {"enabled": True, "initial_scale_power": 4}
        opt = zo.ShardedFusedAdam(model, lr=LR, stage=1, fp16=fp16, gradient_accumulation_steps=2)
        for k in range(2):
            opt.backward(model(torch.randn(2, 5, generator=torch.Generator().manual_seed(k)).half()).float().sum(),
                         **kwargs)  # fmt: skip
            opt.step()
        weights.append(model.weight.detach().clone())
    assert opt.applied_steps == 1 and torch.equal(*weights)
    with pytest.raises(ValueError, match=r"scale_wrt_gas=False .* pass loss \* optimizer.gradient_accumulation_steps"):
        opt.backward(model(torch.randn(2, 5).half()).float().sum(), scale_wrt_gas=False)


@pytest.mark.parametrize("fp16", [False, True])
def test_backward_takes_scale_wrt_gas_false_without_accumulation(fp16: bool) -> None:
    """With gradient_accumulation_steps 1 nothing is divided, so DeepSpeed's scale_wrt_gas=False changes nothing
    there and a loop passing it always (its own scaling) trains; it was refused as at every other accumulation."""
    weights = []
    for kwargs in ({}, {"scale_wrt_gas": False}):
        torch.manual_seed(0)
        model = nn.Linear(5, 3).half() if fp16 else nn.Linear(5, 3)
        extra = {"fp16": {"enabled": True, "initial_scale_power": 4}} if fp16 else {}
        opt = zo.ShardedFusedAdam(model, lr=LR, stage=1, gradient_accumulation_steps=1, **extra)
        x = torch.randn(2, 5, generator=torch.Generator().manual_seed(1)).to(model.weight.dtype)
        opt.backward(model(x).float().sum(), **kwargs)
        opt.step()
        weights.append(model.weight.detach().clone())
    assert opt.applied_steps == 1 and torch.equal(*weights)


def test_fp16_overflow_at_the_minimum_scale_raises_and_changes_nothing() -> None:
    """DeepSpeed stops the run on an overflow at ``min_loss_scale``; skipping every step from then on would
    train nothing, silently."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3).half()
    fp16 = dict(enabled=True, loss_scale=0, initial_scale_power=3, hysteresis=2, min_loss_scale=4.0)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=0, fp16=fp16)
    before = [p.detach().clone() for p in model.parameters()]
    scales = []
    for step in range(2):
        x = torch.randn(2, 5).half()
        x[0, 0] = math.inf
        opt.backward(model(x).float().sum())
        opt.step()
        scales.append(opt.loss_scale)
    assert scales == [8.0, 4.0] and opt.skipped_steps == 2
    opt.backward(model(torch.full((2, 5), math.inf).half()).float().sum())
    with pytest.raises(LossScaleError, match="overflowed at the minimum loss scale 4 .*min_loss_scale"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "an overflowing step changed params"
    assert opt.loss_scale == 4.0 and opt.skipped_steps == 3 and opt.pipeline.steps == {0: 0, 1: 0}


FP16_SKIPS = dict(enabled=True, loss_scale=0, initial_scale_power=3, hysteresis=2)


def _skipping(stage: int) -> tuple[nn.Module, zo.ShardedFusedAdam]:
    """An fp16 model and its optimizer after 4 steps, the 2nd and 3rd skipped (inf gradients)."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3).half()
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage, fp16=FP16_SKIPS)
    for step in range(4):
        x = torch.randn(2, 5).half()
        if step in (1, 2):
            x[0, 0] = math.inf
        opt.backward(model(x).float().sum())
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("stage", STAGES)
def test_skipped_steps_are_restored_by_load_state_dict(stage: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """As DeepSpeed's checkpoint restores ``skipped_steps``; ``applied_steps`` stays this object's own count; a
    state dict saved before the field was kept loads as before (the count left as it is)."""
    _, opt = _skipping(stage)
    assert (opt.skipped_steps, opt.applied_steps) == (2, 2)
    saved = opt.state_dict()
    model2 = nn.Linear(5, 3).half()
    opt2 = zo.ShardedFusedAdam(model2, lr=LR, stage=stage, fp16=FP16_SKIPS)
    opt2.skipped_steps = 5
    opt2.load_state_dict(saved)
    assert (opt2.skipped_steps, opt2.applied_steps) == (2, 0), f"stage {stage}"
    opt2.backward(model2(torch.full((2, 5), math.inf).half()).float().sum())
    opt2.step()
    assert opt2.skipped_steps == 3, f"stage {stage}: the next skip counts on from the restored value"
    monkeypatch.setattr(StepResult, "ready", lambda self: False)  # as on a GPU: the step's flag still in flight
    opt2.backward(model2(torch.full((2, 5), math.inf).half()).float().sum())
    opt2.step()
    opt2.skipped_steps = 10  # the skip of that step, not yet counted, counts before the new value
    assert opt2.skipped_steps == 10, f"stage {stage}"
    old = copy.deepcopy(saved)
    del old["zero_kernels.sharded"]["skipped_steps"]
    opt3 = zo.ShardedFusedAdam(nn.Linear(5, 3).half(), lr=LR, stage=stage, fp16=FP16_SKIPS)
    opt3.load_state_dict(old)
    assert opt3.skipped_steps == 0 and opt3.loss_scale == opt.loss_scale
    for bad in (-1, 2.0, True):
        wrong = copy.deepcopy(saved)
        wrong["zero_kernels.sharded"]["skipped_steps"] = bad
        with pytest.raises(ValueError, match=r"\['skipped_steps'\] must be an integer >= 0, got"):
            opt3.load_state_dict(wrong)
    assert opt3.skipped_steps == 0, "a refused load changed skipped_steps"
    for bad in (-1, 2.5, "3", True, torch.tensor([1, 2])):
        with pytest.raises(ValueError, match=r"^skipped_steps must be an integer >= 0, got"):
            opt3.skipped_steps = bad
    assert opt3.skipped_steps == 0, "a refused value changed skipped_steps"
    for good in (np.int64(4), torch.tensor(3)):
        opt3.skipped_steps = good
        assert opt3.skipped_steps == int(good) and type(opt3.skipped_steps) is int


def test_fp16_true_false_and_wrong_types() -> None:
    """``fp16=True`` is DeepSpeed's dynamic loss scaling with its defaults (it used to fail with an AttributeError on
    the bool), False none; a dict of fields is on unless it says ``"enabled": False`` (without the key it used to be
    off, without a word); another type is a TypeError naming ``fp16`` and what it takes."""
    on = zo.ShardedFusedAdam(nn.Linear(2, 2).half(), lr=LR, fp16=True)
    assert on.loss_scaler is not None and on.loss_scale == 2.0**16
    assert zo.ShardedFusedAdam(nn.Linear(2, 2), lr=LR, fp16=False).loss_scaler is None
    fields = zo.ShardedFusedAdam(nn.Linear(2, 2).half(), lr=LR, fp16={"initial_scale_power": 8})  # on: it was off
    assert fields.loss_scaler is not None and fields.loss_scale == 2.0**8
    assert zo.ShardedFusedAdam(nn.Linear(2, 2), lr=LR, fp16={"enabled": False}).loss_scaler is None
    with pytest.raises(TypeError, match=r"fp16 must be an FP16Config, a dict .* True, False or None; got str"):
        zo.ShardedFusedAdam(nn.Linear(2, 2), lr=LR, fp16="yes")
