"""Random combinations of model, configuration and operations (``tests.helpers.random_combinations``) against DDP +
``torch.optim.AdamW``, every parameter and the whole Adam state compared after every update.

Eight drawn seeds chosen to cover the space: stages 0-3, ``zk.initialize`` and ``ShardedFusedAdam``, fp32 and bf16,
accumulation by the config, by ``no_sync`` and by plain repeated backward, clips by ``opt.clip_grad_norm_``, by
torch's and by ``gradient_clipping``, tied, frozen, 0-size and sometimes-unused parameters, amsgrad and maximize
groups, lr / weight-decay edits, a scheduler, ``add_param_group`` and a ``full_state_dict()`` round trip.
"""

from __future__ import annotations

import pytest

from tests.helpers import random_combinations as rc
from tests.helpers.dist import run_ranks_checked

SEEDS = (103, 50, 98, 24, 397, 3, 1, 10)


def _cases(rank: int, world: int) -> list[str]:
    problems = []
    for seed in SEEDS:
        case = rc.draw(seed)
        found, _ = rc.run_case(rank, world, case)
        problems += [f"{case.summary()}: {f}" for f in found[:3]]
    return problems


@pytest.mark.distributed
def test_random_combinations_match_ddp_adamw() -> None:
    run_ranks_checked(_cases, 2)
