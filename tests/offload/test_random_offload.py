"""Random combinations (``tests.helpers.random_combinations``) trained twice in lock-step, once plain and once with
``offload_optimizer`` (``cpu``/``nvme``, ``ratio``, small ``sub_group_size``, ``buffer_count``, ``pipeline_read`` /
``pipeline_write``), ``offload_param`` (``cpu``/``nvme``, ``max_in_cpu``, ``buffer_count``, ``buffer_size``) and hpZ
(``zero_hpz_partition_size``) drawn on top; every parameter and every ``full_state_dict()`` value compared after
every update with ``torch.equal`` (README: bit for bit on the CPU).

Each seed also draws fp32, bf16 or fp16 (loss scaling from 2**18, and an overflowing micro-batch in some update),
fp32 accumulation of 16-bit gradients, qwZ on both sides (then hpZ is on both too: README promises hpZ bit for bit
without qwZ only) and whether the tier copies as from a GPU (``HostTier.share_host`` off). The seeds together draw
both tiers of each kind at stages 1-3, ``ratio`` 0.3-1, hpZ, qwZ, fp16 overflow steps, bf16, clipping, the three
kinds of accumulation, ``add_param_group`` and a ``full_state_dict()`` round trip.
"""

from __future__ import annotations

import contextlib
import gc
import random
from typing import Any

import pytest
import torch

from tests.helpers import random_combinations as rc
from tests.helpers.dist import run_ranks_checked
from tests.offload import exactness
from zero_kernels.offload import HostTier

SEEDS = (3, 1, 7, 37, 18, 19, 8)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FP16 = {"enabled": True, "initial_scale_power": 18, "loss_scale_window": 2, "hysteresis": 1}


def draw(seed: int, world: int, nvme: str) -> tuple[rc.Case, str, dict, dict, int]:
    """A case at stage 1-3, its precision, the features layered on one side, the options of both, and the update
    whose last micro-batch overflows (-1: none)."""
    case, rnd = rc.draw(seed), random.Random(seed)
    if case.stage == 0:
        case.stage = rnd.choice((1, 2, 3, 3))
        case.options = rc._options(random.Random(seed), case.stage)
    precision = "bf16" if case.bf16 else rnd.choice(("fp32", "fp32", "fp16"))
    both: dict[str, Any] = {}
    if precision != "fp32" and rnd.random() < 0.3:
        both["grad_accum_dtype"] = "fp32"
    if case.stage == 3 and rnd.random() < 0.25:
        both["zero_quantized_weights"] = True
    layered = _features(rnd, case.stage, world, nvme, both)
    updates = sum(op[0] == "update" for op in case.ops)
    overflow = rnd.randrange(updates) if precision != "fp32" and rnd.random() < 0.6 else -1
    return case, precision, layered, both, overflow


def _features(rnd: random.Random, stage: int, world: int, nvme: str, both: dict) -> dict:
    layered: dict[str, Any] = {}
    while not layered:
        if rnd.random() < 0.75:
            tier = dict(device=rnd.choice(("cpu", "nvme")), ratio=rnd.choice((1.0, 1.0, 0.9, 0.5, 0.3)))
            if tier["device"] == "nvme":
                tier.update(nvme_path=nvme, buffer_count=rnd.randint(1, 4), pipeline_read=rnd.random() < 0.5,
                            pipeline_write=rnd.random() < 0.5)  # fmt: skip
            layered.update(offload_optimizer=tier, sub_group_size=rnd.choice((0, 1, 7, 50, 300, 10**9)))
        on_disk = False
        if stage == 3 and rnd.random() < 0.5:
            on_disk = rnd.random() < 0.5 and "zero_quantized_weights" not in both  # qwZ refuses nvme shards
            shards = dict(device="nvme" if on_disk else "cpu")
            if on_disk:
                shards.update(nvme_path=nvme, buffer_count=rnd.randint(1, 5), buffer_size=rnd.choice((10**8, 400)),
                              max_in_cpu=rnd.choice((0, 0, 20, 300, 10**9)))  # fmt: skip
            layered["offload_param"] = shards
        if stage == 3 and not on_disk and rnd.random() < 0.5:  # hpZ refuses nvme shards
            key = "zero_hpz_partition_size"
            (both if "zero_quantized_weights" in both else layered)[key] = world
    return layered


class Side:
    """One model and optimizer of the pair; ``extra``: the options this side adds to the case's."""

    def __init__(self, case: rc.Case, precision: str, extra: dict) -> None:
        self.case, self.dtype, self.extra = case, DTYPES[precision], extra
        self.model = rc.build_model(case)
        self.opt = self._build(self.model, rc.make_groups(case, self.model))
        self.sched: Any = None

    def _build(self, model: rc.Model, groups: list[dict]) -> Any:
        case = self.case
        model.to(self.dtype)
        extra = dict(self.extra, fp16=FP16) if self.dtype == torch.float16 else dict(self.extra)
        if case.accumulate_by == "config":
            extra["gradient_accumulation_steps"] = case.accumulation
        return rc.zk.ShardedFusedAdam(groups, module=model, stage=case.stage, max_grad_norm=case.clipping,
                                      **extra, **case.options)  # fmt: skip

    def backward(self, x: torch.Tensor, ids: torch.Tensor, micro: int, divide: int, sync: bool) -> None:
        loss = self.model(x.to(self.dtype), ids, micro) / divide
        with contextlib.nullcontext() if sync or self.case.accumulate_by != "no_sync" else self.opt.no_sync():
            self.opt.backward(loss.float()) if self.dtype == torch.float16 else loss.backward()

    def clip(self, how: str, max_norm: float) -> float:
        if how == "opt":
            return float(self.opt.clip_grad_norm_(max_norm))
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def roundtrip(self) -> None:
        """full_state_dict() -> a new model and optimizer built alike, given the weights -> load_state_dict()."""
        full, weights = self.opt.full_state_dict(), self.weights()
        late = self.opt.param_groups[len(rc.make_groups(self.case, self.model)) :]
        del self.opt
        gc.collect()
        model = rc.build_model(self.case).to(self.dtype)
        model.load_state_dict(weights)
        model.use_late = self.model.use_late
        groups = rc.make_groups(self.case, model)
        if late:
            groups.append(
                dict({k: v for k, v in late[0].items() if k != "params"}, params=list(model.late.parameters()))
            )
        self.model, self.opt = model, self._build(model, groups)
        self.opt.load_state_dict(full)
        if self.sched is not None:
            sched, self.sched = self.sched.state_dict(), torch.optim.lr_scheduler.StepLR(self.opt, 2, 0.5)
            self.sched.load_state_dict(sched)

    def weights(self) -> dict[str, torch.Tensor]:
        with self.opt.gathered_params() if self.case.stage == 3 else contextlib.nullcontext():
            return {n: p.detach().clone() for n, p in self.model.state_dict().items()}


def compare(a: Side, b: Side, what: str) -> list[str]:
    """Every weight and every ``full_state_dict()`` value of ``b`` against ``a``'s, bit for bit."""
    return exactness.differences(a.opt, b.opt, a.weights(), b.weights(), what)


def run_pair(rank: int, world: int, seed: int, nvme: str) -> list[str]:
    case, precision, layered, both, overflow = draw(seed, world, nvme)
    HostTier.share_host = random.Random(seed + 1).random() < 0.5  # off: the copies a GPU makes run here too
    a, b = Side(case, precision, both), Side(case, precision, dict(both, **layered))
    found: list[str] = []
    micro, updates, k = 0, 0, case.accumulation
    for op in case.ops:
        if op[0] == "update":
            for m in range(k):
                x, ids = rc.batch(case, updates, m, world * rc.ROWS)
                rows = slice(rank * rc.ROWS, (rank + 1) * rc.ROWS)
                x, ids = x[rows], ids[rows]
                if updates == overflow and m == k - 1:
                    x = x * (1e6 if precision == "fp16" else float("inf"))
                for side in (a, b):
                    side.backward(x, ids, micro, 1 if case.accumulate_by == "config" else k, m == k - 1)
                micro += 1
                if m == k - 1 and op[1] is not None:
                    norms = [side.clip(*op[1]) for side in (a, b)]
                    if norms[0] != norms[1] and norms[0] == norms[0]:
                        found.append(f"update {updates + 1}: clipped norm {norms[0]!r} vs {norms[1]!r}")
                if case.accumulate_by == "config" and m < k - 1:
                    for side in (a, b):
                        side.opt.step()
            for side in (a, b):
                side.opt.step()
                side.opt.zero_grad(set_to_none=op[2])
            updates += 1
            if a.opt.skipped_steps != b.opt.skipped_steps:
                found.append(f"update {updates}: skipped {a.opt.skipped_steps} vs {b.opt.skipped_steps}")
            found += compare(a, b, f"update {updates}")
        elif op[0] == "edit":
            for g in a.opt.param_groups + b.opt.param_groups:
                g["lr"], g["weight_decay"] = g["lr"] * 0.7, 0.05
        elif op[0] == "sched":
            for side in (a, b):
                side.sched = side.sched or torch.optim.lr_scheduler.StepLR(side.opt, 2, 0.5)
                side.sched.step()
        elif op[0] == "add_group":
            for side in (a, b):
                side.opt.add_param_group(
                    {"params": list(side.model.late.parameters()), "lr": 2e-2, "weight_decay": 0.0}
                )
                side.model.use_late = True
        else:
            for side in (a, b):
                side.roundtrip()
            found += compare(a, b, "after the round trip")
        if found:
            return [f"seed {seed} ({case.summary()}; {precision}, {layered}, {both}): {f}" for f in found[:3]]
    return []


def _seeds(rank: int, world: int, nvme: str) -> list[str]:
    return [f for seed in SEEDS for f in run_pair(rank, world, seed, nvme)]


@pytest.mark.distributed
def test_random_offload_and_hpz_match_plain_bit_for_bit(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # one node of 2 ranks: hpZ's secondary partition spans it
    run_ranks_checked(_seeds, 2, str(tmp_path))
