"""The fp32 master of bf16/fp16 parameters, at every stage on 1-3 gloo ranks.

1. Written into the parameters, in place or not, outside the optimizer (``model.load_state_dict``
   of pretrained weights, ``p.clamp_()``, ``p.data.mul_()``, also on a parameter that gets no
   gradient in the next step; at stage 3 persistent parameters directly, the others inside
   ``gathered_params()``), values reach the master: trained in lock-step with ``torch.optim.AdamW``
   on an fp32 copy given the same writes (bf16/fp16 tolerance of DESIGN.md: twice torch's own
   error on the low-precision copy, plus one ulp of the tensor's scale). ``zk.initialize`` with
   ``bf16``, then pretrained weights loaded: trains from the loaded weights.
2. ``full_state_dict()`` carries each master: loaded at the same or another stage, or world size,
   the state comes back bit for bit and, at the same stage and world size, training continues bit
   for bit; ``torch.optim.AdamW`` loads it. ``consolidate`` writes the fp32 masters as the model's
   weights and as ``master`` entries.
3. Between steps, readers see the writes (a state dict right after an in-place write); a write into
   ``opt.state[p]["master"]`` wins over the parameter at the next step.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
from typing import Any, Optional

import pytest
import torch

import zero_kernels as zk
import zero_kernels.optim as zo
from tests.helpers.dist import run_cases
from tests.helpers.lockstep import (
    BUCKET,
    LR,
    ROWS,
    STAGE3,
    STAGES,
    Net,
    batch,
    compare,
    deep_and_pickled_copies,
    extra_rows,
    forward_backward,
    local,
    make_models,
    make_opt,
)

LOW = (torch.bfloat16, torch.float16)
PERSISTENT = ("tiny", "mid.bias", "extra.bias", "head.weight", "head.bias")  # stage 3: under 10 elements


def pretrained(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    return Net().to(dtype).state_dict()


def gathered_if(opt: Optional[zo.ShardedFusedAdam], stage: int, names: tuple[str, ...]) -> Any:
    """Stage 3 writes to gathered units go inside ``gathered_params()``; persistent parameters and models
    without a ZeRO optimizer (``opt`` None) need none."""
    if opt is not None and stage == 3 and not set(names) <= set(PERSISTENT):
        return opt.gathered_params()
    return contextlib.nullcontext()


def write_in_place(m: Net, opt, stage: int, step: int, state: dict[str, torch.Tensor]) -> None:
    """The writes of ``step``, in place (``opt``: the model's ZeRO optimizer, or None for a torch model)."""

    def inside(*names: str) -> Any:
        return gathered_if(opt, stage, names)

    if step == 1:  # pretrained weights
        with inside("emb.weight"):
            m.load_state_dict(state)
    elif step == 2:  # at stage 3 a gathered unit inside gathered_params, then persistent parameters directly
        with torch.no_grad():
            with inside("mid.weight"):
                m.mid.weight.clamp_(-0.1, 0.1)
            m.head.weight.clamp_(-0.05, 0.05)
            m.tiny.mul_(-2.0)
    elif step == 4:  # through .data (a fresh version counter); extra gets no gradient at step 4
        with inside("extra.weight"):
            m.extra.weight.data.add_(0.25)
        m.head.bias.data.mul_(0.5)


WRITES = {  # as write_in_place, as functions of the current value
    2: {
        "mid.weight": lambda t: t.clamp(-0.1, 0.1),
        "head.weight": lambda t: t.clamp(-0.05, 0.05),
        "tiny": lambda t: t * -2.0,
    },
    4: {"extra.weight": lambda t: t + 0.25, "head.bias": lambda t: t * 0.5},
}


def write_replacing(m: Net, opt: zo.ShardedFusedAdam, step: int, state: dict[str, torch.Tensor]) -> None:
    """The same writes as ``write_in_place``, as ``p.data = new`` inside ``gathered_params()`` (at stage 3 the
    block's end takes them)."""
    with opt.gathered_params():
        new = {n: fn(m.get_parameter(n).detach().clone()) for n, fn in WRITES.get(step, {}).items()}
        if step == 1:
            new = {n: v.clone() for n, v in state.items()}
        for name, value in new.items():
            m.get_parameter(name).data = value


def edits_case(rank: int, world: int, stage: int, dtype: torch.dtype) -> None:
    """In-place writes against the same writes as replacements (bit for bit) and, in bf16, against AdamW."""
    model, ref = make_models(dtype)
    twin, low = copy.deepcopy(model), copy.deepcopy(model)
    opt, twin_opt = make_opt(model, stage), make_opt(twin, stage)
    others = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (ref, low)]
    state = pretrained(dtype)
    for step in range(7):
        what = f"stage {stage} {dtype} world {world} writes, step {step}"
        write_in_place(model, opt, stage, step, state)
        write_replacing(twin, twin_opt, step, state)
        forward_backward(model, ref, rank, world, stage, step)
        x, span = batch(10 * step, world * ROWS), extra_rows(step, world)  # as forward_backward
        twin(x[rank * ROWS : (rank + 1) * ROWS].to(dtype), local(span, rank, stage)).backward()
        for o in (opt, twin_opt):
            o.step()
            o.zero_grad()
        with opt.gathered_params(), twin_opt.gathered_params():
            for (name, p), q in zip(model.named_parameters(), twin.parameters()):
                assert torch.equal(p, q), f"{what}: {name} differs from the same writes made by p.data = ..."
        if dtype != torch.bfloat16:
            continue  # torch's AdamW on fp16 parameters underflows eps: no baseline to compare with
        for m in (ref, low):
            write_in_place(m, None, stage, step, state)
        low(x.to(dtype), span).backward()
        for o in others:
            o.step()
            o.zero_grad()
        with opt.gathered_params():
            compare(model, ref, what, low)


def initialize_then_pretrained(rank: int, world: int, stage: int) -> None:
    """``zk.initialize`` casts to bf16 and builds the optimizer; the pretrained weights are loaded after."""
    config = {
        "bf16": {"enabled": True},
        "gradient_clipping": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET, **(STAGE3 if stage == 3 else {})},
    }
    torch.manual_seed(0)
    model, opt = zk.initialize(Net(), config)
    state = pretrained(torch.bfloat16)
    with opt.gathered_params():
        model.load_state_dict(state)
    ref = Net()
    ref.load_state_dict(state)
    low = copy.deepcopy(ref).to(torch.bfloat16)
    others = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (ref, low)]
    for step in range(3):
        forward_backward(model, ref, rank, world, stage, step)
        x, span = batch(10 * step, world * ROWS), extra_rows(step, world)  # as forward_backward
        low(x.to(torch.bfloat16), span).backward()
        for o in (opt, *others):
            o.step()
            o.zero_grad()
        with opt.gathered_params():
            compare(model, ref, f"stage {stage} world {world} initialize then pretrained, step {step}", low)


def master_cases(rank: int, world: int) -> None:
    for stage in STAGES:
        for dtype in LOW:
            edits_case(rank, world, stage, dtype)
        initialize_then_pretrained(rank, world, stage)


# ---------------------------------------------------------------- the master in full state dicts
def train_bf16(stage: int, rank: int, world: int, steps: range, model=None, opt=None) -> tuple:
    """``steps`` steps of a bf16 model (a new one when not given) on this rank's rows."""
    if model is None:
        model, _ = make_models(torch.bfloat16)
        opt = make_opt(model, stage)
    for step in steps:
        x, span = batch(step, world * ROWS), extra_rows(step, world)
        model(x[rank * ROWS : (rank + 1) * ROWS].to(torch.bfloat16), local(span, rank, stage)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def weights(model: Net, opt: zo.ShardedFusedAdam) -> dict[str, torch.Tensor]:
    with opt.gathered_params():
        return {k: v.clone() for k, v in model.state_dict().items()}


def resumed(stage: int, saved: dict, full: dict) -> tuple:
    """A new bf16 model and optimizer at ``stage`` given the saved weights and ``full``."""
    model, _ = make_models(torch.bfloat16)
    opt = make_opt(model, stage)
    with opt.gathered_params():
        model.load_state_dict(saved)
    opt.load_state_dict(full)
    return model, opt


def same_state(ours: dict, theirs: dict, what: str) -> None:
    assert sorted(ours["state"]) == sorted(theirs["state"]), f"{what}: parameters with state"
    for index, entry in theirs["state"].items():
        mine = ours["state"][index]
        assert sorted(mine) == sorted(entry), f"{what}: state[{index}] keys {sorted(mine)} vs {sorted(entry)}"
        for key, value in entry.items():
            assert torch.equal(mine[key], value), f"{what}: state[{index}][{key!r}] differs"


def check_masters(full: dict, model: Net, opt: zo.ShardedFusedAdam, what: str) -> None:
    """Every trained bf16 parameter has its fp32 master, which rounds to the parameter and holds more than it."""
    params = [p for g in opt.param_groups for p in g["params"]]
    finer = 0
    with opt.gathered_params():
        for index, entry in full["state"].items():
            master = entry["master"]
            assert master.dtype == torch.float32 and torch.equal(master.to(torch.bfloat16), params[index]), what
            finer += int(not torch.equal(master, params[index].float()))
    assert finer > len(full["state"]) // 2, f"{what}: the masters hold no more than the bf16 weights"


def full_state_cases(rank: int, world: int, directory: str) -> None:
    for stage in STAGES:
        model, opt = train_bf16(stage, rank, world, range(3))
        full, saved = opt.full_state_dict(), weights(model, opt)
        check_masters(full, model, opt, f"stage {stage} world {world}")
        for other in STAGES:
            again, again_opt = resumed(other, saved, full)
            same_state(again_opt.full_state_dict(), full, f"stage {stage} -> {other} world {world}")
            if other == stage:
                train_bf16(stage, rank, world, range(3, 5), model, opt)
                train_bf16(stage, rank, world, range(3, 5), again, again_opt)
                for (name, a), b in zip(weights(model, opt).items(), weights(again, again_opt).values()):
                    assert torch.equal(a, b), f"stage {stage} world {world}: {name} differs after a resume"
        if world == 2 and stage == 1 and rank == 0:
            torch.save({"full": full, "weights": saved}, os.path.join(directory, "bf16.pt"))
        if rank == 0:
            adamw_loads(full, saved)


def adamw_loads(full: dict, saved: dict[str, torch.Tensor]) -> None:
    """``torch.optim.AdamW`` loads a state with masters (bf16 and fp32 models) and steps."""
    for dtype in (torch.bfloat16, torch.float32):
        model = Net().to(dtype)
        model.load_state_dict(saved)
        adamw = torch.optim.AdamW(model.parameters(), lr=LR)
        adamw.load_state_dict(copy.deepcopy(full))  # AdamW keeps the step tensors it is given, and adds to them
        model(batch(0, ROWS).to(dtype)).backward()
        adamw.step()
        params = list(model.parameters())
        for index, entry in full["state"].items():
            stepped = entry["step"] + (params[index].grad is not None)
            assert adamw.state[params[index]]["step"] == stepped, f"AdamW {dtype}: parameter {index} not resumed"


def loads_at_other_world_sizes(rank: int, world: int, directory: str) -> None:
    saved = torch.load(os.path.join(directory, "bf16.pt"), weights_only=True)
    for stage in STAGES:
        _, opt = resumed(stage, saved["weights"], saved["full"])
        same_state(opt.full_state_dict(), saved["full"], f"saved on 2 ranks, loaded at stage {stage} on {world}")


def consolidated_masters(rank: int, world: int, directory: str) -> None:
    for stage in STAGES:
        model, opt = train_bf16(stage, rank, world, range(3))
        with torch.no_grad():
            model.head.bias.mul_(0.5)  # written since the last step: the saved master takes it
        path = os.path.join(directory, f"stage{stage}")
        zk.checkpoint.save(path, model, opt)
        full, saved = opt.full_state_dict(), weights(model, opt)
        out = os.path.join(directory, f"stage{stage}.pt")
        if rank == 0:
            zk.checkpoint.consolidate(path, out)
        torch.distributed.barrier()
        written = torch.load(out, weights_only=True)
        names = [n for n, _ in model.named_parameters()]
        for index, entry in full["state"].items():
            what = f"stage {stage}: {names[index]}"
            assert torch.equal(written["model"][names[index]], entry["master"]), f"{what}: not the fp32 master"
            assert torch.equal(written["optimizer"]["state"][index]["master"], entry["master"]), what
        assert written["model"]["frozen"].dtype == torch.bfloat16, "a frozen parameter has no master"
        _, again_opt = resumed((stage + 1) % 4, written["model"], written["optimizer"])
        same_state(again_opt.full_state_dict(), full, f"consolidated at stage {stage}, loaded at {(stage + 1) % 4}")
        assert all(torch.equal(saved[k], v) for k, v in weights(*resumed(stage, written["model"], full)).items())


def world_cases(rank: int, world: int, directory: str) -> None:
    """Points 1 and 2 of the module docstring on this world size: writes reach the master, ``full_state_dict()``
    carries it; on 2 ranks ``consolidate`` writes it, on the others the state saved on 2 ranks loads."""
    cases = [("writes reach the master", master_cases, ()), ("full_state_dict", full_state_cases, (directory,))]
    if world == 2:
        cases.append(("consolidate", consolidated_masters, (directory,)))
    else:
        cases.append(("loaded from 2 ranks", loads_at_other_world_sizes, (directory,)))
    run_cases(rank, world, cases)


@pytest.mark.distributed
def test_writes_reach_the_master_and_full_state_dict_and_consolidate_carry_it(spawn, tmp_path) -> None:
    """One spawn per world size (2 first: it saves the state the others load)."""
    for world in (2, 1, 3):
        spawn(world_cases, world, str(tmp_path), timeout_s=300)


# ---------------------------------------------------------------- between steps, one process
@pytest.mark.parametrize("stage", STAGES)
def test_state_read_right_after_an_in_place_write_holds_it(stage: int) -> None:
    model, opt = train_bf16(stage, 0, 1, range(2))
    with opt.gathered_params(), torch.no_grad():
        model.emb.weight.mul_(3.0)
        model.tiny.fill_(0.3)
    state = opt.state_dict()["state"]  # one rank holds everything: AdamW's layout
    params = [p for g in opt.param_groups for p in g["params"]]
    assert sorted(state) == [i for i, p in enumerate(params) if p.requires_grad], f"stage {stage}: state_dict()"
    with opt.gathered_params():
        for index, entry in state.items():
            master = entry["master"].to(torch.bfloat16)
            assert torch.equal(master, params[index]), f"stage {stage}: state_dict() parameter {index}"
    check_masters(opt.full_state_dict(), model, opt, f"stage {stage}")


@pytest.mark.parametrize("stage", STAGES)
def test_a_write_into_the_master_wins_at_the_next_step(stage: int) -> None:
    """``opt.state[p]["master"]`` written after a backward: the step starts from it, as a run given that value
    as the parameter there."""
    runs = []
    for via_master in (True, False):
        model, opt = train_bf16(stage, 0, 1, range(2))
        model(batch(2, ROWS).to(torch.bfloat16), local(extra_rows(2, 1), 0, stage)).backward()
        if via_master:
            opt.state[model.mid.weight]["master"].fill_(0.125)
        else:
            with opt.gathered_params():
                model.mid.weight.data.fill_(0.125)
        opt.step()
        opt.zero_grad()
        train_bf16(stage, 0, 1, range(3, 5), model, opt)
        runs.append(weights(model, opt))
    for name, value in runs[0].items():
        assert torch.equal(value, runs[1][name]), f"stage {stage}: {name}"


@pytest.mark.parametrize("stage", STAGES)
def test_an_older_state_loaded_leaves_the_parameters(stage: int) -> None:
    """``load_state_dict`` of a state saved a step ago on one process, where the state dict is AdamW's layout with
    each fp32 ``master``: the parameters keep their values (as a load into ``torch.optim.AdamW`` leaves them, and as
    every world size does), and the masters give way to them, so a state read then holds masters rounding to the
    parameters (the loaded masters won there, putting the weights back a step)."""
    model, opt = train_bf16(stage, 0, 1, range(2))
    older = copy.deepcopy(opt.state_dict())
    train_bf16(stage, 0, 1, range(2, 3), model, opt)
    now = weights(model, opt)
    opt.load_state_dict(older)
    state = opt.state_dict()["state"]
    after = weights(model, opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    for name, value in now.items():
        assert torch.equal(after[name], value), f"stage {stage}: {name} changed by the load"
    with opt.gathered_params():
        for index, entry in state.items():
            assert torch.equal(entry["master"].to(torch.bfloat16), params[index]), f"stage {stage}: master {index}"


# ---------------------------------------------------------------- an edit between steps survives copies and loads
OFFLOADS = ({}, {"offload_optimizer": {"device": "cpu"}})


def train_low(model: Net, opt: zo.ShardedFusedAdam, stage: int, rank: int, world: int, steps: range) -> None:
    dtype = model.head.bias.dtype
    for step in steps:
        x, span = batch(step, world * ROWS), extra_rows(step, world)
        model(x[rank * ROWS : (rank + 1) * ROWS].to(dtype), local(span, rank, stage)).backward()
        opt.step()
        opt.zero_grad()


def edited_run(stage: int, dtype: torch.dtype, options: dict, edit: str, rank: int, world: int) -> tuple:
    """One step, then +0.5 written into every master this rank holds (``edit="master"``) or into the parameters."""
    model, _ = make_models(dtype)
    opt = make_opt(model, stage, **options)
    train_low(model, opt, stage, rank, world, range(1))
    with torch.no_grad():
        if edit == "master":
            for p in model.parameters():
                if "master" in opt.state[p]:
                    opt.state[p]["master"].add_(0.5)
        else:
            with gathered_if(opt, stage, ("emb.weight",)) or contextlib.nullcontext():
                model.emb.weight.add_(0.5)
                model.tiny.add_(0.5)
    return model, opt


def copies_of(model: Net, opt: zo.ShardedFusedAdam, stage: int, options: dict) -> dict[str, tuple]:
    """The optimizer (and model) by ``copy.deepcopy``, by pickle, and by ``state_dict()`` into a new one."""
    copied = deep_and_pickled_copies(model, opt, stage)
    saved_state = opt.state_dict()
    model4, _ = make_models(model.head.bias.dtype)
    opt4 = make_opt(model4, stage, **options)
    with opt4.gathered_params():
        model4.load_state_dict(weights(model, opt))
    opt4.load_state_dict(saved_state)
    return {**copied, "state_dict": (model4, opt4)}


def same_views(model: Net, opt: zo.ShardedFusedAdam, other: Net, other_opt: zo.ShardedFusedAdam, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        mine, theirs = opt.state[p], other_opt.state[q]
        assert sorted(mine) == sorted(theirs), f"{what}: opt.state[{name}] keys"
        for key, value in mine.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(theirs[key])), (
                f"{what}: opt.state[{name}][{key}]"
            )


def same_observables(model: Net, opt: zo.ShardedFusedAdam, other: Net, other_opt: zo.ShardedFusedAdam, what: str):
    same_state(other_opt.full_state_dict(), opt.full_state_dict(), f"{what}: full_state_dict()")
    same_views(model, opt, other, other_opt, what)
    for (name, a), b in zip(weights(model, opt).items(), weights(other, other_opt).values()):
        assert torch.equal(a, b), f"{what}: weight {name}"


def edited_master_holds_the_edit(
    opt: zo.ShardedFusedAdam, stage: int, dtype: torch.dtype, options: dict, rank: int, world: int, what: str
) -> None:
    """emb.weight's master is +0.5 over the same step's without the edit."""
    plain = make_models(dtype)[0]
    plain_opt = make_opt(plain, stage, **options)
    train_low(plain, plain_opt, stage, rank, world, range(1))
    edited = opt.full_state_dict()["state"][0]["master"]
    assert torch.equal(edited, plain_opt.full_state_dict()["state"][0]["master"] + 0.5), what


def edit_copy_cases(rank: int, world: int, nvme_path: str) -> None:
    offloads = (*OFFLOADS, {"offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}})
    for stage, dtype, options, edit in itertools.product((1, 2, 3), LOW, offloads, ("master", "param")):
        what = f"stage {stage} {dtype} {options or 'on device'} {edit} edited, world {world}"
        model, opt = edited_run(stage, dtype, options, edit, rank, world)
        copies = copies_of(model, opt, stage, options)
        twin, twin_opt = edited_run(stage, dtype, options, edit, rank, world)
        twin_opt.load_state_dict(twin_opt.state_dict())  # a round trip into the optimizer itself
        copies["load_state_dict(state_dict())"] = (twin, twin_opt)
        if edit == "master":
            edited_master_holds_the_edit(opt, stage, dtype, options, rank, world, what)
        for how, (other, other_opt) in copies.items():
            same_observables(model, opt, other, other_opt, f"{what}, {how}")
        for how, (other, other_opt) in copies.items():
            train_low(other, other_opt, stage, rank, world, range(1, 2))
        train_low(model, opt, stage, rank, world, range(1, 2))
        for how, (other, other_opt) in copies.items():
            same_observables(model, opt, other, other_opt, f"{what}, {how}, one more step")


@pytest.mark.distributed
def test_an_edit_between_steps_survives_copies_and_state_dict_loads(spawn, tmp_path) -> None:
    """``opt.state[p]["master"]`` or a parameter written after a step, the state on the device, in host memory
    or on disk: ``copy.deepcopy``, pickle, and ``state_dict()`` loaded into a new optimizer (weights taken after
    it) or into the optimizer itself equal the original in ``full_state_dict()``, ``opt.state`` and the
    weights, now and after one more step."""
    spawn(edit_copy_cases, 2, str(tmp_path))


def test_a_write_into_the_master_outlives_gathered_params() -> None:
    """A ``gathered_params()`` block after a write into ``opt.state[p]["master"]`` keeps the write (stage 3 writes
    the block's values back to the shards at its end; the other stages do nothing there)."""
    stage = 3
    model, opt = train_bf16(stage, 0, 1, range(2))
    expected = opt.state[model.mid.weight]["master"].add_(0.5).clone()
    with opt.gathered_params():
        pass
    assert torch.equal(opt.full_state_dict()["state"][4]["master"], expected), f"stage {stage}"


@pytest.mark.parametrize("read", ("state_dict", "full_state_dict"))
def test_a_write_into_the_master_inside_gathered_params_survives_a_state_read(read: str) -> None:
    """Inside ``gathered_params()``: ``opt.state[p]["master"]`` written, then the state read (which gives the
    parameters the written master's values): the block's end writes back the parameters as they are then, so the
    write survives, and the parameter read inside the block after the state read shows it."""
    stage = 3
    model, opt = train_bf16(stage, 0, 1, range(2))
    with opt.gathered_params():
        expected = opt.state[model.mid.weight]["master"].add_(0.5).clone()
        getattr(opt, read)()
        assert torch.equal(model.mid.weight, expected.to(torch.bfloat16)), f"{read}: the parameter inside the block"
    assert torch.equal(opt.full_state_dict()["state"][4]["master"], expected), read
    with opt.gathered_params():
        assert torch.equal(model.mid.weight, expected.to(torch.bfloat16)), f"{read}: the parameter after the block"
