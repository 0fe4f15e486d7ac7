"""ZeRO++'s int8 weights made by the step's Adam kernel (``update``'s epilogue), on 2 gloo ranks.

Every payload a quantized gather sends is checked against the reference quantization of the shard it
stands for, at send time, bit for bit. After the first step no gather quantizes (counted: the separate
pass ``Payload.quantize`` never runs) and each sent payload is one the step's kernel made; a write into a
shard between steps makes the next gather quantize that shard again. Training with the epilogue equals,
bit for bit, training where every payload is made by the separate pass at the first gather (the path
before the epilogue, which ``update.whole`` refusing every bucket restores), at stages 1-3, fp32 and bf16,
for the C++, Triton (interpreted without CUDA) and reference backends, in one pair of ranks. The Triton
backend trains a narrower model (the interpreter runs every kernel instance in Python), also cut into
several buckets; the kernel itself is checked bit for bit against its reference in tests/kernels/test_adam_epilogue.py.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch
from torch import nn

import zero_kernels as zk
from zero_kernels.kernels.quant_reference import quantize_ref
from zero_kernels.stages import quantized_gather, update
from zero_kernels.stages.stage3 import gathers

STEPS = 3
OPTIONS = {"stage3_param_persistence_threshold": 0, "zero_quantized_weights": True}
# backend -> (hidden width, reduce_bucket_size): stage 1 cuts the model into 7 buckets, the Triton one into 4
SIZES = {"cpu": (96, 2000), "torch": (96, 2000), "triton": (32, 600)}


class Probe:
    """What one run's quantized gathers sent and the quantization passes it ran, patched in for the block."""

    def __init__(self, fused: bool) -> None:
        self.fused = fused
        self.passes = 0  # Payload.quantize: the separate pass
        self.total_passes = 0
        self.held: set[int] = set()  # data pointers of the payloads the step's kernels made
        self.sent: list[int] = []  # data pointers of the payloads sent since the last reset
        self.wrong: list[str] = []

    def reset(self) -> None:
        self.passes, self.sent = 0, []


@contextlib.contextmanager
def probed(fused: bool) -> Iterator[Probe]:
    probe = Probe(fused)
    originals = (
        quantized_gather.Payload.quantize,
        quantized_gather.WeightQuantizer.hold,
        quantized_gather.all_gather_quantized,
        update.whole,
    )

    def quantize(layout, shard):
        probe.passes += 1
        probe.total_passes += 1
        return originals[0](layout, shard)

    def hold(quantizer, key, shard, payload):
        probe.held.add(payload.data_ptr())
        return originals[1](quantizer, key, shard, payload)

    def send(engine, full, shard, payload, layout, **kw):
        want = quantize_ref(shard.reshape(-1), 8, layout.block)
        expected = torch.cat((want.data, want.scales.view(torch.uint8)))
        if not torch.equal(payload, expected):
            probe.wrong.append(f"{kw['name']}: the payload sent is not the reference quantization of the shard")
        probe.sent.append(payload.data_ptr())
        return originals[2](engine, full, shard, payload, layout, **kw)

    quantized_gather.Payload.quantize = quantize
    quantized_gather.WeightQuantizer.hold = hold
    quantized_gather.all_gather_quantized = gathers.all_gather_quantized = send
    if not fused:
        update.whole = lambda *args: False
    try:
        yield probe
    finally:
        quantized_gather.Payload.quantize, quantized_gather.WeightQuantizer.hold = originals[:2]
        quantized_gather.all_gather_quantized = gathers.all_gather_quantized = originals[2]
        update.whole = originals[3]


def _train(rank: int, stage: int, dtype: torch.dtype, impl: str, probe: Probe, edit: bool = False) -> list:
    torch.manual_seed(0)
    width, bucket = SIZES[impl]
    model = nn.Sequential(nn.Linear(24, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 8)).to(
        dtype
    )
    opt = zk.ShardedFusedAdam(
        model, lr=1e-2, weight_decay=0.01, stage=stage, impl=impl, reduce_bucket_size=bucket, **OPTIONS
    )
    for step in range(STEPS):
        torch.manual_seed(100 * step + rank)
        x, y = torch.randn(6, 24, dtype=dtype), torch.randn(6, 8, dtype=dtype)
        (model(x).float() - y.float()).square().mean().backward()
        if step:  # what the last step's kernels made was sent, and nothing else was quantized
            if stage == 3:
                _check_made_by_step(probe, f"{impl} stage 3 step {step}: the forward and backward")
        probe.reset()
        opt.step()
        opt.zero_grad()
        if stage < 3:
            _check_made_by_step(probe, f"{impl} stage {stage} step {step}: the post-step all-gather")
    if edit and stage == 3:  # a write into a shard between steps: its next gather quantizes it again
        pipeline = opt._pipeline
        buf = next(b for b in pipeline.buffers if not b.persistent)
        pipeline.param_shard(buf, buf.layout.buckets[0]).mul_(0.5)
        probe.reset()
        model(torch.randn(6, 24, dtype=dtype)).float().sum().backward()
        assert probe.passes == 1, f"{impl}: {probe.passes} quantize passes after a write into one bucket's shard"
        opt.zero_grad()
    with opt.gathered_params():
        exact = [p.detach().clone() for p in model.parameters()]
    state = opt.full_state_dict()["state"]
    return exact + [state[i][k] for i in sorted(state) for k in ("exp_avg", "exp_avg_sq")]


def _check_made_by_step(probe: Probe, what: str) -> None:
    if not probe.fused:
        return
    assert probe.sent, f"{what}: nothing was sent quantized"
    assert probe.passes == 0, f"{what}: {probe.passes} quantize passes; the step's payloads were not used"
    assert set(probe.sent) <= probe.held, f"{what}: a payload sent was not made by the step"


def _case(rank: int, world: int) -> None:
    for impl in SIZES:
        _backend_case(rank, impl)


def _backend_case(rank: int, impl: str) -> None:
    for stage in (1, 2, 3):
        for dtype in (torch.float32, torch.bfloat16):
            with probed(fused=True) as probe:
                fused = _train(rank, stage, dtype, impl, probe)
            assert not probe.wrong, (impl, probe.wrong)
            with probed(fused=False) as before:
                separate = _train(rank, stage, dtype, impl, before)
            assert not before.wrong, (impl, before.wrong)
            assert before.total_passes > 0 and not before.held, f"{impl} stage {stage}: the separate pass did not run"
            for i, (a, b) in enumerate(zip(fused, separate)):
                assert torch.equal(a, b), f"{impl} stage {stage} {dtype}: tensor {i} differs from the separate pass's"
            if stage == 3 and dtype == torch.float32:
                with probed(fused=True) as probe:
                    _train(rank, stage, dtype, impl, probe, edit=True)
                assert not probe.wrong, (impl, probe.wrong)


@pytest.mark.parametrize("numel, block, blocks", [(4098, 1368, 3), (2049, 1028, 2), (2048, 2048, 1), (5, 8, 1)])
def test_a_payload_is_the_fewest_blocks_as_even_as_a_multiple_of_4_allows(numel: int, block: int, blocks: int) -> None:
    """At most ``WEIGHT_BLOCK`` elements a block, in the fewest blocks, split evenly with each rounded up to a multiple
    of 4 (the scales stay 4-byte aligned): rounding down instead made 4098 elements 4 blocks, the last nearly empty."""
    layout = quantized_gather.Payload(numel)
    assert (layout.block, layout.blocks) == (block, blocks)
    assert layout.nbytes == blocks * block + 4 * blocks


@pytest.mark.distributed
@pytest.mark.ext  # the C++ backend
def test_step_makes_the_payloads_and_training_is_unchanged(spawn) -> None:
    spawn(_case, 2)
