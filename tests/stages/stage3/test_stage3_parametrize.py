"""Stage 3 when the model's modules change after the optimizer was built, as PyTorch's parametrizations do.

``torch.nn.utils.parametrize.remove_parametrizations`` of a ``weight_norm`` (wav2vec2's and HuBERT's positional
convolution) during training takes the parametrization's modules and its parameters (``original0``,
``original1``) out of the model and puts a new ``weight`` parameter in their place. Training then goes on:

- the new weight given to ``opt.add_param_group`` trains next to ``torch.optim.AdamW`` doing the same, element by
  element after every step (re-installing stage 3's hooks named each unit by the position its module had when the
  units were made: ``KeyError`` for the parameters that left the model);
- ``copy.deepcopy(opt)`` is refused (its rebuild cannot find those parameters in the model), and the optimizer
  copied keeps training next to AdamW (the hooks the copy took off came back: ``IndexError`` there before,
  leaving the model without them).

Parameters that left the model get no gradient, so the step leaves them alone, as AdamW does. On 1 process
without a process group and on 1-2 gloo ranks. Tolerances of DESIGN.md for fp32, as
``tests.helpers.lockstep.compare``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import zero_kernels.optim as zo
from tests.helpers.lockstep import BUCKET, LR, compare

ROWS = 2
WORLDS = (1, 2)


class PosConv(nn.Module):
    """A weight-normed grouped convolution (wav2vec2's positional embedding, small), then two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1, groups=2)
        self.mid = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.conv(x)) + x
        return self.head(torch.tanh(self.mid(h.transpose(1, 2)))).square().mean()


def _models() -> tuple[PosConv, PosConv]:
    """(model, reference), parametrized each on its own: a deep copy of a parametrized module shares its class,
    whose property ``remove_parametrizations`` deletes."""
    torch.manual_seed(0)
    model = PosConv()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        parametrizations.weight_norm(m.conv, dim=2)
    return model, ref


def _remove(module: PosConv) -> None:
    parametrize.remove_parametrizations(module.conv, "weight", leave_parametrized=True)


def removal_case(rank: int, world: int, then: str) -> None:
    model, ref = _models()
    opt = zo.ShardedFusedAdam(
        model, lr=LR, stage=3, reduce_bucket_size=BUCKET, stage3_param_persistence_threshold=0, eps=1e-6
    )
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=1e-6)
    for step in range(4):
        if step == 2:
            with opt.gathered_params():
                _remove(model)
            _remove(ref)
            if then == "add_param_group":
                opt.add_param_group({"params": [model.conv.weight]})
                ropt.add_param_group({"params": [ref.conv.weight]})
            else:
                with pytest.raises((ValueError, RuntimeError)):
                    copy.deepcopy(opt)
        x = torch.randn(world * ROWS, 4, 7, generator=torch.Generator().manual_seed(step))
        model(x[rank * ROWS : (rank + 1) * ROWS]).backward()
        ref(x).backward()
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
        with opt.gathered_params():
            compare(model, ref, f"world {world}, then {then}, step {step}")


THEN = ("add_param_group", "deepcopy")


@pytest.mark.parametrize("then", THEN)
def test_removed_parametrization_one_process(then: str) -> None:
    removal_case(0, 1, then)


@pytest.mark.distributed
@pytest.mark.parametrize("then", THEN)
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"world{w}")
def test_removed_parametrization(spawn, world: int, then: str) -> None:
    spawn(removal_case, world, then)


class _Scale(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


def test_copy_after_a_parametrization_was_registered_says_the_model_changed() -> None:
    """A parametrization registered after the optimizer was built moves its parameter under a new module: a copy
    of the optimizer then finds another layout, and the error says that the model changed since (it said only
    that the layouts differ)."""
    torch.manual_seed(0)
    model = PosConv()
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=3, reduce_bucket_size=BUCKET, stage3_param_persistence_threshold=0)
    with opt.gathered_params():
        parametrize.register_parametrization(model.mid, "weight", _Scale())
    with pytest.raises((ValueError, RuntimeError), match="changed after the optimizer was built"):
        copy.deepcopy(opt)


def test_checkpoint_after_a_removed_parametrization_names_the_cause(tmp_path) -> None:
    """After ``remove_parametrizations`` and ``add_param_group`` of the new weight, the parameters that left the model
    stay in the optimizer's groups: ``zk.checkpoint.save`` refuses them, and the error names that cause (it spoke of
    ties and replacements only)."""
    import zero_kernels as zk
    from zero_kernels.checkpoint import CheckpointError

    model, _ = _models()
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=3, reduce_bucket_size=BUCKET, stage3_param_persistence_threshold=0)
    with opt.gathered_params():
        _remove(model)
    opt.add_param_group({"params": [model.conv.weight]})
    with pytest.raises(CheckpointError, match="remove_parametrizations"):
        zk.checkpoint.save(str(tmp_path / "ck"), model, opt)
