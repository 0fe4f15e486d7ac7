"""Inside training frameworks: what their calls do to a sharded optimizer, on 2 gloo ranks at every stage.

1. A loop that calls only ``model.zero_grad()`` (as the Hugging Face Trainer) matches AdamW,
   with accumulation (two backward passes, ``no_sync``) and a parameter unused in some steps.
2. Parameters replaced after construction (``model.to("cpu:0")`` copies, ``p.data = ...``) are
   followed, also by a checkpoint loaded right after; a bf16 master keeps its precision;
   ``load_state_dict(assign=True)`` and a new dtype raise naming the parameter.
3. Stage 3: ``model.state_dict()`` of shards is refused with what to call; ``save_pretrained``
   writes full weights.
4. A model wrapped in DDP is refused (given to the optimizer, or wrapped afterwards, also when the
   optimizer was given only the parameters); so are FSDP2's DTensor parameters.
5. ``opt.clip_grad_norm_`` matches ``torch.nn.utils.clip_grad_norm_`` + AdamW.
6. ``ZERO_KERNELS_LOG_LEVEL=INFO`` prints once; the planner labels offload "not supported here".
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import zero_kernels as zk
import zero_kernels.optim as zo
from tests.helpers.lockstep import (
    BUCKET,
    LR,
    ROWS,
    STAGES,
    Net,
    batch,
    compare,
    forward_backward,
    make_models,
    make_opt,
)
from zero_kernels.planner import NoFitError, recommend

WORLD = 2


def model_zero_grad_only(rank: int, world: int, stage: int) -> None:
    """Item 1: only ``model.zero_grad()``; step 1 accumulates under ``no_sync``, step 2 over two synced passes."""
    model, ref = make_models(torch.float32)
    opt, ropt = make_opt(model, stage), torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(5):
        passes = 2 if step in (1, 2) else 1
        for m in range(passes):
            with opt.no_sync() if step == 1 and m == 0 else contextlib.nullcontext():
                forward_backward(model, ref, rank, world, stage, step, m)
        opt.step()
        ropt.step()
        model.zero_grad()
        ref.zero_grad()
        with opt.gathered_params():
            compare(model, ref, f"stage {stage} model.zero_grad() step {step}")


def replaced_params(rank: int, world: int, stage: int) -> None:
    """Item 2: ``model.to("cpu:0")`` and ``p.data = ...`` between steps are followed."""
    model, ref = make_models(torch.float32)
    opt, ropt = make_opt(model, stage), torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(4):
        if step == 1:
            model.to(torch.device("cpu", 0))  # copies every tensor, as the Trainer's model.to(args.device)
        if step == 2:
            for name in ("mid.weight", "head.weight"):  # a gathered unit and a persistent one at stage 3
                new = torch.linspace(-0.5, 0.5, ref.get_parameter(name).numel()).view_as(ref.get_parameter(name))
                model.get_parameter(name).data = new.clone()
                ref.get_parameter(name).data = new.clone()
        forward_backward(model, ref, rank, world, stage, step)
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
        with opt.gathered_params():
            compare(model, ref, f"stage {stage} replaced parameters step {step}")


def replaced_then_loaded(rank: int, world: int, stage: int, directory: str) -> None:
    """Item 2: a checkpoint loaded right after ``model.to("cpu:0")`` reaches the model and survives the next step."""
    model, ref = make_models(torch.float32)
    opt = make_opt(model, stage)
    for step in range(2):
        forward_backward(model, ref, rank, world, stage, step)
        opt.step()
        opt.zero_grad()
    path = os.path.join(directory, f"replaced-then-loaded-{stage}")
    zk.checkpoint.save(path, model, opt)
    again, _ = make_models(torch.float32)
    again_opt = make_opt(again, stage)
    again.to(torch.device("cpu", 0))
    zk.checkpoint.load(path, again, again_opt)
    for m, o in ((model, opt), (again, again_opt)):
        forward_backward(m, ref, rank, world, stage, 2)
        o.step()
        o.zero_grad()
    with opt.gathered_params(), again_opt.gathered_params():
        for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
            assert torch.equal(a, b), f"stage {stage}: {name} differs after a load that followed model.to"


def master_kept(rank: int, world: int, stage: int) -> None:
    """Item 2: a bf16 model copied by ``model.to("cpu:0")`` trains bit for bit as one that was not."""
    runs = []
    for move in (False, True):
        model, ref = make_models(torch.bfloat16)
        opt = make_opt(model, stage)
        for step in range(3):
            if move and step == 2:
                model.to(torch.device("cpu", 0))
            forward_backward(model, ref, rank, world, stage, step)
            opt.step()
            model.zero_grad()
        with opt.gathered_params():
            runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b), f"stage {stage}: bf16 training changed by model.to('cpu:0')"


def replacement_errors(rank: int, world: int, stage: int) -> None:
    """Item 2: what cannot be followed raises ValueError naming the parameter."""
    model, ref = make_models(torch.float32)
    opt = make_opt(model, stage)
    forward_backward(model, ref, rank, world, stage, 0)
    with opt.gathered_params():
        model.head.weight.data = model.head.weight.data.double()
    with pytest.raises(ValueError, match=r"'head\.weight'.*float64"):
        opt.step()
    if stage == 3:
        return  # load_state_dict(assign=True) into emptied parameters is refused by torch itself (size mismatch)
    model, ref = make_models(torch.float32)
    opt = make_opt(model, stage)
    model.load_state_dict(ref.state_dict(), assign=True)
    forward_backward(model, ref, rank, world, stage, 0)
    with pytest.raises(ValueError, match=r"'tiny' is no longer the Parameter"):
        opt.step()


def stage3_saving(rank: int, world: int, directory: str) -> None:
    """Item 3: refused shard state dicts; full weights through ``zk.save_pretrained``."""
    model, ref = make_models(torch.float32)
    opt = make_opt(model, 3)
    forward_backward(model, ref, rank, world, 3, 0)
    opt.step()
    with pytest.raises(RuntimeError, match=r"'emb\.weight'.*zero_kernels\.save_pretrained\(model, optimizer"):
        model.state_dict()
    assert model.state_dict(keep_vars=True)["emb.weight"].numel() == 0  # the sharded layout, for checkpoint code
    with opt.gathered_params():
        expected = {k: v.clone() for k, v in model.state_dict().items()}
    zk.save_pretrained(model, opt, directory)
    saved = torch.load(os.path.join(directory, "model_state_dict.pt"), weights_only=True)
    fresh = Net()
    fresh.load_state_dict(saved)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, expected[name]), f"save_pretrained: {name} differs"


def ddp_refused(rank: int, world: int, stage: int) -> None:
    """Item 4: DDP around the model, before or after the optimizer is built, whatever it was given."""
    model, _ = make_models(torch.float32)
    with pytest.raises(ValueError, match="wrapped in DistributedDataParallel"):
        make_opt(DistributedDataParallel(model), stage)
    model, _ = make_models(torch.float32)
    opt = make_opt(model, stage)
    wrapped = DistributedDataParallel(model)
    with pytest.raises(RuntimeError, match="DistributedDataParallel.*ZeroTrainer.*ZeroAccelerator"):
        wrapped(batch(0, ROWS))
    del opt
    if stage == 3:
        return  # stage 3 is always given the model
    for run_first in (False, True):  # the model ran once before the wrap (found then), or not
        model, _ = make_models(torch.float32)
        opt = zo.ShardedFusedAdam(model.parameters(), lr=LR, stage=stage, reduce_bucket_size=BUCKET)
        if run_first:
            model(batch(0, ROWS))
        wrapped = DistributedDataParallel(model)
        with pytest.raises(RuntimeError, match="DistributedDataParallel.*ZeroTrainer.*ZeroAccelerator"):
            wrapped(batch(0, ROWS))
        del opt


def fsdp_refused(stage: int) -> None:
    """Item 4: parameters FSDP2's ``fully_shard`` made DTensors are refused naming one (they already are shards),
    the module or its parameters given."""
    from torch.distributed.fsdp import fully_shard

    model, _ = make_models(torch.float32)
    fully_shard(model)
    said = r"cannot train (parameter '\w+'|a parameter of shape \(1,\)): it is a DTensor"
    for given in (model, list(model.parameters()))[: 1 if stage == 3 else 2]:  # stage 3 needs the model
        with pytest.raises(ValueError, match=said):
            zo.ShardedFusedAdam(given, lr=LR, stage=stage, reduce_bucket_size=BUCKET)
    fsdp1_refused(stage)


def fsdp1_refused(stage: int) -> None:
    """Parameters FSDP1 flattened (its flat parameter, or with ``use_orig_params`` the views of it) are refused
    naming FSDP; they were refused as differing between ranks ('every rank must start from the same model')."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    said = r"cannot train (parameter '[\w.]+'|a parameter of shape \(\d+,\)): FullyShardedDataParallel \(FSDP1\)"
    for orig in (False, True):
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
        wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=orig)
        for given in (wrapped, list(wrapped.parameters()))[: 1 if stage == 3 else 2]:
            with pytest.raises(ValueError, match=said):
                zo.ShardedFusedAdam(given, lr=LR, stage=stage, reduce_bucket_size=BUCKET)


def clipped(rank: int, world: int, stage: int) -> None:
    """Item 5: ``opt.clip_grad_norm_`` before each step, against torch's clip on the whole-batch model."""
    model, ref = make_models(torch.float32)
    opt, ropt = make_opt(model, stage), torch.optim.AdamW(ref.parameters(), lr=LR)
    active = False
    for step in range(4):
        forward_backward(model, ref, rank, world, stage, step)
        norm = opt.clip_grad_norm_(0.05)
        expected = nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        active = active or float(expected) > 0.05
        assert float(norm) == pytest.approx(float(expected), rel=1e-5), f"stage {stage} step {step}: norm"
        opt.step()
        ropt.step()
        model.zero_grad()
        ref.zero_grad()
        with opt.gathered_params():
            compare(model, ref, f"stage {stage} clip_grad_norm_ step {step}")
    assert active, "clipping never active"


def frameworks(rank: int, world: int, directory: str) -> None:
    for stage in STAGES:
        model_zero_grad_only(rank, world, stage)
        replaced_params(rank, world, stage)
        replaced_then_loaded(rank, world, stage, directory)
        master_kept(rank, world, stage)
        replacement_errors(rank, world, stage)
        clipped(rank, world, stage)
        fsdp_refused(stage)
    for stage in STAGES:
        ddp_refused(rank, world, stage)
    stage3_saving(rank, world, directory)


@pytest.mark.distributed
def test_framework_calls(spawn, tmp_path) -> None:
    spawn(frameworks, WORLD, str(tmp_path))


LOG_SCRIPT = """
import logging
import zero_kernels
log = logging.getLogger("zero_kernels.test")
log.info("first message")  # no handler configured: zero_kernels' own prints it
logging.basicConfig(level=logging.INFO, format="app: %(message)s")
log.info("second message")  # the application's handler prints it; zero_kernels' stays silent
"""


@pytest.mark.slow  # a fresh interpreter
def test_log_level_prints_once() -> None:
    env = {**os.environ, "ZERO_KERNELS_LOG_LEVEL": "INFO"}
    out = subprocess.run([sys.executable, "-c", LOG_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    lines = out.stderr.splitlines()
    assert out.returncode == 0, out.stderr
    assert sum("first message" in line for line in lines) == 1, out.stderr
    assert [line for line in lines if "second message" in line] == ["app: second message"], out.stderr


def test_planner_points_to_offload_when_nothing_fits() -> None:
    with pytest.raises(NoFitError, match="plan it with --offload cpu") as err:
        recommend(70_000_000_000, gpus=8, gpu_memory=80 * 10**9, link="nvlink", activation_bytes=20 * 10**9)
    assert "not supported" not in str(err.value)
