"""``torch.distributed.algorithms.Join([opt])``, with which ``ZeroRedundancyOptimizer`` trains on uneven inputs: a
``ShardedFusedAdam`` is not a ``Joinable`` (a rank that ran out of batches would have to shadow every reduction of
the others' backward passes and steps), so entering ``Join`` raises an error naming it and saying what to do (it
failed inside torch with ``AttributeError: 'ShardedFusedAdam' object has no attribute 'join_hook'``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Join

import zero_kernels as zk


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_join_is_refused_naming_the_fix(stage: int) -> None:
    model = nn.Linear(4, 2)
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=stage)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"ShardedFusedAdam.*Join.*same number of batches.*drop_last"):
        with Join([opt]):
            model(torch.ones(2, 4)).sum().backward()
    with opt.gathered_params():
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
