"""``initialize(model, config, optimizer=client, lr_scheduler=scheduler_on_client)``: DeepSpeed's client optimizer.

The ``ShardedFusedAdam`` built takes the client's groups, hyper-parameters, weight-decay mode and state, and the
scheduler object built on the client steps it: training equals torch's client (with its scheduler) element by
element, at every stage and on 2 ranks.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import ExponentialLR, LambdaLR, StepLR

import zero_kernels as zk
from tests.helpers.dist import run_ranks
from tests.helpers.lockstep import BUCKET, ROWS, STAGE3, Net, batch, compare, extra_rows, local, make_models

Client = Callable[[list], torch.optim.Optimizer]


def _config(stage: int, **extra: Any) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": BUCKET, **(STAGE3 if stage == 3 else {})}
    return {"train_micro_batch_size_per_gpu": ROWS, "zero_optimization": zero, **extra}


def _groups(m: Net) -> list:
    """Two groups with their own lr and weight decay (the frozen parameter left out)."""
    head = [m.extra.weight, m.extra.bias, m.head.weight, m.head.bias]
    rest = [p for p in m.parameters() if p.requires_grad and all(p is not h for h in head)]
    return [{"params": rest, "lr": 3e-2}, {"params": head, "weight_decay": 0.2}]


def _schedule(opt: torch.optim.Optimizer) -> LambdaLR:
    return LambdaLR(opt, lambda k: 1.0 / (k + 1))


def _train(rank: int, world: int, stage: int, make: Client, steps: int = 4, pre_steps: int = 0) -> None:
    """``steps`` steps of ``initialize(optimizer=client, lr_scheduler=scheduler)`` next to torch's client and its
    scheduler on the whole batch (after ``pre_steps`` the client took alone, on every rank, before initialize)."""
    model, ref = make_models(torch.float32)
    client, ropt = make(_groups(model)), make(_groups(ref))
    for step in range(pre_steps):  # the same update on every rank: the client is replicated
        for m, o in ((model, client), (ref, ropt)):
            m(batch(100 + step, world * ROWS), None).backward()
            o.step()
            o.zero_grad()
    sched, rsched = _schedule(client), _schedule(ropt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "lr_scheduler.step() before optimizer.step()"
        model, opt, sched = zk.initialize(model, _config(stage), optimizer=client, lr_scheduler=sched)
        assert isinstance(opt, zk.ShardedFusedAdam) and sched.optimizer is opt
        for step in range(steps):
            x, span = batch(step, world * ROWS), extra_rows(step, world)
            model(x[rank * ROWS : (rank + 1) * ROWS], local(span, rank, stage)).backward()
            ref(x, span).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
            for o, s in ((opt, sched), (ropt, rsched)):
                o.step()
                o.zero_grad()
                s.step()
            assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ropt.param_groups]
            with opt.gathered_params():
                compare(model, ref, f"stage {stage} step {step}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(
    "make",
    [
        lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.05, amsgrad=True),
        lambda g: torch.optim.Adam(g, lr=1e-2, weight_decay=0.05, betas=(0.8, 0.95)),
        lambda g: torch.optim.Adam(g, lr=1e-2, weight_decay=0.05, decoupled_weight_decay=True, maximize=True),
    ],
    ids=["adamw-amsgrad", "adam-l2", "adam-decoupled-maximize"],
)
def test_a_client_optimizer_and_its_scheduler_train_as_torch(stage: int, make: Client) -> None:
    _train(0, 1, stage, make)


def test_a_client_that_has_stepped_hands_over_its_state() -> None:
    _train(0, 1, 2, lambda g: torch.optim.AdamW(g, lr=1e-2, amsgrad=True), pre_steps=2)


def _two_ranks(rank: int, world: int) -> None:
    for stage in (2, 3):
        _train(rank, world, stage, lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.05))


@pytest.mark.distributed
def test_a_client_optimizer_on_two_ranks() -> None:
    run_ranks(_two_ranks, 2)


def test_a_callable_client_builds_from_model_parameters() -> None:
    model = nn.Linear(4, 2)
    groups = [{"params": [model.weight], "lr": 0.5}, {"params": [model.bias]}]
    _, opt = zk.initialize(model, _config(1), model_parameters=groups, optimizer=lambda g: torch.optim.Adam(g, lr=0.1))
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.1] and opt.adam_w_mode is False


def test_the_config_section_is_not_used_beside_a_client(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Linear(4, 2)
    section = {"optimizer": {"type": "AdamW", "params": {"lr": 0.9}}}
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        _, opt = zk.initialize(model, _config(1, **section), optimizer=torch.optim.AdamW(model.parameters(), lr=0.2))
    assert opt.param_groups[0]["lr"] == 0.2
    assert 'optimizer= AdamW is used and the config\'s "optimizer" section is not' in caplog.text


def test_other_clients_are_refused_naming_them() -> None:
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"^initialize: optimizer= SGD is not taken: zero_kernels shards Adam and"):
        zk.initialize(model, _config(1), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"optimizer= object is not taken"):
        zk.initialize(model, _config(1), optimizer=lambda params: object())
    mixed = torch.optim.Adam([{"params": [model.weight]}, {"params": [model.bias], "decoupled_weight_decay": True}])
    with pytest.raises(ValueError, match=r"param group 1: decoupled_weight_decay=True, but this ShardedFusedAdam dec"):
        zk.initialize(model, _config(1), optimizer=mixed)
    with pytest.raises(ValueError, match=r'no "optimizer" section; add .*, or pass optimizer=torch.optim.AdamW'):
        zk.initialize(model, _config(1))
    assert not any(hasattr(p, "_zk_flat") for p in model.parameters()) and model.weight.grad is None


def test_a_scheduler_on_another_optimizer_is_still_refused() -> None:
    model = nn.Linear(4, 2)
    client = torch.optim.AdamW(model.parameters(), lr=0.1)
    other = torch.optim.AdamW(copy.deepcopy(model).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"scheduler object \(StepLR\) is not taken.*as optimizer="):
        zk.initialize(model, _config(1), optimizer=client, lr_scheduler=StepLR(other, 1))


def _script(rank: int, world: int, stage: int, edit: Any, steps: int = 4) -> None:
    """A script that keeps stepping what it built on the client itself: ``edit(client, step)`` changes the client's
    groups before each step (a scheduler built on the client and not passed to initialize, a written lr); the
    update follows them, as DeepSpeed's (it shares the client's groups), next to torch doing the same."""
    model, ref = make_models(torch.float32)
    client, ropt = torch.optim.AdamW(_groups(model), lr=1e-2), torch.optim.AdamW(_groups(ref), lr=1e-2)
    edits = [edit(o) for o in (client, ropt)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, opt = zk.initialize(model, _config(stage), optimizer=client)
        for step in range(steps):
            x, span = batch(step, world * ROWS), extra_rows(step, world)
            model(x[rank * ROWS : (rank + 1) * ROWS], local(span, rank, stage)).backward()
            ref(x, span).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            for o in (opt, ropt):
                o.step()
                o.zero_grad()
            for e in edits:
                e(step)
            with opt.gathered_params():
                compare(model, ref, f"stage {stage} step {step}")
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ropt.param_groups]


def _scheduler_kept_by_the_script(opt: torch.optim.Optimizer) -> Callable[[int], None]:
    sched = _schedule(opt)
    return lambda step: sched.step()


def _lr_written(opt: torch.optim.Optimizer) -> Callable[[int], None]:
    def write(step: int) -> None:
        opt.param_groups[step % 2]["lr"] = 0.0 if step == 1 else 5e-3

    return write


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("edit", [_scheduler_kept_by_the_script, _lr_written], ids=["scheduler-not-passed", "lr"])
def test_what_the_script_does_to_the_client_s_groups_reaches_the_update(stage: int, edit: Any) -> None:
    _script(0, 1, stage, edit)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # torch's, for its own nesting
def test_nested_schedulers_are_moved_at_every_depth() -> None:
    def nested(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        inner = [torch.optim.lr_scheduler.ConstantLR(opt, 0.5, total_iters=4), ExponentialLR(opt, 0.8)]
        chained = torch.optim.lr_scheduler.ChainedScheduler(inner)
        return torch.optim.lr_scheduler.SequentialLR(opt, [chained, StepLR(opt, 1, 0.5)], milestones=[3])

    model = nn.Linear(4, 2)
    ref = copy.deepcopy(model)
    client, ropt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sched, rsched = nested(client), nested(ropt)
    config = _config(2, gradient_clipping=0.0)
    model, opt, sched = zk.initialize(model, config, optimizer=client, lr_scheduler=sched)
    for _ in range(5):
        for m, o, s in ((model, opt, sched), (ref, ropt, rsched)):
            m(torch.ones(2, 4)).square().mean().backward()
            o.step()
            o.zero_grad()
            s.step()
        assert opt.param_groups[0]["lr"] == ropt.param_groups[0]["lr"]
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_a_scheduler_s_auto_lr_is_the_client_s(caplog: pytest.LogCaptureFixture) -> None:
    """The config's "optimizer" section is not used beside a client, also not for a scheduler's "auto" lr (and the
    log says so)."""
    section = {
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": 2}},
    }
    model = nn.Linear(4, 2)
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        model, opt, sched = zk.initialize(
            model, _config(1, **section), optimizer=torch.optim.AdamW(model.parameters(), 1e-2)
        )
    assert "scheduler.params.warmup_max_lr=each param group's lr (no optimizer section" in caplog.text
    assert "warmup_max_lr=None" not in caplog.text
    for _ in range(3):
        model(torch.ones(2, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2)


def test_an_empty_group_of_a_client_that_stepped_is_left_out() -> None:
    model = nn.Linear(4, 2)
    client = torch.optim.AdamW([{"params": [model.weight]}, {"params": []}, {"params": [model.bias]}], lr=1e-2)
    model(torch.ones(2, 4)).square().mean().backward()
    client.step()
    client.zero_grad()
    _, opt = zk.initialize(model, _config(1), optimizer=client)
    assert len(opt.param_groups) == 2 and opt.state_dict()["state"][0]["step"] == 1


def test_the_client_s_own_step_is_refused_after_initialize() -> None:
    model = nn.Linear(4, 2)
    client = torch.optim.AdamW(model.parameters(), lr=1e-2)
    zk.initialize(model, _config(1), optimizer=client)
    model(torch.ones(2, 4)).square().mean().backward()
    before = model.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"this AdamW was given to zero_kernels.initialize\(optimizer=...\): call"):
        client.step()
    assert torch.equal(model.weight, before)
    with pytest.raises(RuntimeError, match=r"call load_state_dict\(\) of the ShardedFusedAdam that initialize ret"):
        client.load_state_dict(client.state_dict())
    with pytest.raises(RuntimeError, match=r"call add_param_group\(\) of the ShardedFusedAdam .* would not be tra"):
        client.add_param_group({"params": [nn.Parameter(torch.ones(2))]})
    with pytest.raises(ValueError, match="optimizer= ShardedFusedAdam is not taken: it is zero_kernels' optimizer"):
        zk.initialize(nn.Linear(4, 2), _config(1), optimizer=zk.ShardedFusedAdam(nn.Linear(4, 2)))


def test_a_failed_initialize_leaves_the_client_as_it_was() -> None:
    """A refused initialize (a group in the other decay mode) leaves the client's groups, empty ones and their keys
    included, as they were, and the client steps as a torch optimizer that never met initialize."""
    model, ref = nn.Linear(4, 2), nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    make = lambda m: torch.optim.Adam(  # noqa: E731
        [{"params": [m.weight]}, {"params": []}, {"params": [m.bias], "decoupled_weight_decay": True}],
        lr=1e-2,
        weight_decay=0.1,
    )
    client, torch_client = make(model), make(ref)
    before = [dict(g) for g in client.param_groups]
    with pytest.raises(ValueError, match=r"param group 1: decoupled_weight_decay=True, but this ShardedFusedAdam"):
        zk.initialize(model, _config(1), optimizer=client)
    assert client.param_groups == before
    for m, o in ((model, client), (ref, torch_client)):
        m(torch.ones(2, 4)).square().mean().backward()
        o.step()
    assert torch.equal(model.weight, ref.weight) and torch.equal(model.bias, ref.bias)


def test_a_failed_initialize_gives_a_tensor_lr_back_its_value() -> None:
    """A scheduler built on the client by a refused call (a callable returning a list) wrote the client's tensor lr
    in place: the failed call gives it its value back, so the corrected call trains at the client's lr (it trained
    at a quarter of it)."""
    model = nn.Linear(4, 2)
    lr, betas = torch.tensor(1e-2), (torch.tensor(0.9), torch.tensor(0.999))
    client = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas)
    half = lambda o: LambdaLR(o, lambda k: 0.5)  # noqa: E731
    with pytest.raises(ValueError):
        zk.initialize(model, _config(1), optimizer=client, lr_scheduler=lambda o: [half(o)])
    assert client.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(1e-2)
    assert "initial_lr" not in client.param_groups[0]
    _, opt, _ = zk.initialize(model, _config(1), optimizer=client, lr_scheduler=half)
    assert opt.param_groups[0]["lr"].item() == pytest.approx(5e-3)


def test_a_scheduler_left_on_the_client_counts_micro_steps_as_steps() -> None:
    """A scheduler built on the client and stepped by the script after every micro-step's ``optimizer.step()`` gets
    no "lr_scheduler.step() before optimizer.step()" warning: every call of the step marks the client, also those
    the step hooks, which run at updates only, do not see."""
    model = nn.Linear(4, 2)
    client = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = LambdaLR(client, lambda k: 1.0 / (k + 1))
    model, opt = zk.initialize(model, _config(1, gradient_accumulation_steps=2), optimizer=client)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            model(torch.randn(ROWS, 4)).sum().backward()
            opt.step()
            sched.step()
    assert [g["lr"] for g in opt.param_groups] == [1e-2 / 5]
