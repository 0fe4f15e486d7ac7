"""Training with an offload tier next to the same configuration without it, compared bit for bit.

``pair_case`` trains two copies of ``lockstep.Net`` on the same rows, one optimizer with the tier and
one without, and after every step compares the parameters and the full optimizer state element by
element (``torch.equal``: the tier runs the same kernel on the same values, so nothing may differ).
The schedule exercises what the step decides before the update: two micro-steps under ``no_sync``
(accumulation; or, with ``accum``, two micro-steps of ``gradient_accumulation_steps`` added up in fp32,
``grad_accum_dtype``), gradient clipping, a step whose gradient holds an inf (skipped: bf16/fp32), and fp16
loss scaling from 2**20 (the first steps overflow and are skipped while the scale comes down).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable, Iterator

import torch
from torch import nn

import zero_kernels.optim as zo
from tests.helpers.lockstep import BUCKET, ROWS, STAGE3, Net, batch
from zero_kernels.offload import HostTier

STEPS = 4
NONFINITE_STEP = 2
CLIP = 0.05


@contextlib.contextmanager
def copying() -> Iterator[None]:
    """Tiers built inside copy to and from the "device" as from a GPU, though both are host memory here
    (``HostTier.share_host`` off; a spawned rank's own class attribute)."""
    HostTier.share_host = False
    try:
        yield
    finally:
        HostTier.share_host = True


def _make(
    model: Net, stage: int, dtype: torch.dtype, offload: dict | None, params: dict | None, accum: bool
) -> zo.ShardedFusedAdam:
    kwargs: dict = dict(STAGE3) if stage == 3 else {}
    if accum:
        kwargs.update(gradient_accumulation_steps=2, grad_accum_dtype="fp32")
    if params is not None:
        kwargs["offload_param"] = params
    if dtype == torch.float16:
        kwargs["fp16"] = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 2}
    if offload is not None:
        kwargs["offload_optimizer"] = offload
        kwargs["sub_group_size"] = 32  # several sub-groups: swapping is exercised
    return zo.ShardedFusedAdam(
        model, lr=2e-2, stage=stage, reduce_bucket_size=BUCKET, max_grad_norm=CLIP, amsgrad=True, **kwargs
    )


def _micro(model: Net, opt: zo.ShardedFusedAdam, rows: torch.Tensor, step: int, dtype: torch.dtype) -> None:
    loss = model(rows.to(dtype)).float()
    if step == NONFINITE_STEP and dtype != torch.float16:
        loss = loss * torch.tensor(float("inf"))
    if dtype == torch.float16:
        opt.backward(loss)
    else:
        loss.backward()


def differences(
    a: zo.ShardedFusedAdam, b: zo.ShardedFusedAdam, wa: dict[str, torch.Tensor], wb: dict[str, torch.Tensor], what: str
) -> list[str]:
    """What differs, bit for bit, between the weights ``wa`` and ``wb`` (name to tensor) and between the full optimizer
    states of ``a`` and ``b``: kinds of state, values (with their dtypes), non-tensor values and the groups'
    hyper-parameters."""
    found = [f"{what}: weight {n} differs" for n in wa if not torch.equal(wa[n], wb[n])]
    fa, fb = a.full_state_dict(), b.full_state_dict()
    if fa["state"].keys() != fb["state"].keys():
        return found + [f"{what}: state entries {sorted(fa['state'])} vs {sorted(fb['state'])}"]
    for i, sa in fa["state"].items():
        sb = fb["state"][i]
        if sa.keys() != sb.keys():
            found.append(f"{what}: state[{i}] holds {sorted(sa)} vs {sorted(sb)}")
        for kind in sa.keys() & sb.keys():
            x, y = sa[kind], sb[kind]
            same = torch.equal(x, y) and x.dtype == y.dtype if isinstance(x, torch.Tensor) else x == y
            if not same:
                found.append(f"{what}: state[{i}][{kind}] differs")
    groups = [[{k: v for k, v in g.items() if k != "params"} for g in f["param_groups"]] for f in (fa, fb)]
    if groups[0] != groups[1]:
        found.append(f"{what}: param_groups {groups[0]} vs {groups[1]}")
    return found


def assert_same(a: zo.ShardedFusedAdam, b: zo.ShardedFusedAdam, plain: nn.Module, tiered: nn.Module, what: str) -> None:
    """``plain`` and ``tiered`` (trained by ``a`` and ``b``) hold the same weights, and ``a`` and ``b`` the same full
    optimizer state (``differences``)."""
    with a.gathered_params(), b.gathered_params():
        wa = {n: p.detach().clone() for n, p in plain.named_parameters()}
        wb = {n: p.detach().clone() for n, p in tiered.named_parameters()}
    assert wa.keys() == wb.keys(), what
    found = differences(a, b, wa, wb, what)
    assert not found, "\n".join(found)


def pair_case(
    rank: int,
    world: int,
    stage: int,
    dtype: torch.dtype,
    offload: dict | None,
    params: dict | None = None,
    during: Callable[[zo.ShardedFusedAdam], None] | None = None,
    accum: bool = False,
) -> dict:
    """Train with and without ``offload`` (and ``params``: the ``offload_param`` block) and compare after every
    step (``offload`` None: ``params`` alone); returns the tiered optimizer's traffic (the tier's, and stage 3's
    host parameter shards' ``param_traffic``), the parameter count and, per buffer, (its first bucket in the tier,
    its buckets), for the caller's checks. With ``during``, it is called with the tiered optimizer after
    every step, and the comparison waits for the last step (reading the state or the gathered weights between
    steps changes where a tier keeps them). With ``accum``, the micro-steps are ``gradient_accumulation_steps``
    added up in fp32 (``grad_accum_dtype``) rather than ``no_sync``."""
    torch.manual_seed(0)
    plain = Net().to(dtype)
    tiered = copy.deepcopy(plain)
    a, b = _make(plain, stage, dtype, None, None, accum), _make(tiered, stage, dtype, offload, params, accum)
    if accum:  # the sums are kept in fp32, with and without the tier
        assert {b._pipeline.accumulate_dtype_of(buf) for buf in b._pipeline.buffers} == {torch.float32}
    for step in range(STEPS):
        x = batch(step, 2 * world * ROWS)
        for model, opt in ((plain, a), (tiered, b)):
            for m in range(2):
                rows = x[(m * world + rank) * ROWS : (m * world + rank + 1) * ROWS]
                with opt.no_sync() if m == 0 and not accum else contextlib.nullcontext():
                    _micro(model, opt, rows, step, dtype)
                if m == 0 and accum:
                    opt.step()  # a micro-step of the window: no update
            opt.step()
            opt.zero_grad()
        what = f"stage {stage} {dtype} {offload} params {params} step {step}"
        assert a.skipped_steps == b.skipped_steps, what
        if during is not None:
            during(b)
            if step < STEPS - 1:
                continue
        assert_same(a, b, plain, tiered, what)
    assert a.skipped_steps >= 1, "the schedule must skip a step"
    placed = [(buf.tier_from, len(buf.layout.buckets)) for buf in b._pipeline.buffers]  # ``offload_optimizer.ratio``
    numel = sum(buf.layout.shard_numel for buf in b._pipeline.buffers)
    on_host = sum(buf.layout.shard_numel for buf in b._pipeline.buffers if not getattr(buf, "persistent", True))
    device_numel = numel - on_host if params is not None else numel  # shards whose parameters stay on the device
    tier, host_params = b._pipeline.tier, getattr(b._pipeline, "host_params", None)
    return {"traffic": tier.traffic() if tier is not None else None, "shard_numel": numel,
            "device_numel": device_numel, "steps": STEPS, "placed": placed, "skipped": b.skipped_steps,
            "param_traffic": host_params.traffic() if host_params is not None else None}  # fmt: skip
