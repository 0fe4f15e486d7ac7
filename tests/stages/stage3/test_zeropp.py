"""ZeRO++ on gloo ranks: quantized weights (qwZ) and the secondary partition (hpZ), against plain training.

qwZ is checked where it acts, bit for bit: every gather a forward sees holds this rank's own chunk exactly
and every other rank's chunk as the reference ``dequantize(quantize(chunk))`` (so within half a block
scale), in fp32, bf16 and fp16, with the shard quantized once per step; ``gathered_params()`` stays exact.
Training with qwZ then stays within the bound Adam allows (derived in ``_adam_bound``) of unquantized
training. hpZ changes where the backward's gathers come from, never their values: bit for bit equal to
plain stage 3 (and, with qwZ, to qwZ alone), with activation checkpointing, on 2 emulated nodes.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import zero_kernels as zk
from tests.helpers.dist import run_cases
from zero_kernels.kernels.quant_reference import dequantize_ref, quantize_ref
from zero_kernels.planner import estimate_memory
from zero_kernels.stages import quantized_gather
from zero_kernels.stages.quantized_gather import Payload

LR, STEPS = 1e-2, 3
SMALL = {"stage3_param_persistence_threshold": 0, "reduce_bucket_size": 2000}


class Net(nn.Module):
    """Three linear blocks; ``recompute``: each block under activation checkpointing (its forward runs again
    in backward, gathering its parameters a third time)."""

    def __init__(self, dtype: torch.dtype, recompute: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(24, 96), nn.Linear(96, 96), nn.Linear(96, 8)]).to(dtype)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            run = (lambda y, b=block: torch.tanh(b(y))) if i < 2 else block
            x = checkpoint(run, x, use_reentrant=False) if self.recompute else run(x)
        return x


def _train(rank: int, dtype: torch.dtype, stage: int = 3, recompute: bool = False, steps: int = STEPS, **kw):
    model = Net(dtype, recompute)
    opt = zk.ShardedFusedAdam(model, lr=LR, weight_decay=0.01, stage=stage, **SMALL, **kw)
    losses = []
    for step in range(steps):
        torch.manual_seed(100 * step + rank)
        x, y = torch.randn(6, 24, dtype=dtype), torch.randn(6, 8, dtype=dtype)
        loss = (model(x).float() - y.float()).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


def _exact(model: nn.Module, opt) -> list[torch.Tensor]:
    with opt.gathered_params():
        return [p.detach().float().clone() for p in model.parameters()]


def _state(opt) -> list[torch.Tensor]:
    state = opt.full_state_dict()["state"]
    return [state[i][k] for i in sorted(state) for k in ("exp_avg", "exp_avg_sq")]


def _all_shards(shard: torch.Tensor, world: int) -> list[torch.Tensor]:
    out = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(out, shard.contiguous())
    return out


def _expected(buf, exact: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The gathered buffer qwZ must produce from the exact one: other ranks' chunks through the reference."""
    out = exact.clone()
    for bucket in buf.layout.buckets:
        chunks = buf.bucket_slice(out, bucket).view(world, -1)
        layout = Payload(chunks.shape[1])
        for r in range(world):
            if r != rank:
                qb = quantize_ref(chunks[r], 8, layout.block)
                chunks[r].copy_(dequantize_ref(qb, chunks.dtype))
    return out


def _within_half_scale(exact: torch.Tensor, got: torch.Tensor, block: int) -> None:
    """|got - exact| <= scale / 2 per element (plus float32 rounding and half an ulp of the storage dtype)."""
    qb = quantize_ref(exact, 8, block)
    scale = qb.scales.repeat_interleave(block)[: exact.numel()]
    ulp = torch.finfo(exact.dtype).eps * exact.float().abs()
    bound = scale / 2 * (1 + 2**-16) + ulp
    err = (got.float() - exact.float()).abs()
    assert bool((err <= bound).all()), f"{exact.dtype}: error {float((err - bound).max())} over half a scale"


def _gathers_case(rank: int, world: int, dtypes: tuple = (torch.float32, torch.bfloat16, torch.float16)) -> None:
    for dtype in dtypes:
        model, opt, _ = _train(rank, dtype, steps=1, zero_quantized_weights=True)
        pipeline = opt._pipeline
        exact = {}
        with opt.gathered_params():  # exact: every rank's chunk is that rank's shard, bit for bit
            for buf in pipeline.buffers:
                exact[id(buf)] = buf.full.clone()
                shards = _all_shards(buf.param_shard, world)
                for bucket in buf.layout.buckets:
                    chunks = buf.bucket_slice(buf.full, bucket).view(world, -1)
                    for r in range(world):
                        assert torch.equal(chunks[r], buf.shard_slice(shards[r], bucket)), f"{dtype}: rank {r}"
        seen = []
        for block in model.blocks:
            block.register_forward_pre_hook(lambda m, a: seen.append((m, [p.detach().clone() for p in m.parameters()])))
        made = []
        original = Payload.quantize
        Payload.quantize = lambda self, shard: made.append(1) or original(self, shard)
        try:
            x = torch.randn(6, 24, dtype=dtype)
            model(x).float().square().mean().backward()
        finally:
            Payload.quantize = original
        buckets = sum(len(buf.layout.buckets) for buf in pipeline.buffers)
        assert len(made) == buckets, f"{dtype}: {len(made)} quantizations in a step of {buckets} buckets"
        for module, values in seen:
            buf = pipeline.buffers[pipeline.where[id(module.weight)][0]]
            want = _expected(buf, exact[id(buf)], rank, world)
            for slot in buf.layout.slots:
                got = values[[id(p) for p in module.parameters()].index(id(buf.params[slot.param]))]
                expected = want.narrow(0, slot.offset, slot.numel).view(slot.shape)
                assert torch.equal(got, expected), f"{dtype}: the forward's gathered values are not the reference's"
            for bucket in buf.layout.buckets:
                chunks = buf.bucket_slice(want, bucket).view(world, -1)
                exact_chunks = buf.bucket_slice(exact[id(buf)], bucket).view(world, -1)
                assert torch.equal(chunks[rank], exact_chunks[rank])
                for r in range(world):
                    _within_half_scale(exact_chunks[r], chunks[r], Payload(chunks.shape[1]).block)
        opt.step()


@pytest.mark.distributed
def test_qwz_gathers_on_three_nodes_of_one_rank(spawn) -> None:
    """An odd world (three nodes of one rank: shards that split no size evenly), bf16."""
    spawn(_odd_case, 3)


def _odd_case(rank: int, world: int) -> None:
    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    _gathers_case(rank, world, (torch.bfloat16,))


def _adam_bound(steps: int, b1: float = 0.9, b2: float = 0.999) -> float:
    """How far two AdamW runs that differ only in their gradients can drift apart in ``steps`` steps.

    Decoupled decay scales both alike, so the masters differ by at most sum_t lr * |u_t - u'_t| with
    u_t = m_hat / (sqrt(v_hat) + eps). By Cauchy-Schwarz, |m_t| / sqrt(v_t) <= (1 - b1) / sqrt(1 - b2) *
    sqrt(sum_{k<t} (b1^2 / b2)^k), and the bias corrections multiply it by sqrt(1 - b2^t) / (1 - b1^t): so
    |u_t| <= B_t and |u_t - u'_t| <= 2 B_t, whatever the gradients were.
    """
    total = 0.0
    for t in range(1, steps + 1):
        ratio = (1 - b1) / math.sqrt(1 - b2) * math.sqrt(sum((b1 * b1 / b2) ** k for k in range(t)))
        total += 2 * LR * ratio * math.sqrt(1 - b2**t) / (1 - b1**t)
    return total


def _training_case(rank: int, world: int) -> None:
    bound = _adam_bound(STEPS)
    for stage in (1, 2, 3):
        plain, plain_opt, plain_losses = _train(rank, torch.float32, stage)
        off, off_opt, _ = _train(rank, torch.float32, stage, zero_quantized_weights=False, zero_hpz_partition_size=1)
        for a, b in zip(_exact(plain, plain_opt) + _state(plain_opt), _exact(off, off_opt) + _state(off_opt)):
            assert torch.equal(a, b), f"stage {stage}: the keys off changed training"
        with _records() as records:
            model, opt, losses = _train(rank, torch.float32, stage, zero_quantized_weights=True)
        logged = [r for r in records if "ZeRO++ parameter all-gathers" in r]
        assert len(logged) == 1 and "int8" in logged[0], f"stage {stage}: logged {logged}"
        if stage < 3:  # between steps: own parameters exact, the others' the dequantized values; exact inside
            _copies_between_steps(opt, rank, world)
        if stage == 2:
            late, late_opt, _ = _train(
                rank, torch.float32, stage, zero_quantized_weights=True, overlap_param_gather=True
            )
            for a, b in zip(_exact(late, late_opt) + _state(late_opt), _exact(model, opt) + _state(opt)):
                assert torch.equal(a, b), "qwZ's gather finished at first use (overlap_param_gather) changed training"
        diffs = [float((a - b).abs().max()) for a, b in zip(_exact(plain, plain_opt), _exact(model, opt))]
        assert max(diffs) <= bound, f"stage {stage}: masters {max(diffs)} apart, Adam allows {bound}"
        assert max(diffs) > 0, f"stage {stage}: nothing was quantized"
        for q, p in zip(losses, plain_losses):
            assert abs(q - p) <= 0.02 * p, f"stage {stage}: loss {q} with qwZ, {p} without"


@contextlib.contextmanager
def _records():
    """The messages of the ``zero_kernels`` logger (any level) inside the block."""
    seen: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("zero_kernels")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _copies_between_steps(opt, rank: int, world: int) -> None:
    pipeline = opt._pipeline
    for buf in pipeline.buffers:
        before = buf.param_flat.clone()
        shards = _all_shards(torch.cat([pipeline.param_shard(buf, b) for b in buf.layout.buckets]), world)
        for bucket in buf.layout.buckets:
            chunks = buf.bucket_slice(before, bucket).view(world, -1)
            n = chunks.shape[1]
            for r in range(world):
                offset = sum(b.numel // world for b in buf.layout.buckets[: bucket.index])
                exact = shards[r].narrow(0, offset, n)
                if r == rank:
                    assert torch.equal(chunks[r], exact)
                else:
                    want = dequantize_ref(quantize_ref(exact, 8, Payload(n).block), exact.dtype)
                    assert torch.equal(chunks[r], want) and not torch.equal(chunks[r], exact)
        with opt.gathered_params():
            for bucket in buf.layout.buckets:
                chunks = buf.bucket_slice(buf.param_flat, bucket).view(world, -1)
                offset = sum(b.numel // world for b in buf.layout.buckets[: bucket.index])
                for r in range(world):
                    assert torch.equal(chunks[r], shards[r].narrow(0, offset, chunks.shape[1]))


def _two_nodes(rank: int) -> None:
    os.environ.update(GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")


def _hpz_case(rank: int, world: int, dtypes: tuple = (torch.float32, torch.bfloat16)) -> None:
    _two_nodes(rank)  # nodes of 2 ranks: 2 nodes at 4 ranks, 3 at 6
    for dtype in dtypes:
        runs = {}
        for name, kw in (
            ("plain", {}),
            ("hpz", {"zero_hpz_partition_size": 2}),
            ("qwz", {"zero_quantized_weights": True}),
            ("both", {"zero_quantized_weights": True, "zero_hpz_partition_size": 2}),
        ):
            held: list[int] = []
            model = Net(dtype, recompute=True)
            opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, **SMALL, **kw)
            model.blocks[0].weight.register_post_accumulate_grad_hook(
                lambda p, o=opt: held.append(o.memory_report()["secondary"])
            )
            losses = []
            torch.manual_seed(rank)
            x, y = torch.randn(6, 24, dtype=dtype), torch.randn(6, 8, dtype=dtype)  # one batch: the loss must fall
            for _ in range(STEPS):
                loss = (model(x).float() - y.float()).square().mean()
                loss.backward()
                opt.step()
                assert opt.memory_report()["secondary"] == 0 or name in ("qwz", "both"), "kept after the step"
                opt.zero_grad()
                losses.append(loss.item())
            assert all(math.isfinite(v) and v > 0 for v in losses) and losses[-1] < losses[0], f"{name}: {losses}"
            runs[name] = (_exact(model, opt) + _state(opt), losses, held, opt._pipeline.param_traffic)
        for a, b in (("plain", "hpz"), ("qwz", "both")):
            for x, y in zip(runs[a][0], runs[b][0]):
                assert torch.equal(x, y), f"{dtype}: {b} differs from {a}"
            assert runs[a][1] == runs[b][1]
        assert runs["hpz"][3].intra_node > 0 and runs["plain"][3].intra_node == 0
        psi, name = sum(p.numel() for p in Net(dtype).parameters()), str(dtype).split(".")[1]
        for run, quantized in (("hpz", False), ("both", True)):
            held = max(runs[run][2])  # in backward: every unit's part kept since the forward
            kw = {
                "param_dtype": {"float32": "fp32", "bfloat16": "bf16"}[name],
                "master_weights": dtype != torch.float32,
            }
            planned = estimate_memory(psi, world, 3, hpz_partition_size=2, quantized_weights=quantized, **kw)
            assert abs(held - planned.secondary) <= 0.1 * planned.secondary, f"{run}: {held} held, {planned}"
    with pytest.raises(ValueError, match="zero_hpz_partition_size=4 must (be the number of ranks per node|divide)"):
        zk.ShardedFusedAdam(Net(torch.float32), stage=3, zero_hpz_partition_size=4)


@pytest.mark.distributed
def test_hpz_on_three_nodes_equals_plain_stage3(spawn) -> None:
    """An odd node count (3 nodes of 2 ranks): hpZ's groups stay inside each node, bf16."""
    spawn(_hpz_case, 6, (torch.bfloat16,), timeout_s=300)


def _subgroup_case(rank: int, world: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="4")  # one node of 4: hpZ over pairs of it
    runs = []
    for kw in ({}, {"zero_hpz_partition_size": 2}):
        model, opt, losses = _train(rank, torch.bfloat16, recompute=True, steps=2, **kw)
        runs.append(_exact(model, opt) + _state(opt))
    for a, b in zip(*runs):
        assert torch.equal(a, b), "hpZ over half a node differs from plain stage 3"
    assert dist.get_process_group_ranks(opt._pipeline.unit_gathers.secondary_engine.group) == [
        rank // 2 * 2,
        rank // 2 * 2 + 1,
    ]
    if rank == 0:  # a copy is made on one rank alone: its hpZ group is the one already made, no collective
        copied = copy.deepcopy(opt)
        assert copied._pipeline.unit_gathers.secondary_engine.group is opt._pipeline.unit_gathers.secondary_engine.group
    dist.barrier()


@pytest.mark.distributed
def test_hpz_over_part_of_a_node(spawn) -> None:
    spawn(_subgroup_case, 4, timeout_s=300)


def _save_case(rank: int, world: int, directory: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    model, opt, _ = _train(rank, torch.float32, recompute=True, zero_quantized_weights=True, zero_hpz_partition_size=2)
    zk.checkpoint.save(directory, model, opt)
    exact, state = _exact(model, opt), _state(opt)
    if rank == 0:
        torch.save((exact, state), Path(directory) / "expected.pt")


def _pair_cases(rank: int, world: int, directory: str) -> None:
    run_cases(
        rank,
        world,
        [("qwZ gathers", _gathers_case, ()), ("qwZ training", _training_case, ()), ("save", _save_case, (directory,))],
    )


@pytest.mark.distributed
def test_qwz_gathers_training_and_a_checkpoint_resumed_at_another_world_size(spawn, tmp_path: Path) -> None:
    """On one pair of ranks, in turn: qwZ's gathers are the reference dequantization; training with qwZ stays
    within Adam's bound and is unchanged with the keys off; a qwZ + hpZ checkpoint, loaded here at world size 1,
    resumes exactly."""
    spawn(_pair_cases, 2, str(tmp_path), timeout_s=300)
    exact, state = torch.load(tmp_path / "expected.pt")
    model = Net(torch.float32, recompute=True)
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, zero_quantized_weights=True, **SMALL)
    zk.checkpoint.load(tmp_path, model, opt)
    for a, b in zip(_exact(model, opt) + _state(opt), exact + state):
        assert torch.equal(a, b), "the checkpoint did not hold the exact parameters and state"
    loss = model(torch.randn(6, 24)).square().mean()
    loss.backward()
    opt.step()
    assert math.isfinite(loss.item())


def test_payload_blocks_fit_the_shard() -> None:
    for n in (1, 3, 5, 272, 2048, 2049, 2080, 100_003):
        layout = Payload(n)
        assert layout.block <= quantized_gather.WEIGHT_BLOCK and layout.block % 4 == 0
        assert n <= layout.blocks * layout.block < n + 4 * layout.blocks + 4, n


def _offload_case(rank: int, world: int, directory: str) -> None:
    """qwZ + hpZ + qgZ with the optimizer state in host memory or on disk (and the parameter shards in host
    memory): the same weights, full state dict and losses as without offload, bit for bit (bf16 with an fp32
    master, clipping), on 2 nodes of 2 ranks."""
    _two_nodes(rank)
    nvme = Path(directory, f"nvme{rank}")
    nvme.mkdir()
    zeropp = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
    runs = {}
    for name, offload in (
        ("none", None),
        ("cpu", {"device": "cpu"}),
        ("nvme", {"device": "nvme", "nvme_path": str(nvme)}),
        ("cpu+params", {"device": "cpu"}),
    ):
        kw = dict(zeropp, max_grad_norm=0.05)
        if offload is not None:
            kw.update(offload_optimizer=offload, sub_group_size=500)
        if name.endswith("+params"):  # the parameter shards in host memory too (qwZ quantizes them there)
            kw.update(offload_param={"device": "cpu"})
        model, opt, losses = _train(rank, torch.bfloat16, recompute=True, steps=4, **kw)
        runs[name] = (_exact(model, opt) + _state(opt), losses, opt.full_state_dict())
    for name in ("cpu", "nvme", "cpu+params"):
        for a, b in zip(runs["none"][0], runs[name][0]):
            assert torch.equal(a, b), f"offload {name}: the weights or state differ from ZeRO++ without offload"
        assert runs[name][1] == runs["none"][1], f"offload {name}: losses {runs[name][1]} vs {runs['none'][1]}"
        full, want = runs[name][2], runs["none"][2]
        for i, state in want["state"].items():
            for kind, t in state.items():
                assert torch.equal(full["state"][i][kind], t), f"offload {name}: full_state_dict {i} {kind} differs"


def _two_nodes_cases(rank: int, world: int, directory: str) -> None:
    # hpZ's case last: it ends with a construction that is refused
    run_cases(rank, world, [("offload", _offload_case, (directory,)), ("hpZ", _hpz_case, ())])


@pytest.mark.distributed
def test_hpz_on_two_nodes_equals_plain_stage3_and_zeropp_with_offload_equals_zeropp_without(
    spawn, tmp_path: Path
) -> None:
    """On 2 nodes of 2 ranks, in turn: ZeRO++ with the optimizer state offloaded equals ZeRO++ without; hpZ (alone
    and with qwZ, activation checkpointing) equals plain stage 3 bit for bit."""
    spawn(_two_nodes_cases, 4, str(tmp_path), timeout_s=400)


def _block_case(rank: int, world: int) -> None:
    """qwZ with persistent units (their biases): a ``gathered_params()`` block between steps, empty or with a save,
    leaves the run bit for bit as without it (the persistent units' other ranks' parts dequantized again)."""
    for dtype in (torch.float32, torch.bfloat16):
        runs = []
        for block in (False, True):
            model = Net(dtype)
            persistent = {"stage3_param_persistence_threshold": 100, "reduce_bucket_size": 2000}
            opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, zero_quantized_weights=True, **persistent)
            assert any(buf.persistent for buf in opt._pipeline.buffers)
            for step in range(STEPS):
                torch.manual_seed(100 * step + rank)
                x, y = torch.randn(6, 24, dtype=dtype), torch.randn(6, 8, dtype=dtype)
                (model(x).float() - y.float()).square().mean().backward()
                opt.step()
                opt.zero_grad()
                if block and step == 0:
                    with opt.gathered_params():
                        pass
                    opt.state_dict()
            runs.append(_exact(model, opt) + _state(opt))
        for a, b in zip(*runs):
            assert torch.equal(a, b), f"{dtype}: a gathered_params() block between steps changed the run"


@pytest.mark.distributed
def test_qwz_gathered_params_block_leaves_persistent_units_as_the_step_left_them(spawn) -> None:
    spawn(_block_case, 2)
