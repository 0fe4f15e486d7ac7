"""Make the DeepSpeed checkpoint fixtures of ``tests/checkpoint/test_migration.py`` with real DeepSpeed.

Needs a Python environment with deepspeed (it runs on the CPU with gloo; ``"torch_adam": true``
avoids building DeepSpeed's fused Adam op)::

    python -m venv /tmp/venv-ds && /tmp/venv-ds/bin/pip install torch==2.13.0 deepspeed
    /tmp/venv-ds/bin/python tests/data/make_deepspeed_fixtures.py tests/data/deepspeed

For each (stage, precision, frozen) case, two gloo ranks train ``Tiny`` for ``STEPS_BEFORE`` steps under
DeepSpeed with a ``WarmupLR`` scheduler and save a checkpoint (``CASE/ckpt``); then two fresh
ranks load it into a new engine and train ``STEPS_AFTER`` more steps. ``CASE/resumed.pt`` keeps
what that resumed run saw: the mean loss over the ranks and the learning rate of every step, and
the fp32 weights (DeepSpeed's ``zero_to_fp32``) before and after. The batches come from
``batch(step)``, the same function the tests use, so a run at another world size sees the same
global batch. The config leaves ``gradient_clipping`` out, so DeepSpeed's default (1.0 in 0.19)
clips, as zero_kernels' default does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn

STEPS_BEFORE = 4
STEPS_AFTER = 5
ROWS = 6  # global batch rows; DeepSpeed's two ranks take 3 each
WORLD = 2
# case -> (stage, bf16, frozen: ``fc1.weight`` frozen, as a LoRA base, kept apart from the optimizer's state)
CASES = {
    "stage1_fp32": (1, False, False),
    "stage2_fp32": (2, False, False),
    "stage3_fp32": (3, False, False),
    "stage1_bf16": (1, True, False),
    "stage2_bf16": (2, True, False),
    "stage3_bf16": (3, True, False),
    "stage2_frozen_fp32": (2, False, True),
    "stage3_frozen_fp32": (3, False, True),
    "stage3_frozen_bf16": (3, True, True),
    "stage3_subgroups_fp32": (3, False, False),
    "stage3_subgroups_frozen_biases_fp32": (3, False, False),
}
# case -> stage 3's sub_group_size, where it is small enough to cut a param group into several sub-groups
# (DeepSpeed's default, 1e9, does so for a param group of over a billion elements)
SUB_GROUP_SIZE = {"stage3_subgroups_fp32": 16, "stage3_subgroups_frozen_biases_fp32": 16}
# cases whose biases are frozen and stay in DeepSpeed's param groups: the biases' group trains nothing, so DeepSpeed's
# stage 3 gives it no sub-group and saves it with no "params", while the weights' group is two sub-groups (as many as
# the saved param groups); zero_kernels resumes with ``groups``' trainable parameters (the biases' group empty)
FROZEN_BIASES = {"stage3_subgroups_frozen_biases_fp32"}
# fp16 cases (case -> stage): the first loss scale, 2**20, overflows at each of the STEPS_BEFORE steps (the first only
# spends a hysteresis), so DeepSpeed saves an optimizer that never stepped (no Adam state); the resumed run skips on
# until the scale fits, then steps
FP16_CASES = {"stage2_fp16_skipped": 2}


class Tiny(nn.Module):
    """83 parameters in four tensors (an odd total: every stage pads its partitions)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.fc2(torch.tanh(self.fc1(x))) - y).float().square().mean()


def make_model(frozen: bool = False, frozen_biases: bool = False) -> Tiny:
    """``frozen``: ``fc1.weight`` does not train; ``frozen_biases``: neither do the biases."""
    torch.manual_seed(0)
    model = Tiny()
    model.fc1.weight.requires_grad_(not frozen)
    for bias in (model.fc1.bias, model.fc2.bias):
        bias.requires_grad_(not frozen_biases)
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of training step ``step`` (inputs, targets), fp32."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 3, generator=g)


def groups(model: Tiny, frozen_too: bool = False) -> list[dict]:
    """Two param groups of the trainable parameters (``frozen_too``: of every parameter), as a Trainer makes them:
    weights decay, biases do not."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight") and (p.requires_grad or frozen_too)]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias") and (p.requires_grad or frozen_too)]
    return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]


def config(stage: int, bf16: bool, sub_group_size: int | None = None, fp16: bool = False) -> dict:
    zero = {"stage": stage} if sub_group_size is None else {"stage": stage, "sub_group_size": sub_group_size}
    precision = {"fp16": {"enabled": True, "initial_scale_power": 20}} if fp16 else {}
    return {
        "train_micro_batch_size_per_gpu": ROWS // WORLD,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 2e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-2, "warmup_num_steps": 6, "warmup_type": "linear"},
        },
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "steps_per_print": 1000,
        **precision,
    }


def _run(rank: int, case: str, stage: int, bf16: bool, frozen: bool, out: str, port: int, resume: bool) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    model = make_model(frozen, case in FROZEN_BIASES)
    params = groups(model, case in FROZEN_BIASES)
    fp16 = case in FP16_CASES
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=params, config=config(stage, bf16, SUB_GROUP_SIZE.get(case), fp16)
    )
    ckpt = Path(out) / case / "ckpt"
    dtype = torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32
    lo, hi = rank * ROWS // WORLD, (rank + 1) * ROWS // WORLD
    steps = range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER) if resume else range(STEPS_BEFORE)
    if resume:
        engine.load_checkpoint(str(ckpt))
    losses, lrs, scales = [], [], []
    for step in steps:
        x, y = batch(step)
        lrs.append(engine.get_lr()[0])
        loss = engine(x[lo:hi].to(dtype), y[lo:hi].to(dtype))
        engine.backward(loss)
        engine.step()
        scales.append(engine.optimizer.cur_scale if fp16 else 1.0)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    if not resume:
        engine.save_checkpoint(str(ckpt), tag="global_step4")
        dist.barrier()
        if rank == 0:  # DeepSpeed's own recovery scripts, copied beside the checkpoint: not fixtures
            for script in ckpt.glob("*.py"):
                script.unlink()
        return
    dist.barrier()
    if rank == 0:
        before = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
        after_dir = Path(out) / case / "after"
        engine_state = {"losses": losses, "lrs": lrs, "weights_before": before}
        if fp16:  # the loss scale after each step, and the steps skipped by the end
            engine_state.update(loss_scales=scales, skipped_steps=engine.skipped_steps)
    engine.save_checkpoint(str(Path(out) / case / "after"), tag="end")
    dist.barrier()
    if rank == 0:
        engine_state["weights_after"] = get_fp32_state_dict_from_zero_checkpoint(str(after_dir))
        torch.save(engine_state, Path(out) / case / "resumed.pt")
        shutil.rmtree(after_dir)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder for the fixtures (one sub-folder per case)")
    parser.add_argument(
        "--case", action="append", choices=sorted([*CASES, *FP16_CASES]), help="only these cases (repeatable)"
    )
    args = parser.parse_args()
    for case in args.case or [*CASES, *FP16_CASES]:
        stage, bf16, frozen = CASES[case] if case in CASES else (FP16_CASES[case], False, False)
        shutil.rmtree(Path(args.out) / case, ignore_errors=True)
        for resume in (False, True):
            args_ = (case, stage, bf16, frozen, args.out, _free_port(), resume)
            mp.spawn(_run, args=args_, nprocs=WORLD, join=True)
        cfg = config(stage, bf16, SUB_GROUP_SIZE.get(case), case in FP16_CASES)
        info = {"stage": stage, "bf16": bf16, "frozen": frozen, "world_size": WORLD, "config": cfg}
        if case in FROZEN_BIASES:
            info["frozen_biases"] = True
        (Path(args.out) / case / "case.json").write_text(json.dumps(info, indent=1) + "\n")
        print(case, "done", file=sys.stderr)


if __name__ == "__main__":
    main()
