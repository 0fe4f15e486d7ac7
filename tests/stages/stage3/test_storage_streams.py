"""Stage 3's gathered buffers on a GPU: a unit's buffer is allocated on the stream its gather was issued on (a
prefetch: the module before's), and a module run under another stream reads it there. The stream that first reads
it after the gather and the one that frees it are told to the allocator (``record_stream``) before the free, so that
the block does not go to the gathering stream's next allocation while those reads are queued (the module's output
computed from whatever that allocation wrote, silently). No GPU here: stand-in streams, and a buffer that says it
is on ``cuda:1``, record what the unit does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_kernels.optim as zo
from tests.helpers.streams import OnGpu1, StandInStreams
from zero_kernels.stages.stage3.frozen import FrozenUnit
from zero_kernels.stages.stage3.units import TrainableUnit


@pytest.mark.parametrize("kind", [TrainableUnit, FrozenUnit])
def test_a_unit_read_and_freed_under_other_streams_tells_the_allocator(
    kind: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    model[0].requires_grad_(False)  # a unit of frozen parameters too
    opt = zo.ShardedFusedAdam(model, lr=1e-2, stage=3, stage3_param_persistence_threshold=0, impl="torch")
    unit = next(u for u in opt.pipeline._units if isinstance(u, kind))
    streams = StandInStreams(monkeypatch, "prefetch", "module", "parent")
    storage = unit.storage
    storage._tensor = torch.empty(storage.numel, dtype=storage.dtype).as_subclass(OnGpu1)  # a GPU's buffer
    if kind is TrainableUnit:
        unit.buf.param_shard = unit.buf.param_shard.as_subclass(OnGpu1)  # beside it
    unit.start_gather()  # issued on the stream current then: the buffer's block belongs to it
    assert OnGpu1.recorded == []
    streams.use("module")
    unit.finish_gather()  # the module that needs it waits for the gather under its own stream
    assert OnGpu1.recorded == ["module"], "the module's reads of the gathered buffer are not told to the allocator"
    streams.use("parent")
    unit.free()  # freed later, by a module on a third stream
    assert OnGpu1.recorded == ["module", "parent"], "the freeing stream's reads are not told to the allocator"
