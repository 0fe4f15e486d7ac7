"""The ``torch.optim.Optimizer`` contract, modelled on PyTorch's own optimizer tests
(``test/test_optim.py``, ``torch/testing/_internal/common_optimizers.py``): hooks, deepcopy, pickle,
``opt.state``, AdamW's arguments and error inputs, state-dict numbering; then AMSGrad and maximize
per param group at every stage on 1-3 gloo ranks, in lock-step with ``torch.optim.AdamW``.

Where a behaviour is AdamW's, the test runs the same script on ``torch.optim.AdamW`` and compares
(hook traces, error messages, state-dict indices). Stage 3 frees parameters between uses, so
parameters are read inside ``opt.gathered_params()``.
"""

from __future__ import annotations

import copy
import io
import pickle
import re
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import zero_kernels as zk
import zero_kernels.optim as zo
from tests.helpers.check import assert_close
from tests.helpers.lockstep import (
    BUCKET,
    LR,
    ROWS,
    STAGES,
    WORLD_SIZES,
    Net,
    batch,
    compare,
    deep_and_pickled_copies,
    extra_rows,
    local,
    make_models,
)
from zero_kernels.optim_copy import Origin
from zero_kernels.optim_state import FORMAT

ADAMW_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def flag_groups(m: Net) -> list[dict[str, Any]]:
    """AMSGrad in one group, maximize in another, both in the third, as AdamW takes them."""
    return [
        {"params": [m.emb.weight, m.tiny, m.mid.bias], "amsgrad": True},
        {"params": [m.emb.bias, m.frozen, m.extra.weight, m.extra.bias], "maximize": True, "weight_decay": 0.2},
        {"params": [m.mid.weight, m.head.weight, m.head.bias], "amsgrad": True, "maximize": True},
    ]


def make(stage: int, dtype: torch.dtype = torch.float32, **kwargs: Any) -> tuple[Net, zo.ShardedFusedAdam, Net, Any]:
    """(model, ours, fp32 reference model, torch AdamW on it), identical start, flag groups."""
    model, ref = make_models(dtype)
    opt = zo.ShardedFusedAdam(flag_groups(model), lr=LR, stage=stage, reduce_bucket_size=BUCKET, module=model, **kwargs)
    return model, opt, ref, torch.optim.AdamW(flag_groups(ref), lr=LR)


def train(model: Net, opt: Any, rank: int, world: int, stage: int, steps: range, ref: Any = None, ropt: Any = None):
    """Steps on this rank's rows (and, with ``ref``, AdamW on the whole batch); compares after each."""
    for step in steps:
        x, span = batch(step, world * ROWS), extra_rows(step, world)
        model(x[rank * ROWS : (rank + 1) * ROWS].to(model.emb.weight.dtype), local(span, rank, stage)).backward()
        opt.step()
        opt.zero_grad()
        if ref is not None:
            ref(x, span).backward()
            ropt.step()
            ropt.zero_grad()
            with opt.gathered_params():
                compare(model, ref, f"stage {stage} step {step}")


def same_params(a: nn.Module, opt_a: Any, b: nn.Module, opt_b: Any, what: str) -> None:
    with opt_a.gathered_params(), opt_b.gathered_params():
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p, q), f"{what}: {name} differs"


def check_state_like_adamw(opt: zo.ShardedFusedAdam, ropt: Any, what: str) -> None:
    """full_state_dict() entry by entry against AdamW's state_dict(), and the groups' AdamW keys."""
    ours, theirs = opt.full_state_dict(), ropt.state_dict()
    assert sorted(ours["state"]) == sorted(theirs["state"]), f"{what}: state indices"
    for index, entry in theirs["state"].items():
        mine = ours["state"][index]
        assert sorted(mine) == sorted(entry), f"{what}: state[{index}] keys {sorted(mine)} vs {sorted(entry)}"
        assert float(mine["step"]) == float(entry["step"]), f"{what}: state[{index}] step"
        for key in ADAMW_STATE:
            if key in entry:
                scale = entry[key].abs().max().item()
                assert_close(mine[key], entry[key], rtol=1e-5, atol=1e-6 * scale, what=f"{what} state[{index}] {key}")
    for g, (mine, group) in enumerate(zip(ours["param_groups"], theirs["param_groups"])):
        assert set(group) <= set(mine), f"{what}: group {g} lacks {set(group) - set(mine)}"
        for key in ("amsgrad", "maximize", "params", "weight_decay", "decoupled_weight_decay"):
            assert mine[key] == group[key], f"{what}: group {g} {key} {mine[key]} vs {group[key]}"


# ---------------------------------------------------------------- hooks
def hook_script(opt: Any, params: list[nn.Parameter]) -> list:
    """PyTorch's state-dict and step hook checks as one trace; run on AdamW and on us, the traces must match."""
    events: list = []

    def post(o: Any, sd: dict) -> dict:
        events.append(("post", "test" in sd["state"]))
        sd["state"].pop("test", None)
        sd["ran_state_dict_pre_hook"] = True
        return sd

    def load_pre_in_place(o: Any, sd: dict) -> None:
        events.append("load_pre1")
        sd["param_groups"][0]["lr"] = 0.002

    def load_pre_replace(o: Any, sd: dict) -> dict:
        events.append(("load_pre2", sd["param_groups"][0]["lr"]))
        replaced = copy.deepcopy(sd)
        replaced["param_groups"][0]["lr"] = 0.003
        return replaced

    def load_post(o: Any) -> None:
        events.append(("load_post", o.param_groups[0]["lr"]))
        o.state["ran_load_state_dict_post_hook"] = True

    handles = [
        opt.register_state_dict_pre_hook(lambda o: events.append("pre_second")),
        opt.register_state_dict_pre_hook(lambda o: events.append("pre_first"), prepend=True),
        opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__("test", 1)),
        opt.register_state_dict_post_hook(post),
        opt.register_state_dict_post_hook(lambda o, sd: events.append("post_first"), prepend=True),
        opt.register_load_state_dict_pre_hook(load_pre_in_place),
        opt.register_load_state_dict_pre_hook(load_pre_replace),
        opt.register_load_state_dict_post_hook(load_post),
        opt.register_load_state_dict_pre_hook(lambda o, sd: events.append("load_pre0"), prepend=True),
        opt.register_step_pre_hook(lambda o, args, kwargs: events.append("step_pre")),
        opt.register_step_post_hook(lambda o, args, kwargs: events.append("step_post")),
    ]
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    events.append(("ran", sd.get("ran_state_dict_pre_hook"), "test" in sd["state"], "test" in opt.state))
    opt.load_state_dict(sd)
    events.append(("loaded", opt.param_groups[0]["lr"], sd["param_groups"][0]["lr"], dict(opt.state.items()).get(
        "ran_load_state_dict_post_hook")))  # fmt: skip
    for h in handles:
        h.remove()
    opt.state_dict()
    opt.step()
    return events


def test_hooks_run_in_torch_order() -> None:
    params = [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(2))]
    for stage in (0, 1, 2):
        fresh = [nn.Parameter(p.detach().clone()) for p in params]
        ours = hook_script(zo.ShardedFusedAdam(fresh, lr=LR, stage=stage), fresh)
        adamw_params = [nn.Parameter(p.detach().clone()) for p in params]
        expected = hook_script(torch.optim.AdamW(adamw_params, lr=LR), adamw_params)
        assert ours == expected, f"stage {stage}: hook trace {ours} != AdamW's {expected}"
        assert expected[:2] == ["step_pre", "step_post"] and ("ran", True, False, True) in expected, expected
        assert ("load_post", 0.003) in expected and expected.count("step_pre") == 1, expected


def accumulated_ema(opt: torch.optim.Optimizer, params: list[nn.Parameter], micro_steps: int) -> tuple[list, Any]:
    """Three updates of ``micro_steps`` backward passes each, ``step()`` after every ``micro_steps``-th one (``opt``'s
    step is called after each when it counts them itself); step hooks trace their calls and keep an EMA."""
    trace: list[str] = []
    ema: list[torch.Tensor] = []

    def post(o: Any, args: Any, kwargs: Any) -> None:
        trace.append("post")
        for i, p in enumerate(params):
            ema.append(p.detach().clone()) if len(ema) < len(params) else ema[i].lerp_(p.detach(), 0.5)

    handles = [
        opt.register_step_pre_hook(lambda o, args, kwargs: trace.append("pre")),
        opt.register_step_post_hook(post),
        register_optimizer_step_pre_hook(lambda o, args, kwargs: trace.append("global_pre") if o is opt else None),
    ]
    counts = getattr(opt, "gradient_accumulation_steps", 1) > 1
    for step in range(3 * micro_steps):
        for k, p in enumerate(params):
            g = torch.full_like(p, 0.1 * (step + 1) + k)
            p.grad = g if p.grad is None else p.grad + g
        if counts or (step + 1) % micro_steps == 0:
            opt.step()
        if (step + 1) % micro_steps == 0:
            opt.zero_grad()
    for h in handles:
        h.remove()
    return trace, ema


def profiled_names(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[str]:
    """The ``Optimizer.*`` records a profiler sees around a step and a zero_grad."""
    for p in params:
        p.grad = torch.ones_like(p)
    with torch.profiler.profile() as prof:
        opt.step()
        opt.zero_grad()
    return sorted({e.name for e in prof.events() if e.name.startswith("Optimizer.")})


@pytest.mark.parametrize("stage", (0, 1, 2))
def test_profiler_records_step_and_zero_grad_as_torch(stage: int) -> None:
    """``Optimizer.step#<class>.step`` and ``Optimizer.zero_grad#<class>.zero_grad``, as torch's optimizers record
    them (zero_grad had no record)."""
    params = [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(2))]
    ours = profiled_names(zo.ShardedFusedAdam(params, lr=LR, stage=stage), params)
    expected = profiled_names(torch.optim.AdamW(params, lr=LR), params)
    assert [n.replace("AdamW", "ShardedFusedAdam") for n in expected] == ours, (ours, expected)


@pytest.mark.parametrize("stage", (0, 1, 2))
def test_step_hooks_run_at_updates_only(stage: int) -> None:
    """With ``gradient_accumulation_steps`` the step hooks (the optimizer's and torch's global ones) run around the
    calls that update, once per update as around AdamW's ``step()`` after its accumulated backward passes: they ran
    at every micro-step, so an EMA kept in a post-hook was averaged with the unchanged weights as well."""
    params = [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(2))]
    fresh = [nn.Parameter(p.detach().clone()) for p in params]
    ours = accumulated_ema(zo.ShardedFusedAdam(fresh, lr=LR, stage=stage, gradient_accumulation_steps=2), fresh, 2)
    adamw_params = [nn.Parameter(p.detach().clone()) for p in params]
    expected = accumulated_ema(torch.optim.AdamW(adamw_params, lr=LR), adamw_params, 2)
    assert expected[0] == ["global_pre", "pre", "post"] * 3, expected[0]
    assert ours[0] == expected[0], f"stage {stage}: hook trace {ours[0]} != AdamW's {expected[0]}"
    for a, b in zip(ours[1], expected[1]):
        assert_close(a, b, rtol=1e-5, atol=1e-6, what=f"stage {stage}: EMA kept by a step post-hook")


@pytest.mark.parametrize("stage", (0, 1, 3))
def test_step_hooks_with_a_closure_and_lr_0_run_at_updates_only(stage: int) -> None:
    """``step(closure)`` on the first micro-step with every lr 0 (a warmup from 0): the hooks ran as around a
    state-making call (no gradient yet when they were decided, the closure's backward not run), so over 2 updates of
    2 micro-steps a post-hook ran 3 times."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = zo.ShardedFusedAdam(model, lr=0.0, stage=stage, gradient_accumulation_steps=2)
    calls = []
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(o.applied_steps))
    x = torch.randn(3, 4)

    def closure() -> torch.Tensor:
        loss = model(x).sum()
        loss.backward()
        return loss

    for step in range(4):
        opt.step(closure)
        if step % 2 == 1:
            opt.zero_grad()
    assert calls == [1, 2], calls


# ---------------------------------------------------------------- copies
@pytest.mark.parametrize("stage", (1, 3))
def test_compiled_step_runs_eagerly_as_adamw(stage: int) -> None:
    """PyTorch's "compiling the optimizer" recipe: torch.compile around opt.step() runs the step eagerly (stage
    3's freed parameters never reach Dynamo), with its hooks, and trains as AdamW."""
    torch._dynamo.reset()
    model, ref = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(
        model, lr=LR, stage=stage, reduce_bucket_size=BUCKET, stage3_param_persistence_threshold=0
    )
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    compiled = torch.compile(lambda: opt.step(), backend="eager")
    for step in range(3):
        x, span = batch(step, ROWS), extra_rows(step, 1)
        model(x, span).backward()
        ref(x, span).backward()
        compiled()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
        with opt.gathered_params():
            compare(model, ref, f"stage {stage} compiled step {step}")
    assert calls == ["pre"] * 3, calls


def public_attrs(obj: Any) -> set[str]:
    return {k for k in obj.__dict__ if not k.startswith("_")}


def copy_cases(stage: int) -> None:
    model, opt, _, _ = make(stage, max_grad_norm=10.0, gradient_accumulation_steps=1)
    train(model, opt, 0, 1, stage, range(2))
    opt.state["note"] = "kept"
    (model2, opt2), (model3, opt3) = deep_and_pickled_copies(model, opt, stage).values()
    assert public_attrs(opt2) == public_attrs(opt), f"stage {stage}: deepcopy attrs"
    for key in ("options", "adam_w_mode", "max_grad_norm", "gradient_accumulation_steps", "defaults"):
        assert getattr(opt2, key) == getattr(opt, key), f"stage {stage}: deepcopy {key}"
    assert opt2.state["note"] == "kept" and len(opt2.state) == len(opt.state)
    assert not opt2._optimizer_step_pre_hooks, "hooks are not copied (as torch)"
    assert public_attrs(opt3) == public_attrs(opt), f"stage {stage}: pickled attrs"
    for m, o in ((model, opt), (model2, opt2), (model3, opt3)):
        train(m, o, 0, 1, stage, range(2, 4))
    same_params(model, opt, model2, opt2, f"stage {stage} deepcopy")
    same_params(model, opt, model3, opt3, f"stage {stage} torch.save/load")
    for o in (opt2, opt3):
        mine, theirs = opt.full_state_dict()["state"], o.full_state_dict()["state"]
        assert mine.keys() == theirs.keys() and theirs["note"] == "kept", f"stage {stage}: state keys of a copy"
        for index in (k for k in mine if k != "note"):
            assert all(torch.equal(mine[index][k], theirs[index][k]) for k in mine[index]), f"stage {stage}: state"
    with opt.gathered_params():
        before = [p.detach().clone() for p in model.parameters()]
    train(model2, opt2, 0, 1, stage, range(4, 5))
    with opt.gathered_params():
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "a copy's step changed the original"


@pytest.mark.parametrize("stage", STAGES)
def test_deepcopy_and_pickle_give_working_optimizers(stage: int) -> None:
    copy_cases(stage)


def test_unpickling_on_another_rank_is_refused() -> None:
    _, opt, _, _ = make(1)
    data = io.BytesIO()
    torch.save(opt, data)
    data.seek(0)
    state = torch.load(data, weights_only=False).__getstate__()
    state["origin"] = Origin(rank=1, world_size=2)  # as if saved on rank 1 of 2
    with pytest.raises(RuntimeError, match="saved on rank 1 of 2 .* this process is rank 0 of 1"):
        zo.ShardedFusedAdam.__new__(zo.ShardedFusedAdam).__setstate__(state)


# ---------------------------------------------------------------- opt.state
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_state_holds_current_views_of_the_shards(dtype: torch.dtype) -> None:
    for stage in STAGES:
        model, opt, ref, ropt = make(stage, dtype)
        assert len(opt.state) == 0 and model.emb.weight not in opt.state and opt.state[model.emb.weight] == {}
        train(model, opt, 0, 1, stage, range(2), *((ref, ropt) if dtype == torch.float32 else ()))
        named = dict(model.named_parameters())
        views = {n: opt.state[p] for n, p in named.items() if p in opt.state}
        trainable = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        assert "frozen" not in views and list(opt.state) == trainable, f"stage {stage}: keys"
        amsgrad = {id(p) for g in opt.param_groups if g["amsgrad"] for p in g["params"]}
        for (name, p), r in zip(named.items(), ref.parameters()):
            if name == "frozen":
                continue
            st, shape = views[name], tuple(opt.pipeline.param_shape(p))
            expected = {"step", "exp_avg", "exp_avg_sq"} | ({"master"} if dtype != torch.float32 else set())
            expected |= {"max_exp_avg_sq"} if id(p) in amsgrad else set()
            assert set(st) == expected, f"stage {stage} {name}: keys {set(st)}"
            b, _ = opt.pipeline.where[id(p)]
            buf = opt.pipeline.buffers[b]
            for key in set(st) - {"step"}:
                t = st[key]
                assert tuple(t.shape) == shape, f"stage {stage} {name} {key}: shape {tuple(t.shape)} (one rank)"
                assert t.untyped_storage().data_ptr() == getattr(buf, key).untyped_storage().data_ptr(), "a copy"
            if dtype == torch.float32:
                for key in set(st) & set(ADAMW_STATE):
                    scale = ropt.state[r][key].abs().max().item()
                    assert_close(st[key], ropt.state[r][key], rtol=1e-5, atol=1e-6 * scale, what=f"{name} {key}")
                assert float(st["step"]) == float(ropt.state[r]["step"])
        if dtype != torch.float32:
            continue
        held = views["mid.weight"]
        held["exp_avg"].zero_()  # written through to the shard, as on AdamW's tensors
        opt.state[named["head.weight"]]["exp_avg_sq"] = torch.zeros(1, 5)  # assigning copies into the shard
        ropt.state[ref.mid.weight]["exp_avg"].zero_()
        ropt.state[ref.head.weight]["exp_avg_sq"] = torch.zeros(1, 5)
        train(model, opt, 0, 1, stage, range(2, 4), ref, ropt)
        assert_close(held["exp_avg"], ropt.state[ref.mid.weight]["exp_avg"], rtol=1e-5, atol=1e-9, what="current")
        assert float(held["step"]) == 2.0 and float(opt.state[named["mid.weight"]]["step"]) == 4.0


# ---------------------------------------------------------------- arguments
def _error(fn: Callable[[], Any]) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def test_adamw_arguments() -> None:
    """AdamW's keywords at their defaults and foreach/fused at any value: accepted, same training as without."""
    for kwargs in (dict(foreach=None, fused=None, differentiable=False, capturable=False, amsgrad=False,
                        maximize=False), dict(foreach=True, fused=False), dict(foreach=False, fused=True)):  # fmt: skip
        positional = kwargs.pop("amsgrad", None)  # AdamW's sixth positional argument
        kwargs = kwargs if positional is None else {**kwargs, "amsgrad": positional}
        model, ref = make_models(torch.float32)
        opt = zo.ShardedFusedAdam(model, LR, (0.9, 0.999), 1e-8, 1e-2, **kwargs)
        ropt = torch.optim.AdamW(ref.parameters(), LR, (0.9, 0.999), 1e-8, 1e-2, **kwargs)
        assert all(opt.param_groups[0][k] == ropt.param_groups[0][k] for k in kwargs), kwargs
        train(model, opt, 0, 1, 1, range(2), ref, ropt)
    model, ref = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(model, lr=torch.tensor(LR), betas=(torch.tensor(0.9), torch.tensor(0.999)))
    ropt = torch.optim.AdamW(ref.parameters(), lr=torch.tensor(LR), betas=(torch.tensor(0.9), torch.tensor(0.999)))
    train(model, opt, 0, 1, 1, range(2), ref, ropt)


def test_error_inputs_match_adamw() -> None:
    """PyTorch's error inputs for AdamW: the same error type and message where AdamW raises."""
    p, q = nn.Parameter(torch.randn(1, 1)), nn.Parameter(torch.randn(1, 1))
    same = [
        (p, {}),
        ([p], dict(lr=torch.tensor([0.001, 0.001]))),
        ([p], dict(lr=1e-2, betas=(1.0, 0.0))),
        ([p], dict(lr=1e-2, weight_decay=-1)),
        ([p], dict(lr=1e-2, betas=(0.9, torch.tensor(0.99)))),
        ([p], dict(lr=1e-2, betas=(torch.tensor(0.9), 0.99))),
        ([("weight", p), q], {}),
        ([{"params": [p], "lr": 1e-2}, {"params": [("weight", q)]}], {}),
        ([{"params": [("weight", p)]}, {"params": [q]}], {}),
        ([{"params": {p, q}}], {}),
        ([p, 3.0], {}),
        ([p * 2], {}),
        ([], {}),
        (None, {}),  # AdamW: TypeError from list(None); was AttributeError here (None taken for the module)
        # refused by AdamW before the parameters are read (foreach has no effect here, but the input is refused)
        (None, dict(lr=torch.tensor(0.001), foreach=True)),
        ([p], dict(lr=torch.tensor(0.001), foreach=True)),
        (None, dict(lr=0.001, betas=(torch.tensor(0.9), torch.tensor(0.99)), foreach=True)),
        ([p], dict(betas=(torch.tensor(0.9), torch.tensor(0.99)), foreach=True)),
    ]
    for params, kwargs in same:
        ours = _error(lambda: zo.ShardedFusedAdam(params, **kwargs))
        theirs = _error(lambda: torch.optim.AdamW(params, **kwargs))
        assert (type(ours), str(ours)) == (type(theirs), str(theirs)), f"{kwargs}: {ours!r} vs AdamW's {theirs!r}"


def test_error_inputs_refused_at_construction() -> None:
    """Inputs AdamW accepts or fails on later: refused here at construction, naming the argument or parameter."""
    model = Net()
    w, b = model.emb.weight, model.emb.bias
    cases = [
        (dict(params_or_module=[w, b, w]), ValueError,
         "duplicate parameters: parameter 'emb.weight' appears twice in param group 0"),
        (dict(params_or_module=[{"params": [w]}, {"params": [b, w]}]), ValueError,
         "some parameters appear in more than one parameter group: parameter 'emb.weight' is in param groups 0 and 1"),
        (dict(process_group="gloo"), TypeError, "process_group must be a torch.distributed ProcessGroup.*'gloo'"),
        (dict(impl="cuda"), ValueError, r"impl='cuda' is not a kernel backend; allowed: auto, triton, cpu, torch"),
        (dict(differentiable=True), ValueError, "differentiable=True is not supported"),
        (dict(capturable=True), ValueError, "capturable=True is not supported"),
        # AdamW takes a tensor lr with foreach=True where capturable=True: refused for capturable, not for
        # "capturable=False and foreach=True"
        (dict(lr=torch.tensor(0.001), foreach=True, capturable=True), ValueError, "capturable=True is not supported"),
        (dict(amsgrad="yes"), ValueError, "amsgrad must be True or False \\(or 0, 1\\), got 'yes'"),
        (dict(params_or_module=[{"params": [w]}, {"params": [b], "maximize": 2}]), ValueError,
         "param group 1: maximize must be True or False"),
        (dict(params_or_module=[{"params": [w]}, {"params": [b], "capturable": True}]), ValueError,
         "param group 1: capturable=True is not supported"),
        (dict(foreach="yes"), ValueError, "foreach must be None, True or False"),
        (dict(params_or_module=[nn.Parameter(torch.randn(3, dtype=torch.float64))]), ValueError,
         "trains float32, bfloat16, float16 parameters; a parameter of shape \\(3,\\) is float64"),
        (dict(params_or_module=[nn.Parameter(torch.randn(3, dtype=torch.complex64))]), ValueError,
         "does not support complex parameters"),
        (dict(params_or_module=[nn.Parameter(torch.randn(3).to_sparse())]), ValueError,
         "does not support sparse parameters"),
        (dict(params_or_module=[("a", w), ("x", nn.Parameter(torch.ones(3).expand(4, 3)))]), ValueError,
         r"cannot train parameter 'x'.*: it is expanded \(stride \(0, 1\)\)"),
        (dict(params_or_module=[("a", w), ("b", nn.Parameter(torch.randn(3, device="meta")))]), ValueError,
         "parameters on two devices: parameter 'emb.weight' is on cpu, parameter 'b' on meta"),
        (dict(params_or_module=[("a", nn.Parameter(torch.randn(3, device="meta")))]), ValueError,
         "parameter 'a' is on the meta device \\(it has none\\). Materialize the model first"),
        (dict(params_or_module=[("a", w), ("h", nn.Parameter(w.data[1:3]))]), ValueError,
         "parameter 'emb.weight' and parameter 'h' share memory .* which would untie them"),
    ]  # fmt: skip
    for kwargs, kind, message in cases:
        kwargs = {"params_or_module": list(model.parameters()), **kwargs}
        for stage in (1, 3):
            extra = {"module": model}  # names the parameters in errors at every stage
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # an error, not torch's duplicate-parameter warning
                with pytest.raises(kind, match=message):
                    zo.ShardedFusedAdam(**kwargs, stage=stage, **extra)
            hooks = getattr(w, "_post_accumulate_grad_hooks", None)
            assert not model._forward_pre_hooks and not hooks and w.shape == (11, 6), f"stage {stage}: {message}"


class _ComplexAsReal(nn.Module):
    """A complex weight kept as real pairs (the complex refusal's advice) next to an odd-sized parameter, so that the
    flat buffer puts it at an odd storage offset (where ``torch.view_as_complex`` refuses it)."""

    def __init__(self, weight: torch.Tensor, real: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.view_as_real(weight).clone() if real else weight.clone())
        self.d = nn.Parameter(torch.linspace(-1.0, 1.0, 5))
        self.real = real

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.complex(self.w[..., 0], self.w[..., 1]) if self.real else self.w
        return ((x[:, :4] * w).abs().square().sum() + (self.d * x).sum()).square()


@pytest.mark.parametrize("stage", STAGES)
def test_complex_refusal_s_advice_trains_as_adamw_on_the_complex_parameter(stage: int) -> None:
    weight = torch.randn(4, dtype=torch.complex64, generator=torch.Generator().manual_seed(3))
    model, ref = _ComplexAsReal(weight, real=True), _ComplexAsReal(weight, real=False)
    with pytest.raises(ValueError, match=r"complex parameters.*torch\.complex\(w\[\.\.\., 0\], w\[\.\.\., 1\]\)"):
        zo.ShardedFusedAdam(ref, lr=LR, stage=stage)
    opt = zo.ShardedFusedAdam(model, lr=LR, weight_decay=0.1, stage=stage, stage3_param_persistence_threshold=0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    for step in range(3):
        x = batch(step, 2)[:, :5]
        model(x).backward()
        ref(x).backward()
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
        with opt.gathered_params():
            w = torch.view_as_real(ref.w.detach())
            assert_close(model.w, w, rtol=1e-5, atol=1e-6 * w.abs().max().item(), what=f"stage {stage} step {step}")


def test_set_of_parameters_on_one_process_as_adamw() -> None:
    """A top-level set of parameters: AdamW takes it (list(params)); so does one process, with AdamW's results."""
    for stage in (1, 3):
        model, ref = make_models(torch.float32)
        opt = zo.ShardedFusedAdam(set(model.parameters()), lr=LR, stage=stage, reduce_bucket_size=BUCKET, module=model)
        train(model, opt, 0, 1, stage, range(2), ref, torch.optim.AdamW(set(ref.parameters()), lr=LR))


def set_case(rank: int, world: int) -> None:
    """On several ranks a set's order differs between processes: refused, saying why and what to pass."""
    model, _ = make_models(torch.float32)
    for stage in STAGES:
        for kind in (set, frozenset):
            message = rf"params is a {kind.__name__}: its order .* differs between the {world} processes"
            message += r".*pass a list, model\.parameters\(\)"
            with pytest.raises(TypeError, match=message):
                zo.ShardedFusedAdam(kind(model.parameters()), lr=LR, stage=stage, module=model)
            assert not model._forward_pre_hooks, f"stage {stage}: hooks left by a refused construction"


@pytest.mark.distributed
def test_set_of_parameters_refused_on_ranks(spawn) -> None:
    spawn(set_case, 2)


def test_flags_as_adamw_takes_them() -> None:
    """0, 1 and numpy's booleans are booleans to AdamW: the same here, with the same results."""
    np = pytest.importorskip("numpy")
    for value in (0, 1, np.True_, np.False_):
        torch.manual_seed(0)
        ours, theirs = Net(), Net()
        theirs.load_state_dict(ours.state_dict())
        opt = zo.ShardedFusedAdam(ours, lr=0.1, amsgrad=value, maximize=value, stage=1)
        ref = torch.optim.AdamW(theirs.parameters(), lr=0.1, amsgrad=bool(value), maximize=bool(value))
        for model, o in ((ours, opt), (theirs, ref)):
            model(batch(0, ROWS)).backward()
            o.step()
        for a, b in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_group_s_betas_may_mix_a_float_and_a_tensor_as_in_adamw() -> None:
    """torch asks both betas to be floats or both tensors of the constructor's ``betas`` only: a group added with a
    float beside a tensor, and a client whose tensor betas ``OneCycleLR`` turned into such a pair, train as AdamW."""
    torch.manual_seed(0)
    ours, theirs = Net(), Net()
    theirs.load_state_dict(ours.state_dict())
    t = torch.tensor
    built = []
    for model, make in ((ours, zo.ShardedFusedAdam), (theirs, torch.optim.AdamW)):
        params = list(model.parameters())
        opt = make(params[:2], lr=t(0.05), betas=(t(0.9), t(0.99)))
        opt.add_param_group({"params": params[2:], "betas": (0.8, t(0.95))})
        built.append((model, opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=5)))
    small = nn.Linear(3, 2)
    client = torch.optim.AdamW(small.parameters(), lr=t(0.05), betas=(t(0.9), t(0.99)))
    torch.optim.lr_scheduler.OneCycleLR(client, max_lr=0.1, total_steps=5)  # beta1 now a float
    zk.initialize(small, {"train_micro_batch_size_per_gpu": 1}, optimizer=client)
    for step in range(4):
        for model, opt, sched in built:
            model(batch(step, ROWS)).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("lr", "0.5", "param group 0: lr must be a number or a 1-element tensor, got '0.5'"),
        ("eps", None, "param group 0: eps must be a number"),
        ("betas", (0.9, "0.999"), "param group 0: betas must be a pair of numbers"),
        ("weight_decay", torch.ones(2), "param group 0: weight_decay must be a number or a 1-element tensor"),
        ("amsgrad", "no", "param group 0: amsgrad must be True or False"),
    ],
)
def test_group_values_set_between_steps_are_checked_at_the_step(key: str, value, message: str) -> None:
    """A value a scheduler, the user or a loaded state dict puts in a group is refused at the step, not converted;
    nothing changes, and the step runs once the value is fixed."""
    torch.manual_seed(0)
    model = Net()
    opt = zo.ShardedFusedAdam(model, lr=0.1, stage=1)
    model(batch(0, ROWS)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    good, opt.param_groups[0][key] = opt.param_groups[0][key], value
    with pytest.raises((TypeError, ValueError), match=re.escape(message.split(" got")[0])):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.param_groups[0][key] = good
    opt.step()
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_sparse_gradients_refused_with_adamw_wording() -> None:
    for stage in STAGES:
        model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
        opt = zo.ShardedFusedAdam(model, stage=stage)
        with pytest.raises(RuntimeError, match="does not support sparse gradients, please consider SparseAdam instead"):
            model(torch.tensor([1, 2, 3])).sum().backward()
        opt.zero_grad()


# ---------------------------------------------------------------- state dicts
@pytest.mark.parametrize("stage", STAGES)
def test_parameter_frozen_at_construction_then_trained_is_refused(stage: int) -> None:
    """AdamW would train it; ZeRO shards only what was trainable at construction: a loud error, not a
    parameter that silently never moves. One that stays frozen, or gets no gradient, is fine."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=stage)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    model[0].requires_grad_(True)
    opt.step()  # no gradient yet: nothing to refuse
    model(torch.randn(3, 4)).sum().backward()
    with opt.gathered_params():
        before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"parameter 0 \('0.weight', group 0\) was frozen .* nothing was updated"):
        opt.step()
    with opt.gathered_params():
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "a refused step changed weights"


def test_parameter_frozen_when_added_then_trained_is_refused_naming_the_remedy() -> None:
    """Given to add_param_group while frozen, then unfrozen: refused as at construction, and the message names
    add_param_group and a way out that works (it advised add_param_group, which refuses a parameter already held)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = zo.ShardedFusedAdam(model[1].parameters(), lr=LR, stage=2)
    model[0].requires_grad_(False)
    opt.add_param_group({"params": list(model[0].parameters())})
    model[0].requires_grad_(True)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(ValueError, match=r"at construction or add_param_group.* build the optimizer without it"):
        opt.step()


def test_state_dict_numbering_and_names_as_adamw() -> None:
    model, ref = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(model.named_parameters(), lr=LR)
    ropt = torch.optim.AdamW(ref.named_parameters(), lr=LR)
    train(model, opt, 0, 1, 1, range(1), ref, ropt)
    assert opt.state_dict()["param_groups"][0]["param_names"] == ropt.state_dict()["param_groups"][0]["param_names"]
    unnamed = zo.ShardedFusedAdam(make_models(torch.float32)[0], lr=LR)
    unnamed_ref = torch.optim.AdamW(make_models(torch.float32)[1].parameters(), lr=LR)
    unnamed.load_state_dict(opt.full_state_dict())
    unnamed_ref.load_state_dict(ropt.state_dict())
    assert unnamed.param_groups[0]["param_names"] == unnamed_ref.param_groups[0]["param_names"]
    for o in (opt, ropt):  # repeated groups: the same indices as AdamW gives them
        o.param_groups.extend(o.param_groups)
    assert [g["params"] for g in opt.state_dict()["param_groups"]] == [
        g["params"] for g in ropt.state_dict()["param_groups"]
    ]
    model, opt, ref, ropt = make(1)
    train(model, opt, 0, 1, 1, range(2), ref, ropt)
    old = ropt.state_dict()  # an older AdamW's state: no maximize/foreach keys, steps as Python floats
    for group in old["param_groups"]:
        del group["maximize"], group["foreach"]
    for entry in old["state"].values():
        entry["step"] = float(entry["step"])
    opt.load_state_dict(old)
    ropt.load_state_dict(old)
    train(model, opt, 0, 1, 1, range(2, 4), ref, ropt)


def test_loading_adamw_amsgrad_state_keeps_max_exp_avg_sq() -> None:
    for stage in STAGES:
        model, ref = make_models(torch.float32)
        ropt = torch.optim.AdamW(flag_groups(ref), lr=LR)
        train(ref, ropt, 0, 1, stage, range(2))
        with torch.no_grad():
            for p, r in zip(model.parameters(), ref.parameters()):
                p.copy_(r)
        opt = zo.ShardedFusedAdam(flag_groups(model), lr=LR, stage=stage, reduce_bucket_size=BUCKET, module=model)
        for group in opt.param_groups:
            group["amsgrad"] = group["maximize"] = False  # the state dict turns them back on
        opt.load_state_dict(ropt.state_dict())
        check_state_like_adamw(opt, ropt, f"stage {stage} after load")
        train(model, opt, 0, 1, stage, range(2, 4), ref, ropt)
        check_state_like_adamw(opt, ropt, f"stage {stage} trained after load")


# ---------------------------------------------------------------- on 1-3 ranks
def pieces_case(opt: zo.ShardedFusedAdam, full: dict, rank: int, world: int, what: str) -> None:
    """Each rank's opt.state: whole tensors where it holds a whole parameter, else its piece in shard order;
    over the ranks every element is held once (stage 0: by every rank)."""
    pipeline = opt.pipeline
    held = torch.zeros(sum(len(g["params"]) for g in opt.param_groups), dtype=torch.float64)
    for index, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        if p not in opt.state:
            continue
        st, entry = opt.state[p], full["state"][index]
        b, slot = pipeline.where[id(p)]
        layout = pipeline.buffers[b].layout
        segs = [s for s in layout.segments(pipeline.shard_rank) if s.slot == slot]
        for key in set(st) & set(ADAMW_STATE):
            flat = entry[key].reshape(-1)
            expected = torch.cat([flat[s.param_offset : s.param_offset + s.numel] for s in segs])
            if expected.numel() == flat.numel():
                expected = entry[key]
            assert torch.equal(st[key], expected), f"{what}: opt.state of parameter {index} {key}"
        held[index] = st["exp_avg"].numel()
    if world > 1:
        dist.all_reduce(held)
    numels = [pipeline.param_shape(p).numel() for g in opt.param_groups for p in g["params"]]
    copies = world if opt.pipeline.stage == 0 else 1
    for index in full["state"]:
        assert held[index] == copies * numels[index], f"{what}: parameter {index} held {held[index]} times over ranks"


def sharded_layout(state_dict: dict) -> bool:
    """Whether ``state_dict`` is a rank's shard (the whole state, in AdamW's layout, carries ``whole``)."""
    return FORMAT in state_dict and not state_dict[FORMAT].get("whole")


def same_entries(state_dict: dict, full: dict, what: str) -> None:
    for i, entry in full["state"].items():
        assert all(torch.equal(state_dict["state"][i][k], entry[k]) for k in entry), f"{what} {i}"


def ranks_case(rank: int, world: int, path: str) -> None:
    for stage in STAGES:
        what = f"world {world} stage {stage}"
        model, opt, ref, ropt = make(stage)
        train(model, opt, rank, world, stage, range(3), ref, ropt)
        check_state_like_adamw(opt, ropt, what)
        full = opt.full_state_dict()
        pieces_case(opt, full, rank, world, what)
        to = world - 1
        opt.consolidate_state_dict(to=to)
        sd = opt.state_dict()
        sharded = world > 1 and stage > 0
        if rank == to:
            assert not sharded_layout(sd) and sorted(sd["state"]) == sorted(full["state"]), what
            assert sd[FORMAT]["skipped_steps"] == opt.skipped_steps, f"{what}: consolidated skipped_steps"
            same_entries(sd, full, f"{what}: consolidated")
        else:
            assert sharded_layout(sd) == sharded, f"{what}: rank {rank} keeps its shard"
        (model2, opt2), (model3, opt3) = deep_and_pickled_copies(model, opt, stage).values()
        for m, o in ((model, opt), (model2, opt2), (model3, opt3)):
            train(m, o, rank, world, stage, range(3, 5))
        after, sd = opt.full_state_dict(), opt.state_dict()
        assert sharded_layout(sd) == sharded, f"{what}: the consolidated state outlived a step"
        if not sharded:
            same_entries(sd, after, f"{what}: the consolidated state outlived a step")
        same_params(model, opt, model2, opt2, f"{what} deepcopy")
        same_params(model, opt, model3, opt3, f"{what} torch.save/load")
        if stage in (1, 3):
            checkpoint_case(model, opt, rank, world, stage, f"{path}-{stage}")
    if world > 1:
        group_case(rank, world)


def group_case(rank: int, world: int) -> None:
    """On a process group of its own: deepcopy keeps the group; pickling is refused, saying what to do instead."""
    group = dist.new_group(list(range(world)))
    model, ref = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=2, reduce_bucket_size=BUCKET, process_group=group)
    with pytest.raises(RuntimeError, match="other than the default one cannot be pickled.*opt.state_dict()"):
        pickle.dumps(opt)
    model2, opt2 = copy.deepcopy((model, opt))
    assert opt2._engine.group is group
    for m, o in ((model, opt), (model2, opt2)):
        train(m, o, rank, world, 2, range(2))
    same_params(model, opt, model2, opt2, "deepcopy on a process group")


def checkpoint_case(model: Net, opt: zo.ShardedFusedAdam, rank: int, world: int, stage: int, path: str) -> None:
    """zk.checkpoint keeps max_exp_avg_sq, also into an optimizer built without AMSGrad; consolidate writes it."""
    zk.checkpoint.save(path, model, opt)
    fresh, _ = make_models(torch.float32)
    groups = flag_groups(fresh)
    for group in groups:
        group.pop("amsgrad", None), group.pop("maximize", None)
    opt2 = zo.ShardedFusedAdam(groups, lr=LR, stage=stage, reduce_bucket_size=BUCKET + 2, module=fresh)
    zk.checkpoint.load(path, fresh, opt2)
    a, b = opt.full_state_dict(), opt2.full_state_dict()
    assert [g["amsgrad"] for g in b["param_groups"]] == [True, False, True]
    for index, entry in a["state"].items():
        assert sorted(b["state"][index]) == sorted(entry), f"checkpoint: keys of {index}"
        assert all(torch.equal(b["state"][index][k], entry[k]) for k in entry), f"checkpoint: state {index}"
    if rank == 0:
        zk.checkpoint.consolidate(path, f"{path}.pt")
        saved = torch.load(f"{path}.pt")["optimizer"]["state"]
        assert all(torch.equal(saved[i]["max_exp_avg_sq"], e["max_exp_avg_sq"]) for i, e in a["state"].items()
                   if "max_exp_avg_sq" in e)  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"world{w}")
def test_amsgrad_maximize_state_and_copies_on_ranks(spawn, world: int, tmp_path) -> None:
    spawn(ranks_case, world, str(tmp_path / "ckpt"))


@pytest.mark.parametrize("stage", STAGES)
def test_groups_taken_from_another_optimizers_param_groups(stage: int) -> None:
    """AdamW's ``param_groups`` after named groups carry torch's ``param_names`` key in every group: a
    ``ShardedFusedAdam`` built from copies of them takes them (as AdamW does), trains as AdamW and keeps the names."""
    model, ref = make_models(torch.float32)
    named = list(model.named_parameters())
    source = torch.optim.AdamW(
        [{"params": [(n, p) for n, p in named if "bias" not in n], "weight_decay": 0.1},
         {"params": [(n, p) for n, p in named if "bias" in n], "weight_decay": 0.0}], lr=LR)  # fmt: skip
    groups = [dict(g) for g in source.param_groups]
    opt = zo.ShardedFusedAdam(groups, lr=LR, stage=stage, reduce_bucket_size=BUCKET, module=model)
    ropt = torch.optim.AdamW([dict(g, params=[dict(ref.named_parameters())[n] for n in g["param_names"]])
                              for g in source.param_groups], lr=LR)  # fmt: skip
    train(model, opt, 0, 1, stage, range(2), ref, ropt)
    assert [g["param_names"] for g in opt.state_dict()["param_groups"]] == [
        g["param_names"] for g in ropt.state_dict()["param_groups"]
    ]


def test_disjoint_slices_of_one_tensor_are_taken_overlapping_ones_refused() -> None:
    """Parameters that are interleaved but disjoint slices of one tensor (columns, every other row) are trained as
    AdamW trains them; slices that share elements are refused, naming both."""
    for cut in ((slice(None), slice(0, 4)), (slice(None), slice(4, 8))), ((slice(0, None, 2),), (slice(1, None, 2),)):
        big = torch.randn(4, 8)
        twin = big.clone()
        params = [nn.Parameter(big[c]) for c in cut]
        ref = [nn.Parameter(twin[c]) for c in cut]
        opt, ropt = zo.ShardedFusedAdam(params, lr=LR, stage=1), torch.optim.AdamW(ref, lr=LR)
        for p, r in zip(params, ref):
            p.grad, r.grad = torch.ones_like(p), torch.ones_like(r)
        opt.step()
        ropt.step()
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.detach(), r.detach())
    big = torch.randn(4, 8)
    with pytest.raises(
        ValueError, match=r"a parameter of shape \(4, 5\) and a parameter of shape \(4, 4\) share memory"
    ):
        zo.ShardedFusedAdam([nn.Parameter(big[:, :5]), nn.Parameter(big[:, 4:])], lr=LR, stage=1)
