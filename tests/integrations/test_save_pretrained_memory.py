"""``zk.save_pretrained`` at stage 3 gathers the model a unit at a time (``stages.stage3.consolidated``).

It gathered every parameter on every rank at once (``gathered_params()``), so a model that fits only at stage 3 ran
out of memory when saved, where DeepSpeed's ``save_16bit_model`` gathers one module at a time. On 2 gloo ranks, the
rank that does not write allocates no more than one unit's gathered buffer during the save (measured from the
profiler's allocation events: 8 units of 263 KB, the whole model was 2.1 MB), the file holds the trained weights bit
for bit with a tied weight still one tensor, and a model part of which another stage-3 optimizer shards is refused on
every rank with nothing written.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from zero_kernels.integrations.save import STATE_DICT_FILE

LAYERS, WIDTH = 8, 256
UNIT_BYTES = (WIDTH + 1) * WIDTH * 4  # one Linear's weight and bias, fp32


def _peak_allocated(fn) -> int:
    """The most bytes allocated at once while ``fn`` runs, from the profiler's allocation events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.events() if e.name == "[memory]"), key=lambda e: e.time_range.start)
    held = peak = 0
    for event in events:
        held += event.cpu_memory_usage
        peak = max(peak, held)
    return peak


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    model[LAYERS - 1].weight = model[0].weight  # tied: saved as one tensor under both names
    return model


def _save_a_unit_at_a_time(rank: int, world: int, directory: str) -> None:
    import zero_kernels as zk

    model = _model()
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=3, stage3_param_persistence_threshold=0)
    model(torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(rank))).sum().backward()
    opt.step()
    peak = _peak_allocated(lambda: zk.save_pretrained(model, opt, directory))
    if rank == 1:  # the writer also holds the host copy it writes
        assert peak <= 1.5 * UNIT_BYTES, f"{peak} bytes allocated at once while saving; one unit is {UNIT_BYTES}"
    saved = torch.load(os.path.join(directory, STATE_DICT_FILE))
    assert saved["0.weight"] is saved[f"{LAYERS - 1}.weight"], "the tied weight was saved as two tensors"
    with opt.gathered_params():
        trained = model.state_dict()
    assert list(saved) == list(trained)
    for name, value in trained.items():
        assert torch.equal(saved[name], value), f"{name} differs from the trained weights"


@pytest.mark.distributed
def test_stage3_save_pretrained_gathers_a_unit_at_a_time(spawn, tmp_path) -> None:
    spawn(_save_a_unit_at_a_time, 2, str(tmp_path / "saved"))


def _another_optimizers_part(rank: int, world: int, directory: str) -> None:
    import zero_kernels as zk

    torch.manual_seed(0)
    both = nn.ModuleDict({"g": nn.Linear(WIDTH, WIDTH), "d": nn.Linear(WIDTH, 1)})
    opt_g = zk.ShardedFusedAdam(both["g"], lr=1e-2, stage=3, stage3_param_persistence_threshold=0)
    opt_d = zk.ShardedFusedAdam(both["d"], lr=1e-2, stage=3, stage3_param_persistence_threshold=0)
    with pytest.raises(RuntimeError, match=r"'d.weight' is emptied by another stage-3 optimizer"):
        zk.save_pretrained(both, opt_g, directory)
    dist.barrier()
    assert not os.path.exists(directory)
    del opt_d


@pytest.mark.distributed
def test_stage3_save_pretrained_of_another_optimizers_part_is_refused(spawn, tmp_path) -> None:
    spawn(_another_optimizers_part, 2, str(tmp_path / "saved"))
