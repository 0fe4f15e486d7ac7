"""A sharded ``state_dict()`` loaded where the flat buffers are laid out otherwise is refused naming what differs
and the setting behind it (the message listed only the settings that were equal)."""

from __future__ import annotations

import pytest
import torch

import zero_kernels.optim as zo
from tests.helpers.dist import run_ranks
from tests.helpers.lockstep import ROWS, Net, batch


def _refused(rank: int, world: int) -> None:
    cases = [
        (
            dict(stage=2, reduce_bucket_size=13),
            dict(stage=2, reduce_bucket_size=500),
            r"flat buffer 0 .* cut into \d+ bu",
        ),
        (
            dict(stage=3, stage3_param_persistence_threshold=0),
            dict(stage=3, stage3_param_persistence_threshold=10),
            r"it has 5 flat buffers, this optimizer 4 \(at stage 3 one per sharded unit: stage3_param_persistence_thr",
        ),
    ]
    for saved_with, loaded_with, what in cases:
        torch.manual_seed(0)
        model = Net()
        opt = zo.ShardedFusedAdam(model, **saved_with)
        model(batch(0, world * ROWS)[rank * ROWS : (rank + 1) * ROWS]).backward()
        opt.step()
        state = opt.state_dict()
        other = zo.ShardedFusedAdam(Net(), **loaded_with)
        with pytest.raises(ValueError, match=r"saved by stage \d on 2 ranks with another layout: " + what):
            other.load_state_dict(state)


@pytest.mark.distributed
def test_a_sharded_state_of_another_layout_names_the_difference() -> None:
    run_ranks(_refused, 2)


def test_buckets_of_other_sizes_are_not_said_to_differ_in_number() -> None:
    """Saved on 2 ranks, loaded on 1 (probe BF, a nanoGPT resume at another world size): the buckets' count is the
    same and their padded sizes differ; the message said "cut into 1 bucket there, 1 here (reduce_bucket_size)"."""
    from zero_kernels.optim.state_dicts import _layout_difference

    saved = [[1, "torch.float32", 64, [64], [11]]]
    here = [[1, "torch.float32", 48, [48], [11]]]
    message = _layout_difference(saved, here, stage3=True)
    assert "1 bucket there, 1 here" not in message
    assert "buckets of [64] elements there, [48] here" in message and "world size" in message
