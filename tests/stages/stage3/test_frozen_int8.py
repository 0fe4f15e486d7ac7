"""Stage 3 with ``zero_quantized_nontrainable_weights``: frozen parameters partitioned and stored in int8.

A LoRA-like model (frozen base ``Linear`` layers, small trainable adapters) on 2 gloo ranks:

- between uses every frozen parameter is an empty tensor, and each rank holds its chunk of each frozen unit
  as an int8 payload: ``memory_report()["params"]`` is that of the option off, less the exact chunks'
  bytes, plus the payloads' (counted from ``Payload``), and the planner says the same;
- what every gather gives is the reference ``dequantize(quantize(chunk))`` of the original values, chunk by
  chunk, each element within half its block's scale of the original (float64), the same on every rank;
- training with the option equals, bit for bit, training with it off on a model whose frozen weights are
  those dequantized values (losses, trainable parameters, Adam state), with activation checkpointing
  (reentrant or not) too, and in fp32 stays with ``torch.optim.AdamW`` on the whole batch within the
  stage-3 tolerance (checked in fp32, bf16 and fp16);
- ``zk.save_pretrained``, consolidation and a sharded checkpoint hold the dequantized values; a load gives
  them back (exactly at the same world size, within half of the new blocks' scales at another); writes into
  frozen parameters (inside ``gathered_params()``, or assigned between steps) are re-quantized; unfreezing
  one is refused at the step, and one given to ``add_param_group`` trains from its dequantized values;
  ``model.state_dict()`` between uses is refused naming a frozen parameter; a copy of the optimizer holds
  this rank's payloads (and the model copies inside ``gathered_params()``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import zero_kernels as zk
from tests.helpers.check import assert_close
from tests.helpers.dist import run_cases
from tests.helpers.lora import Lora, batch, gathered, loss_of, train
from zero_kernels.kernels.quant_reference import dequantize_ref, quantize_ref
from zero_kernels.planner import estimate_memory
from zero_kernels.stages.quantized_gather import Payload
from zero_kernels.stages.stage3.frozen import quantize_keeping

LR, STEPS = 1e-2, 3
# Relative rounding of a dequantized value (computed in float32) to the parameters' dtype: half an ulp.
ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
OPTIONS = {"stage3_param_persistence_threshold": 0, "reduce_bucket_size": 2000}


def _build(dtype: torch.dtype, on: bool, recompute: str = "", seed: int = 0, frozen=None, group=None):
    model = Lora(dtype, recompute, seed)
    if frozen is not None:
        with torch.no_grad():
            for p, value in zip(model.base.parameters(), frozen):
                p.copy_(value)
    opt = zk.ShardedFusedAdam(
        model, lr=LR, weight_decay=0.01, stage=3, zero_quantized_nontrainable_weights=on, process_group=group, **OPTIONS
    )
    return model, opt


def _reference_dequantized(original: list[torch.Tensor], holder_params: list[list[int]], world: int) -> list:
    """What a gather must give: per frozen unit (the parameters of one module, flattened and padded to the
    world), each rank's chunk quantized and dequantized by the reference; with each element's block scale."""
    values, scales = [None] * len(original), [None] * len(original)
    for members in holder_params:
        flat = torch.cat([original[i].reshape(-1) for i in members])
        chunk = -(-flat.numel() // world)
        padded = torch.zeros(chunk * world, dtype=flat.dtype)
        padded[: flat.numel()] = flat
        out, scale = torch.empty_like(padded), torch.empty(padded.numel(), dtype=torch.float64)
        for r in range(world):
            layout = Payload(chunk)
            qb = quantize_ref(padded[r * chunk : (r + 1) * chunk], 8, layout.block)
            out[r * chunk : (r + 1) * chunk] = dequantize_ref(qb, padded.dtype)
            scale[r * chunk : (r + 1) * chunk] = qb.scales.double().repeat_interleave(layout.block)[:chunk]
        offset = 0
        for i in members:
            n = original[i].numel()
            values[i] = out[offset : offset + n].view(original[i].shape)
            scales[i] = scale[offset : offset + n].view(original[i].shape)
            offset += n
    return values, scales


def _frozen_bytes(model: nn.Module, world: int) -> tuple[int, int]:
    """(bytes of this rank's exact chunks of the frozen parameters, bytes of its int8 payloads of them)."""
    exact = payloads = 0
    for layer in model.base:
        chunk = -(-sum(p.numel() for p in layer.parameters()) // world)
        exact += chunk * layer.weight.element_size()
        payloads += Payload(chunk).nbytes
    return exact, payloads


def _values_case(rank: int, world: int, dtype: torch.dtype) -> None:
    original = [p.detach().clone() for p in Lora(dtype).base.parameters()]
    model, opt = _build(dtype, on=True)
    assert all(p.numel() == 0 for p in model.base.parameters()), "frozen parameters are partitioned"
    off_model, off_opt = _build(dtype, on=False)
    exact, payloads = _frozen_bytes(Lora(dtype), world)
    assert opt.memory_report()["params"] == off_opt.memory_report()["params"] - exact + payloads
    per_rank = sum(-(-sum(p.numel() for p in layer.parameters()) // world) for layer in Lora(dtype).base)
    assert per_rank <= payloads < 1.02 * per_rank, "about one byte per frozen element of this rank's chunks"
    frozen_numel = sum(p.numel() for p in Lora(dtype).base.parameters())
    kind = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    planned = estimate_memory(
        1, world, 3, param_dtype=kind, frozen_params=frozen_numel, quantized_nontrainable_weights=True
    )
    without = estimate_memory(1, world, 3, param_dtype=kind)
    assert abs(planned.params - without.params - payloads) < 0.01 * payloads, "the planner's int8 frozen bytes"
    planned = estimate_memory(1, world, 3, param_dtype=kind, frozen_params=frozen_numel)
    assert abs(planned.params - without.params - exact) < 0.01 * exact, "the planner's exact frozen bytes"

    want, scale = _reference_dequantized(original, [[0, 1], [2, 3], [4, 5]], world)
    frozen, _ = gathered(model, opt)
    for i, (got, ref, s, orig) in enumerate(zip(frozen, want, scale, original)):
        assert torch.equal(got, ref), f"frozen parameter {i}: not the reference dequantization"
        rounding = ROUNDING[dtype]
        bound = s / 2 * (1 + 1e-6) + got.double().abs() * rounding
        assert bool(((got.double() - orig.double()).abs() <= bound).all()), f"frozen parameter {i}: past half a scale"
    everyone = [torch.empty_like(frozen[0]) for _ in range(world)]
    torch.distributed.all_gather(everyone, frozen[0])
    assert all(torch.equal(t, frozen[0]) for t in everyone), "every rank gathers the same frozen values"

    # Training: bit for bit the option off on the dequantized frozen weights, with activation checkpointing too.
    for recompute in ("", "non-reentrant", "reentrant"):
        model, opt = _build(dtype, on=True, recompute=recompute)
        twin, twin_opt = _build(dtype, on=False, recompute=recompute, frozen=want)
        losses = train(model, opt, rank, dtype, range(STEPS))
        assert losses == train(twin, twin_opt, rank, dtype, range(STEPS)), f"losses (recompute={recompute})"
        frozen, trainable = gathered(model, opt)
        twin_frozen, twin_trainable = gathered(twin, twin_opt)
        assert all(torch.equal(a, b) for a, b in zip(frozen, want)), "frozen values unchanged by training"
        assert all(torch.equal(a, b) for a, b in zip(trainable, twin_trainable)), "trainable parameters"
        state, twin_state = opt.full_state_dict()["state"], twin_opt.full_state_dict()["state"]
        for i in twin_state:
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[i][key], twin_state[i][key]), f"state {i} {key}"
    if dtype == torch.float32:
        _against_adamw(model, opt, want, rank, world)


def _against_adamw(model: nn.Module, opt, frozen: list[torch.Tensor], rank: int, world: int) -> None:
    """The model trained above (with recomputation) against ``torch.optim.AdamW`` on the whole batch, with the
    frozen weights it sees: losses and trainable parameters, stage 3's fp32 tolerance."""
    ref = Lora(torch.float32)
    with torch.no_grad():
        for p, value in zip(ref.base.parameters(), frozen):
            p.copy_(value)
    adamw = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    for step in range(STEPS):
        batches = [batch(step, r, torch.float32) for r in range(world)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        loss_of(ref, x, y).backward()
        adamw.step()
        adamw.zero_grad()
    _, trainable = gathered(model, opt)
    for got, want in zip(trainable, [p for p in ref.parameters() if p.requires_grad]):
        assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item(), what="trainable vs AdamW")


def _checkpoint_case(rank: int, world: int, folder: str, dtype: torch.dtype) -> None:
    model, opt = _build(dtype, on=True)
    train(model, opt, rank, dtype, range(2))
    saved, _ = gathered(model, opt)
    zk.checkpoint.save(folder, model, opt)
    losses = train(model, opt, rank, dtype, range(2, 4))
    frozen, trainable = gathered(model, opt)

    other, other_opt = _build(dtype, on=True, seed=1)  # other frozen weights: the load must replace them
    zk.checkpoint.load(folder, other, other_opt)
    loaded, _ = gathered(other, other_opt)
    assert all(torch.equal(a, b) for a, b in zip(loaded, saved)), "the loaded frozen values are those saved"
    assert train(other, other_opt, rank, dtype, range(2, 4)) == losses, "resumed losses"
    other_frozen, other_trainable = gathered(other, other_opt)
    assert all(torch.equal(a, b) for a, b in zip(other_trainable + other_frozen, trainable + frozen))

    # At another world size (one rank alone): the saved values quantized again in the new chunks' blocks.
    alone = [torch.distributed.new_group([r]) for r in range(world)][rank]
    one, one_opt = _build(dtype, on=True, seed=1, group=alone)
    zk.checkpoint.load(folder, one, one_opt)
    resharded, _ = gathered(one, one_opt)
    _, scale = _reference_dequantized(saved, [[0, 1], [2, 3], [4, 5]], 1)
    for i, (got, s, value) in enumerate(zip(resharded, scale, saved)):
        rounding = ROUNDING[dtype]
        bound = s / 2 * (1 + 1e-6) + got.double().abs() * rounding
        assert bool(((got.double() - value.double()).abs() <= bound).all()), f"frozen parameter {i} at world 1"

    consolidated = Path(folder) / "consolidated.pt"
    zk.save_pretrained(model, opt, Path(folder) / "pretrained")
    if rank == 0:
        zk.checkpoint.consolidate(folder, consolidated)
        weights = torch.load(consolidated, weights_only=True)["model"]
        assert torch.equal(weights["base.1.weight"], saved[2]), "consolidation holds the dequantized values"
        pretrained = torch.load(Path(folder) / "pretrained" / "model_state_dict.pt", weights_only=True)
        names = [n for n, p in model.named_parameters() if not p.requires_grad]
        names += [n for n, p in model.named_parameters() if p.requires_grad]
        for name, value in zip(names, frozen + trainable):
            assert torch.equal(pretrained[name], value), f"save_pretrained: {name}"
    torch.distributed.barrier()


def _writes_case(rank: int, world: int) -> None:
    model, opt = _build(torch.float32, on=True)
    with pytest.raises(RuntimeError, match="base.0.weight"):
        model.state_dict()
    copied = copy.deepcopy(opt)  # this rank's payloads with it
    assert all(torch.equal(a, b) for a, b in zip(gathered(copied.pipeline.module, copied)[0], gathered(model, opt)[0]))
    with opt.gathered_params():
        twin = copy.deepcopy(model)
    assert all(torch.equal(a, b) for a, b in zip(twin.base.parameters(), gathered(model, opt)[0]))

    # Written inside gathered_params(): re-quantized at the end of the block, the other units untouched.
    before, _ = gathered(model, opt)
    new = torch.linspace(-1, 1, 96 * 96).view(96, 96)
    with opt.gathered_params(), torch.no_grad():
        model.base[1].weight.copy_(new)
        assert set(model.state_dict()) >= {"base.1.weight", "base.1.bias"}
    after, _ = gathered(model, opt)
    want, _ = _reference_dequantized([new, before[3]], [[0, 1]], world)
    assert torch.equal(after[2], want[0]) and torch.equal(after[3], want[1]), "written values re-quantized"
    assert torch.equal(after[0], before[0]) and torch.equal(after[4], before[4]), "other units untouched"
    again, _ = gathered(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(again, after)), "a block without writes re-quantizes nothing"

    # Assigned between steps (p.data = ...): taken at the next gather.
    model.base[2].weight.data = torch.full((8, 96), 0.5)
    train(model, opt, rank, torch.float32, range(1))
    assigned, _ = gathered(model, opt)
    assert torch.equal(assigned[4], torch.full((8, 96), 0.5)), "assigned values (exact in int8) taken"

    # Unfrozen later: refused at the step, naming it.
    model.base[0].weight.requires_grad_(True)
    loss_of(model, *batch(0, rank, torch.float32)).backward()
    with pytest.raises(ValueError, match="base.0.weight.*frozen"):
        opt.step()

    # Assigned with another shape: refused at its gather, naming it.
    model, opt = _build(torch.float32, on=True)
    model.base[2].weight.data = torch.zeros(8, 95)
    with pytest.raises(ValueError, match="base.2.weight"):
        loss_of(model, *batch(0, rank, torch.float32))


def _every_case(rank: int, world: int, folder: str) -> None:
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    cases = [(f"values, memory and training {n}", _values_case, (d,)) for n, d in dtypes.items()]
    cases += [(f"checkpoint {n}", _checkpoint_case, (f"{folder}/{n}", dtypes[n])) for n in ("fp32", "bf16")]
    cases.append(("writes, state dicts and unfreezing", _writes_case, ()))
    run_cases(rank, world, cases)


@pytest.mark.distributed
def test_frozen_int8_values_training_checkpoints_and_writes(spawn, tmp_path: Path) -> None:
    """The cases of the module docstring in turn on one pair of ranks: values, memory and training in fp32, bf16
    and fp16; checkpoints resumed exactly (fp32, bf16); writes, state dicts and unfreezing."""
    spawn(_every_case, 2, str(tmp_path), timeout_s=300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_requantizing_dequantized_values_keeps_them(dtype: torch.dtype) -> None:
    """A chunk of dequantized values (a checkpoint's) quantized again dequantizes to itself; in a chunk partly
    written, the blocks not written keep their values and the written one is within half its new scale."""
    layout = Payload(4656)  # 3 blocks of 1552
    for seed in range(8):
        torch.manual_seed(seed)
        x = (torch.randn(layout.numel) * 0.1 * (seed + 1)).to(dtype)
        held = dequantize_ref(quantize_ref(x, 8, layout.block), dtype)
        again = dequantize_ref(layout.view(quantize_keeping(layout, held)), dtype)
        assert torch.equal(again, held), f"seed {seed}"
    written = held.clone()
    written[:100] = torch.linspace(-1, 1, 100).to(dtype)
    blocks = layout.view(quantize_keeping(layout, written))
    again = dequantize_ref(blocks, dtype)
    assert torch.equal(again[layout.block :], held[layout.block :]), "blocks not written keep their values"
    error = (again[: layout.block].double() - written[: layout.block].double()).abs()
    rounding = ROUNDING[dtype] * again[: layout.block].double().abs()
    assert bool((error <= blocks.scales[0].double() / 2 * (1 + 1e-6) + rounding).all())


def test_a_frozen_parameter_stored_in_int8_joins_a_param_group_later_with_its_dequantized_values() -> None:
    model = Lora(torch.float32)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = zk.ShardedFusedAdam(trainable, module=model, stage=3, zero_quantized_nontrainable_weights=True, **OPTIONS)
    frozen, _ = gathered(model, opt)
    model.base[1].weight.requires_grad_(True)
    opt.add_param_group({"params": [model.base[1].weight]})
    assert gathered(model, opt)[0][2].equal(frozen[2]), "the dequantized values, now trained"
    train(model, opt, 0, torch.float32, range(1))
    after, _ = gathered(model, opt)
    assert not after[2].equal(frozen[2]) and all(after[i].equal(frozen[i]) for i in (0, 1, 4, 5))
    half_scale = frozen[3].abs().max() / 127 / 2
    assert (after[3] - frozen[3]).abs().max() <= half_scale * (1 + 1e-6), "the unit's rest quantized in its new chunk"
