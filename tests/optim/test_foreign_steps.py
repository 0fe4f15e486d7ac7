"""Another optimizer stepping parameters whose gradients a live ``ShardedFusedAdam`` takes is refused
(``optim.foreign_steps``).

At stages 2-3 the sharded optimizer moves every gradient out of ``p.grad`` during backward: a ``torch.optim.AdamW``
built on the same parameters (to continue from ``full_state_dict()`` while the sharded one still lives) found no
gradient and its steps left the weights unchanged, without a word. Now its step raises, naming the parameter, and
changes nothing; the same AdamW steps as usual once the sharded optimizer is gone. Where the gradients stay in
``p.grad`` (stages 0-1) both may step, as before; an optimizer on other parameters, and one that wraps the sharded
optimizer (``.optimizer``, as Accelerate's), step as usual.
"""

from __future__ import annotations

import gc
from typing import Callable, Optional

import pytest
import torch
from torch import nn

import zero_kernels as zk


def _backward(model: nn.Module) -> None:
    model(torch.ones(2, 3)).square().sum().backward()


class _Wrapper(torch.optim.Optimizer):
    """An optimizer that forwards to the one it wraps, as Accelerate's ``AcceleratedOptimizer`` does."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        super().__init__(optimizer.param_groups, {})

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        return self.optimizer.step(closure)


@pytest.mark.parametrize("stage", [2, 3])
def test_adamw_on_parameters_a_sharded_optimizer_takes_the_gradients_of_is_refused(stage: int) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=stage)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with opt.gathered_params():
        before = [p.detach().clone() for p in model.parameters()]
    _backward(model)
    with pytest.raises(RuntimeError, match=rf"AdamW\.step\(\): parameter 0 \('weight'.*stage {stage}.*del it"):
        adamw.step()
    with opt.gathered_params():
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "the refused step changed nothing"
    wrapped = _Wrapper(opt)
    wrapped.step()  # the wrapper is the sharded optimizer
    torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1).step()  # other parameters
    if stage == 2:  # stage 3 keeps its hooks on the model until it is closed
        del opt, wrapped
        gc.collect()
        _backward(model)
        adamw.step()
        assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before)), "AdamW steps once it is gone"


@pytest.mark.parametrize("stage", [0, 1])
def test_both_may_step_where_the_gradients_stay_in_p_grad(stage: int) -> None:
    model = nn.Linear(3, 2)
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=stage)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    _backward(model)
    opt.step()
    sgd.step()


@pytest.mark.parametrize("stage", [2, 3])
def test_another_optimizer_may_step_tensors_that_do_not_require_grad(stage: int) -> None:
    """Backward gives such a tensor no gradient, so nothing is taken from it: AdamW's step over it does nothing, and
    so does it beside the sharded optimizer (PyTorch's test_step_all_hooks steps two optimizers over one such
    tensor); it was refused as if the sharded optimizer had taken its gradients."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    loose = torch.tensor([1.0, 1.0])
    opt = zk.ShardedFusedAdam([*model.parameters(), loose] if stage == 2 else model, lr=1e-2, stage=stage)
    _backward(model)
    others = [loose] if stage == 2 else []
    with opt.gathered_params():
        torch.optim.SGD([model.bias, *others], lr=0.1).step()
        assert torch.equal(loose, torch.ones(2)), "no gradient: SGD leaves it"
    opt.step()
    with pytest.raises(RuntimeError, match=r"SGD\.step\(\): parameter 0 .*is trained by"):
        _backward(model)
        torch.optim.SGD([model.weight, model.bias], lr=0.1).step()
    model.weight.requires_grad_(False)  # frozen after its gradient was taken: still refused
    with pytest.raises(RuntimeError, match=r"SGD\.step\(\): parameter 0 .*is trained by"):
        torch.optim.SGD([model.weight], lr=0.1).step()
    opt.step()  # the gradient used: torch's p.grad would still hold it, for the other optimizer too
    with pytest.raises(RuntimeError, match=r"SGD\.step\(\): parameter 0 .*is trained by"):
        torch.optim.SGD([model.weight], lr=0.1).step()


class _Lookahead(torch.optim.Optimizer):
    """timm's ``Lookahead`` in short: an optimizer of its own around ``_base_optimizer``, whose slow update skips
    parameters without ``p.grad``."""

    def __init__(self, base: torch.optim.Optimizer) -> None:
        self._base_optimizer = base
        self.param_groups = base.param_groups
        self.defaults = base.defaults
        self.state = {}
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = self._base_optimizer.step(closure)
        for p in self.param_groups[0]["params"]:
            if p.grad is not None:  # None at stages 2-3: no slow update, without a word
                p.data.mul_(0.5)
        return loss


@pytest.mark.parametrize("stage", [2, 3])
def test_a_wrapper_that_is_an_optimizer_of_its_own_is_told_what_p_grad_holds(stage: int) -> None:
    model = nn.Linear(3, 2)
    lookahead = _Lookahead(zk.ShardedFusedAdam(model, lr=1e-2, stage=stage))
    lookahead.zero_grad()  # as a loop does; torch's zero_grad puts the step hooks on a class that skipped __init__
    _backward(model)
    with pytest.raises(
        RuntimeError,
        match=rf"_Lookahead\.step\(\): it wraps a ShardedFusedAdam at stage {stage} "
        r"\(as \._base_optimizer\).*p\.grad is None after backward",
    ):
        lookahead.step()
