"""An ``initialize`` that raises leaves the model as it found it: a torch scheduler's misspelt param is refused
at parse time, and a failure once the optimizer exists (the scheduler's constructor) takes the optimizer off the
model and casts it back, so the corrected call on the same model trains bit for bit as a clean run.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zero_kernels as zk
from tests.helpers.dist import run_ranks_checked
from zero_kernels import live


def _config(stage: int, bf16: bool, total_steps: int) -> dict:
    return {
        "train_batch_size": 4,
        "bf16": {"enabled": bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 20},
        "scheduler": {"type": "OneCycleLR", "params": {"max_lr": 1e-2, "total_steps": total_steps}},
    }


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object, dtype: torch.dtype) -> None:
    for seed in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)
        model(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [2, 3])
def test_a_retry_after_a_failed_initialize_trains_as_a_clean_run(stage: int, bf16: bool) -> None:
    model, clean = _model(), _model()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="total_steps"):
        zk.initialize(model, _config(stage, bf16, total_steps=-1))
    after = model.state_dict()
    assert [(k, t.dtype) for k, t in after.items()] == [(k, t.dtype) for k, t in before.items()]
    if not bf16:  # the cast's rounding aside, the values are the model's own
        assert all(torch.equal(after[k], before[k]) for k in before)
    dtype = torch.bfloat16 if bf16 else torch.float32
    _train(*zk.initialize(model, _config(stage, bf16, total_steps=5)), dtype)
    _train(*zk.initialize(clean, _config(stage, bf16, total_steps=5)), dtype)
    for (name, p), q in zip(model.named_parameters(), clean.parameters()):
        assert torch.equal(p, q), name


def test_a_torch_scheduler_param_is_checked_against_its_signature() -> None:
    config = _config(3, False, total_steps=5)
    config["scheduler"] = {"type": "StepLR", "params": {"step_sz": 2}}
    with pytest.raises(ValueError, match=r"'step_sz' in scheduler.params: torch's StepLR takes 'step_size', 'gamma'"):
        zk.initialize(_model(), config)
    config["scheduler"]["params"] = {"gamma": 0.5}
    with pytest.raises(ValueError, match=r"scheduler.params.step_size is required by torch's StepLR"):
        zk.initialize(_model(), config)


def _qwz_failure(rank: int, world: int) -> list[str]:
    """Stage 3 with qwZ: the failed initialize gives every rank the model's exact values back (its cleanup gathers
    unquantized), so the corrected call is taken and trains as a clean run."""
    config = _config(3, False, total_steps=5)
    config["zero_optimization"].update(zero_quantized_weights=True, stage3_param_persistence_threshold=0)
    model, clean = _model(), _model()
    before = copy.deepcopy(model.state_dict())

    def broken(optimizer: torch.optim.Optimizer) -> None:
        raise RuntimeError("a scheduler that fails")

    del config["scheduler"]
    with pytest.raises(RuntimeError, match="a scheduler that fails"):
        zk.initialize(model, config, lr_scheduler=broken)
    after = model.state_dict()
    problems = [
        f"rank {rank}: {k} changed by the failed initialize" for k in before if not torch.equal(after[k], before[k])
    ]
    working = lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)  # noqa: E731
    weights = []
    for m in (model, clean):
        trained = zk.initialize(m, config, lr_scheduler=working)
        _train(*trained, torch.float32)
        with trained[1].gathered_params():
            weights.append({n: p.detach().clone() for n, p in m.named_parameters()})
    return problems + [f"rank {rank}: {n} differs from a clean run" for n, p in weights[0].items()
                       if not torch.equal(p, weights[1][n])]  # fmt: skip


@pytest.mark.distributed
def test_a_failed_initialize_with_quantized_weights_leaves_exact_values() -> None:
    run_ranks_checked(_qwz_failure, 2)


_MODULE_HOOKS = (
    "_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks", "_state_dict_pre_hooks",
    "_state_dict_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)  # fmt: skip


def _hooks_and_attributes(model: nn.Module) -> dict[str, object]:
    """Every hook a module or parameter of ``model`` carries (counted), and their attribute names and classes."""
    seen: dict[str, object] = {}
    for name, m in model.named_modules():
        seen[f"{name}:class"] = type(m)
        seen[f"{name}:attributes"] = sorted(m.__dict__)
        seen.update({f"{name}:{kind}": len(getattr(m, kind)) for kind in _MODULE_HOOKS})
    for name, p in model.named_parameters():
        seen[f"{name}:class"] = type(p)
        seen[f"{name}:attributes"] = sorted(p.__dict__)
        seen[f"{name}:grad hooks"] = len(p._backward_hooks or {}) + len(p._post_accumulate_grad_hooks or {})
    return seen


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_failed_initialize_leaves_no_hook_and_does_not_train_the_model(stage: int) -> None:
    """Each failed initialize takes off every hook it put on the model (the DDP guard's forward pre-hook
    included) and no longer counts as training its parameters; the retry then trains as a clean run."""
    model, clean = _model(), _model()
    before = _hooks_and_attributes(model)
    config = _config(stage, False, total_steps=5)
    del config["scheduler"]

    def broken(optimizer: torch.optim.Optimizer) -> None:
        raise RuntimeError("a scheduler that fails")

    for _ in range(2):
        with pytest.raises(RuntimeError, match="a scheduler that fails") as failure:
            zk.initialize(model, config, lr_scheduler=broken)
        after = _hooks_and_attributes(model)
        assert after == before, {k: (before.get(k), after.get(k)) for k in before if before.get(k) != after.get(k)}
        assert live.training(model.parameters()) == [], "the failed optimizer still counts as training the model"
    del failure
    working = lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)  # noqa: E731
    _train(*zk.initialize(model, config, lr_scheduler=working), torch.float32)
    _train(*zk.initialize(clean, config, lr_scheduler=working), torch.float32)
    for (name, p), q in zip(model.named_parameters(), clean.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize(
    "scheduler, said",
    [
        ({"type": "MultiStepLR", "params": {"milestones": 5}}, "'int' object is not iterable"),
        ({"type": "LinearLR", "params": {"start_factor": 0}}, "Starting multiplicative factor"),
        ({"type": "WarmupLR", "params": {"warmup_min_lr": [0.0, 0.1]}}, "warmup_min_lr has 2 values"),
    ],
)
def test_a_value_the_scheduler_constructor_refuses_is_named_with_its_section(scheduler: dict, said: str) -> None:
    """Torch's own words alone ("TypeError: 'int' object is not iterable") named neither the section nor the key."""
    config = {**_config(stage=2, bf16=False, total_steps=5), "scheduler": scheduler}
    with pytest.raises(ValueError) as err:
        zk.initialize(_model(), config)
    assert str(err.value).startswith("scheduler.params={") and f" is refused by {scheduler['type']}: " in str(err.value)
    assert said in str(err.value)
