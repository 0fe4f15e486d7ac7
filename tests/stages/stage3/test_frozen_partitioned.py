"""Stage 3 partitions the frozen parameters too, exactly, as DeepSpeed does (a LoRA base, a frozen reference model).

A LoRA-like model (frozen base ``Linear`` layers, small trainable adapters) on 2 gloo ranks:

- between uses every frozen parameter is an empty tensor carrying its full shape (``ds_shape``), each rank holds
  its chunk of each frozen unit as it is: ``memory_report()["params"]`` counts those chunks (1/N of the frozen
  bytes, not all of them), and the planner says the same;
- every gather gives the original values bit for bit, on every rank, before and after training;
- training (with activation checkpointing, reentrant or not) stays with ``torch.optim.AdamW`` on the whole batch
  within the stage-3 fp32 tolerance;
- a sharded checkpoint, ``zk.save_pretrained`` and consolidation hold the original values; a load into a model
  with other frozen values gives them back exactly, at the same world size and at another;
- a copy of the optimizer (``copy.deepcopy``, pickled by ``torch.save``; exact or int8 chunks) carries this rank's
  chunks: the copied model's frozen values are the original's, and the copy trains as the original does;
- a frozen parameter unfrozen and given to ``add_param_group`` after some steps trains from then on as with
  ``torch.optim.AdamW`` doing the same.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch
from torch import nn

import zero_kernels as zk
from tests.helpers.check import assert_close
from tests.helpers.dist import run_cases
from tests.helpers.lora import Lora, batch, gathered, loss_of, train
from zero_kernels.planner import estimate_memory

LR, STEPS = 1e-2, 3
OPTIONS = {"stage3_param_persistence_threshold": 0, "reduce_bucket_size": 2000}


def _build(dtype: torch.dtype, recompute: str = "", seed: int = 0, group=None):
    model = Lora(dtype, recompute, seed)
    opt = zk.ShardedFusedAdam(model, lr=LR, weight_decay=0.01, stage=3, process_group=group, **OPTIONS)
    return model, opt


def _originals(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    return [p.detach().clone() for p in Lora(dtype, seed=seed).base.parameters()]


def _same_everywhere(t: torch.Tensor, world: int) -> bool:
    everyone = [torch.empty_like(t) for _ in range(world)]
    torch.distributed.all_gather(everyone, t)
    return all(torch.equal(other, t) for other in everyone)


def _adamw_reference(steps: int, world: int, unfreeze_at: int = -1) -> Lora:
    """``torch.optim.AdamW`` on the whole batch; ``unfreeze_at``: from that step ``base.1.weight`` is trained too
    (``add_param_group``)."""
    ref = Lora(torch.float32)
    adamw = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    for step in range(steps):
        if step == unfreeze_at:
            adamw.add_param_group({"params": [ref.base[1].weight.requires_grad_(True)]})
        batches = [batch(step, r, torch.float32) for r in range(world)]
        loss_of(ref, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])).backward()
        adamw.step()
        adamw.zero_grad()
    return ref


def _values_case(rank: int, world: int, dtype: torch.dtype) -> None:
    original = _originals(dtype)
    model, opt = _build(dtype)
    assert all(p.numel() == 0 for p in model.base.parameters()), "frozen parameters are partitioned"
    assert [tuple(p.ds_shape) for p in model.base.parameters()] == [tuple(p.shape) for p in original]
    chunks = sum(-(-sum(p.numel() for p in layer.parameters()) // world) for layer in Lora(dtype).base)
    element = original[0].element_size()
    adapters = Lora(dtype)
    adapters.base = nn.ModuleList()  # the same trainable parameters without the frozen ones
    without_base = zk.ShardedFusedAdam(adapters, lr=LR, stage=3, **OPTIONS).memory_report()["params"]
    assert opt.memory_report()["params"] == without_base + chunks * element, "1/N of the frozen bytes"
    frozen_numel = sum(p.numel() for p in original)
    kind = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    planned = estimate_memory(1, world, 3, param_dtype=kind, frozen_params=frozen_numel)
    without = estimate_memory(1, world, 3, param_dtype=kind)
    assert abs(planned.params - without.params - chunks * element) <= 3 * world * element, "planner: 1/N of them"

    frozen, _ = gathered(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(frozen, original)), "gathers give the original values"
    assert _same_everywhere(frozen[2], world)
    train(model, opt, rank, dtype, range(STEPS))
    assert all(torch.equal(a, b) for a, b in zip(gathered(model, opt)[0], original)), "unchanged by training"


def _training_case(rank: int, world: int) -> None:
    ref = _adamw_reference(STEPS, world)
    want = [p for p in ref.parameters() if p.requires_grad]
    for recompute in ("", "non-reentrant", "reentrant"):
        model, opt = _build(torch.float32, recompute)
        train(model, opt, rank, torch.float32, range(STEPS))
        frozen, trainable = gathered(model, opt)
        assert all(torch.equal(a, b) for a, b in zip(frozen, _originals(torch.float32)))
        for got, expected in zip(trainable, want):
            tolerance = {"rtol": 1e-5, "atol": 1e-6 * expected.abs().max().item()}
            assert_close(got, expected, **tolerance, what=f"trainable vs AdamW (recompute={recompute!r})")


def _checkpoint_case(rank: int, world: int, folder: str, dtype: torch.dtype) -> None:
    original = _originals(dtype)
    model, opt = _build(dtype)
    train(model, opt, rank, dtype, range(2))
    zk.checkpoint.save(folder, model, opt)
    losses = train(model, opt, rank, dtype, range(2, 4))
    frozen, trainable = gathered(model, opt)

    other, other_opt = _build(dtype, seed=1)  # other frozen values: the load must replace them
    assert not torch.equal(gathered(other, other_opt)[0][0], original[0])
    zk.checkpoint.load(folder, other, other_opt)
    assert all(torch.equal(a, b) for a, b in zip(gathered(other, other_opt)[0], original)), "loaded frozen values"
    assert train(other, other_opt, rank, dtype, range(2, 4)) == losses, "resumed losses"
    other_frozen, other_trainable = gathered(other, other_opt)
    assert all(torch.equal(a, b) for a, b in zip(other_trainable + other_frozen, trainable + frozen))

    alone = [torch.distributed.new_group([r]) for r in range(world)][rank]  # another world size: one rank
    one, one_opt = _build(dtype, seed=1, group=alone)
    zk.checkpoint.load(folder, one, one_opt)
    assert all(torch.equal(a, b) for a, b in zip(gathered(one, one_opt)[0], original)), "loaded at world 1"

    zk.save_pretrained(model, opt, Path(folder) / "pretrained")
    if rank == 0:
        zk.checkpoint.consolidate(folder, Path(folder) / "consolidated.pt")
        weights = torch.load(Path(folder) / "consolidated.pt", weights_only=True)["model"]
        assert torch.equal(weights["base.1.weight"], original[2]), "consolidation holds the original values"
        pretrained = torch.load(Path(folder) / "pretrained" / "model_state_dict.pt", weights_only=True)
        names = [n for n, p in model.named_parameters() if not p.requires_grad]
        assert all(torch.equal(pretrained[n], v) for n, v in zip(names, original)), "save_pretrained"
    torch.distributed.barrier()


def _copy_case(rank: int, world: int) -> None:
    model, opt = _build(torch.float32)
    train(model, opt, rank, torch.float32, range(2))
    copied = copy.deepcopy(opt)
    twin = copied.pipeline.module
    assert all(p.numel() == 0 for p in twin.base.parameters()), "the copy's frozen parameters are partitioned"
    assert all(torch.equal(a, b) for a, b in zip(gathered(twin, copied)[0], _originals(torch.float32)))
    losses = train(model, opt, rank, torch.float32, range(2, 4))
    assert train(twin, copied, rank, torch.float32, range(2, 4)) == losses, "the copy trains as the original"
    assert all(torch.equal(a, b) for a, b in zip(gathered(twin, copied)[1], gathered(model, opt)[1]))


def _unfreeze_case(rank: int, world: int) -> None:
    model = Lora(torch.float32)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = zk.ShardedFusedAdam(trainable, module=model, lr=LR, weight_decay=0.01, stage=3, **OPTIONS)
    train(model, opt, rank, torch.float32, range(2))
    model.base[1].weight.requires_grad_(True)
    opt.add_param_group({"params": [model.base[1].weight]})  # a collective: each rank adds the same group
    assert model.base[1].weight.numel() == 0, "sharded as a trainable parameter"
    train(model, opt, rank, torch.float32, range(2, 4))
    ref = _adamw_reference(4, world, unfreeze_at=2)
    frozen, _ = gathered(model, opt)
    assert torch.equal(frozen[3], _originals(torch.float32)[3]), "the bias beside it stays frozen"
    with opt.gathered_params():
        for (name, got), expected in zip(model.named_parameters(), ref.parameters()):
            tolerance = {"rtol": 1e-5, "atol": 1e-6 * expected.abs().max().item()}
            assert_close(got.detach(), expected.detach(), **tolerance, what=f"{name} vs AdamW")


def _every_case(rank: int, world: int, folder: str) -> None:
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    cases = [(f"values and memory {n}", _values_case, (d,)) for n, d in dtypes.items()]
    cases.append(("training against AdamW", _training_case, ()))
    cases += [(f"checkpoint {n}", _checkpoint_case, (f"{folder}/{n}", d)) for n, d in dtypes.items()]
    cases.append(("a copy of the optimizer", _copy_case, ()))
    cases.append(("unfrozen and added to a param group", _unfreeze_case, ()))
    run_cases(rank, world, cases)


@pytest.mark.distributed
def test_frozen_parameters_partitioned_exactly(spawn, tmp_path: Path) -> None:
    """The cases of the module docstring in turn on one pair of ranks."""
    spawn(_every_case, 2, str(tmp_path), timeout_s=300)


def test_a_model_with_only_frozen_parameters_besides_one_trains_and_keeps_them_exact() -> None:
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    model[0].requires_grad_(False)
    before = [p.detach().clone() for p in model[0].parameters()]
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, **OPTIONS)
    assert model[0].weight.numel() == 0
    for step in range(2):
        model(torch.randn(3, 16, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with opt.gathered_params():
        assert all(torch.equal(p, b) for p, b in zip(model[0].parameters(), before))


def test_an_edit_of_one_element_of_a_frozen_parameter_inside_gathered_params_is_kept() -> None:
    """An edit made inside ``gathered_params()`` to the last element of a frozen partitioned parameter alone (the rest
    of the chunk as it was) goes into the chunk at the block's end: the next gather gives it."""
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    model[0].requires_grad_(False)
    expected = model[0].weight.detach().clone()
    expected[-1, -1] = 5.0
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, **OPTIONS)
    with opt.gathered_params(), torch.no_grad():
        model[0].weight[-1, -1] = 5.0
    with opt.gathered_params():
        assert torch.equal(model[0].weight, expected)


@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
def test_a_pickled_optimizer_carries_the_frozen_chunks(int8: bool) -> None:
    model = Lora(torch.float32)
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, zero_quantized_nontrainable_weights=int8, **OPTIONS)
    train(model, opt, 0, torch.float32, range(2))
    stream = io.BytesIO()
    torch.save(opt, stream)
    stream.seek(0)
    loaded = torch.load(stream, weights_only=False)
    twin = loaded.pipeline.module
    frozen, trainable = gathered(model, opt)
    twin_frozen, twin_trainable = gathered(twin, loaded)
    assert all(torch.equal(a, b) for a, b in zip(frozen + trainable, twin_frozen + twin_trainable))
    assert train(twin, loaded, 0, torch.float32, range(2, 4)) == train(model, opt, 0, torch.float32, range(2, 4))


def _two_steps_next_to_adamw(build, loss, width: int) -> None:
    """``build()``'s model at stage 3 and another ``build()`` under ``torch.optim.AdamW`` (its trainable parameters),
    two steps of ``loss(model, x)`` each, then every parameter compared."""
    model, ref = build(), build()
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, **OPTIONS)
    adamw = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR)
    for step in range(2):
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, adamw)):
            loss(m, x).backward()
            o.step()
            o.zero_grad()
    with opt.gathered_params():
        for got, want in zip(model.parameters(), ref.parameters()):
            assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6 * want.abs().max().item(), what="vs AdamW")


class _Scale(nn.Module):
    """``weight * x``: autograd saves the frozen weight itself (no detached view, as for ``F.linear``'s ``weight.t()``),
    as an RMSNorm's weight or GPT-2's ``Conv1D`` (``addmm``) is saved."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.lin = _Scale(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(self.norm(x))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_frozen_weight_saved_as_itself_survives_the_recomputation_check(reentrant: bool) -> None:
    """Under activation checkpointing torch checks the recomputed saved tensors' shapes after the recomputed forward
    has returned: the frozen unit stays gathered until its backward."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), _Block(16), _Block(16))
        for block in model[1:]:
            block.norm.requires_grad_(False)
        return model

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = model[0](x)
        for block in model[1:]:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=reentrant)
        return h.square().mean()

    _two_steps_next_to_adamw(build, loss, 16)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_recomputation_before_any_other_backward_node_keeps_the_frozen_unit_for_the_check(reentrant: bool) -> None:
    """DeepSpeed's ``TestZeroFrozenParamCheckpointingVariants.test_multi_block`` (issue #4332): the loss reads the last
    checkpointed segment's output directly and that segment ends in an op that saves its output (``relu``), so the
    recomputation is the first thing backward runs, before any of stage 3's backward hooks has marked the backward
    begun; the frozen norm recomputed there must stay gathered for torch's check (it was freed on the recomputed
    forward's exit: ``CheckpointError``, recomputed shape ``[0]``, with ``use_reentrant=False``)."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        blocks = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(16), "lin": nn.Linear(16, 16)}) for _ in range(2))
        for block in blocks:
            block["norm"].requires_grad_(False)
        return blocks

    def segment(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return torch.relu(block["lin"](block["norm"](h)))

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = x.requires_grad_()
        for block in model:
            h = torch.utils.checkpoint.checkpoint(segment, block, h, use_reentrant=reentrant)
        return h.sum()

    _two_steps_next_to_adamw(build, loss, 16)


def test_a_copy_taken_while_a_frozen_parameter_is_unfrozen_has_the_originals_frozen_units() -> None:
    """Unfrozen (``requires_grad_(True)``) and not given to a param group yet: the copy keeps it in its frozen unit
    as the original does, with its value, and unfrozen as in the original."""
    model = Lora(torch.float32)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = zk.ShardedFusedAdam(trainable, module=model, lr=LR, stage=3, **OPTIONS)
    train(model, opt, 0, torch.float32, range(2))
    model.base[1].weight.requires_grad_(True)
    copied = copy.deepcopy(opt)
    twin = copied.pipeline.module
    assert twin.base[1].weight.requires_grad and twin.base[1].weight.numel() == 0
    assert all(torch.equal(a, b) for a, b in zip(gathered(twin, copied)[0], gathered(model, opt)[0]))


def test_add_param_group_inside_gathered_params_is_refused_before_anything_changes() -> None:
    model = Lora(torch.float32)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = zk.ShardedFusedAdam(trainable, module=model, lr=LR, stage=3, **OPTIONS)
    with opt.gathered_params():
        with pytest.raises(ValueError, match="add_param_group inside `with optimizer.gathered_params"):
            opt.add_param_group({"params": [model.base[1].weight.requires_grad_(True)]})
    assert len(opt.param_groups) == 1 and model.base[1].weight.numel() == 0
    opt.add_param_group({"params": [model.base[1].weight]})  # after the block
    assert len(opt.param_groups) == 2


class _DoraLike(nn.Module):
    """What PEFT's DoRA layer does (without importing peft): its forward reads its sub-modules' weights directly, the
    adapter's shape and the frozen base weight's norm."""

    def __init__(self, width: int, rank: int):
        super().__init__()
        self.base_layer = nn.Linear(width, width).requires_grad_(False)
        self.lora_A, self.lora_B = nn.Linear(width, rank, bias=False), nn.Linear(rank, width, bias=False)
        self.magnitude = nn.Parameter(torch.ones(width))
        self.lora_variant = {"default": "dora"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.lora_A.weight.shape[1] == x.shape[-1], "read while freed"
        weight = self.base_layer.weight + self.lora_B.weight @ self.lora_A.weight
        norm = weight.norm(dim=1).detach()
        return (self.magnitude / norm) * torch.nn.functional.linear(x, weight) + self.base_layer.bias


_DoraLike.__module__ = "peft.tuners.lora.layer"  # as PEFT's layers are found: by their package


def test_peft_lora_variant_layers_are_gathered_as_leaf_modules() -> None:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(_DoraLike(12, 2), nn.Tanh(), _DoraLike(12, 2))

    _two_steps_next_to_adamw(build, lambda model, x: model(x).square().mean(), 12)


def _offloaded_chunks(rank: int, world: int, scratch: str) -> None:
    """``offload_param`` (the HF ZeRO-3 template's, cpu; and nvme): the frozen chunks live in host memory, as
    DeepSpeed offloads frozen parameters with the others (run on the CPU with ``HostTier.share_host`` off, which
    makes the host copies as from a GPU; the copy up before each gather runs only where the device is another
    memory): the weights are those without offload bit for bit, and ``memory_report`` counts the chunks under
    ``host``, not ``params``."""
    from zero_kernels.offload import HostTier

    HostTier.share_host = False
    nvme = {"device": "nvme", "nvme_path": f"{scratch}/rank{rank}", "max_in_cpu": 0}
    Path(nvme["nvme_path"]).mkdir(exist_ok=True)
    for params in ({"device": "cpu"}, nvme):
        for int8 in (False, True):
            extra = {"zero_quantized_nontrainable_weights": int8}
            runs = []
            for offload in (None, params):
                model = Lora(torch.bfloat16)
                opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, offload_param=offload, **OPTIONS, **extra)
                chunks = sum(u.held.tensor.untyped_storage().nbytes() for u in opt._pipeline._frozen)
                report = opt.memory_report()
                train(model, opt, rank, torch.bfloat16, range(STEPS))
                frozen_values, trainable = gathered(model, opt)
                runs.append((frozen_values + trainable, report, chunks))
            (plain, plain_report, plain_chunks), (moved, report, chunks) = runs
            assert all(torch.equal(a, b) for a, b in zip(plain, moved)), (params, int8)
            assert chunks == plain_chunks > 0
            assert report["params"] <= plain_report["params"] - chunks, (params, int8, report, plain_report)
            assert report["host"] >= plain_report["host"] + chunks


@pytest.mark.distributed
def test_offload_param_puts_the_frozen_chunks_in_host_memory(spawn, tmp_path: Path) -> None:
    spawn(_offloaded_chunks, 2, str(tmp_path), timeout_s=300)


def test_gathered_params_with_a_frozen_parameter_that_is_a_strided_view() -> None:
    """A frozen parameter that is a strided view (every other column of a tensor, kept whole under the persistence
    threshold: its flattening is a view with stride 2) made ``gathered_params()`` raise torch's 'self.stride(-1)
    must be 1 to view Float as Short' from the block's edit check, which read its bits through a 16-bit view. Kept
    whole or partitioned, the block runs and the frozen values are the original's."""
    for threshold in (100_000, 0):
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        model.f = nn.Parameter(torch.randn(5, 8)[:, ::2], requires_grad=False)
        original = model.f.detach().clone()
        opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, stage3_param_persistence_threshold=threshold)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        with opt.gathered_params():
            assert torch.equal(model.f.detach(), original), f"threshold {threshold}"
