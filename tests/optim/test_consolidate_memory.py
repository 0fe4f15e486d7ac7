"""``consolidate_state_dict`` holds one gathered state kind at a time on the device, and keeps the state in host memory.

Every rank gathers each flat buffer's state whole on the parameters' device; gathering all of a buffer's kinds
(``exp_avg``, ``exp_avg_sq``, the fp32 ``master``, AMSGrad's maximum) before taking any entry held three or four full
fp32 copies of the buffer on every GPU at once (a one-group model: 12 bytes per parameter of the whole model), and rank
``to`` then kept the consolidated state on its GPU too, where ``ZeroRedundancyOptimizer`` keeps it on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.lockstep import forward_backward, make_models, make_opt


def _one_kind_at_a_time(rank: int, world: int, stage: int) -> None:
    from zero_kernels.stages import state_door

    model, ref = make_models(torch.bfloat16)
    opt = make_opt(model, stage, amsgrad=True)
    for step in range(2):
        forward_backward(model, ref, rank, world, stage, step)
        opt.step()
        opt.zero_grad()
    full = opt.full_state_dict()
    gathered: list[torch.Tensor] = []
    real = state_door._gather

    def poisoning(pipeline, buf, shard):  # noqa: ANN001, ANN202
        # a full buffer gathered before this one must be done with: its memory is someone else's from now on
        for earlier in gathered:
            earlier.fill_(float("nan"))
        full = real(pipeline, buf, shard)
        assert full.data_ptr() != shard.data_ptr(), "the shard itself: several ranks hold the state"
        gathered.append(full)
        return full

    state_door._gather = poisoning
    try:
        opt.consolidate_state_dict(to=0)
    finally:
        state_door._gather = real
    kinds = len(state_door.state_tensors(opt.pipeline.buffers[0]))
    assert kinds == 4, f"stage {stage}: {kinds} state kinds (master, exp_avg, exp_avg_sq, max_exp_avg_sq expected)"
    assert len(gathered) >= kinds, f"stage {stage}: {len(gathered)} gathers"
    if rank == 0:
        whole = opt.state_dict()["state"]
        assert whole.keys() == full["state"].keys(), f"stage {stage}: consolidated keys differ"
        for index, entry in whole.items():
            assert list(entry) == list(full["state"][index]), f"stage {stage}: keys of entry {index}"
            for key, value in entry.items():
                assert value.device.type == "cpu", f"stage {stage}: consolidated {key} on {value.device}"
                assert torch.equal(value, full["state"][index][key].cpu()), f"stage {stage}: {index}/{key} differs"


@pytest.mark.distributed
def test_consolidate_holds_one_gathered_kind_at_a_time_and_keeps_the_state_on_the_host(spawn) -> None:  # noqa: ANN001
    for stage in (1, 2, 3):
        spawn(_one_kind_at_a_time, 2, stage)
