"""``optim.guards.watch`` returns what undoes it (a failed ``initialize`` takes its optimizer off the model)."""

from __future__ import annotations

from torch import nn

from zero_kernels.optim import guards


class _Owner:
    """Stands for an optimizer: the guards hold it weakly."""


def test_the_hook_on_a_known_model_comes_off() -> None:
    model, owner = nn.Linear(2, 2), _Owner()
    undo = guards.watch(owner, model)
    assert len(model._forward_pre_hooks) == 1
    undo()
    assert len(model._forward_pre_hooks) == 0


def test_without_a_model_the_owner_is_no_longer_looked_for() -> None:
    owner = _Owner()
    undo = guards.watch(owner, None)
    assert owner in guards._finder.pending and guards._finder.handle is not None
    undo()
    assert owner not in guards._finder.pending
    assert guards._finder.handle is None or len(guards._finder.pending) > 0, "the process-wide hook outlived its use"
