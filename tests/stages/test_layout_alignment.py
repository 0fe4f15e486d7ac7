"""Every rank's part of every bucket starts on a 64-byte boundary and holds a multiple of 16 elements.

That is what the Adam kernel needs to compile to its vector variant (every pointer 16-byte aligned,
the length a multiple of 16) on real models, whose parameter counts are rarely round. Where step
counts differ, a bucket's update is split at parameter boundaries: each piece still launches on the
aligned span around it, updating the piece only (``adam_step``'s ``window``). Parameters
still lie back to back from the buffer's start and padding only follows the last one (stage 2
relies on it); padding is never saved in a checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_kernels.optim as zo
from zero_kernels.kernels import adam_step
from zero_kernels.layout import ALIGN_BYTES, BufferLayout, align_elements
from zero_kernels.stages import update

SHAPES = [(77,), (1,), (11, 5), (5,), (1000, 3), (3, 7, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 8])
@pytest.mark.parametrize("bucket_numel", [13, 1000, 1 << 20])
def test_rank_parts_aligned_params_back_to_back(dtype: torch.dtype, num_shards: int, bucket_numel: int) -> None:
    params = [torch.zeros(s, dtype=dtype) for s in SHAPES]
    layout = BufferLayout.build(params, bucket_numel=bucket_numel, num_shards=num_shards)
    unit = align_elements(params[0].element_size())
    size = params[0].element_size()
    total = sum(p.numel() for p in params)
    assert total <= layout.numel < total + num_shards * unit, "padding beyond one alignment unit per shard"
    offset = 0
    for slot in layout.slots:  # reversed order, back to back from 0
        assert slot.offset == offset
        offset += slot.numel
    for bucket in layout.buckets:
        assert bucket.shard_numel % 16 == 0, f"bucket {bucket.index}: rank parts of {bucket.shard_numel} elements"
        assert (bucket.shard_offset * 4) % ALIGN_BYTES == 0, f"bucket {bucket.index}: fp32 shard part misaligned"
        for rank in range(num_shards):
            assert (bucket.rank_start(rank) * size) % ALIGN_BYTES == 0, f"bucket {bucket.index} rank {rank}"
    for rank in range(num_shards):
        covered = sum(seg.numel for seg in layout.segments(rank))
        assert covered <= layout.shard_numel
    assert sum(seg.numel for r in range(num_shards) for seg in layout.segments(r)) == total


def _aligned_adam_case(rank: int, world: int) -> None:
    """Adam launches get 64-byte aligned shards of multiples of 16 elements: stage 1 (slices of the full
    gradient buffer) and stage 3 (gradient and parameter shards, as stage 2)."""
    seen: list[tuple[str, int, int]] = []
    real = update.adam_step

    def spy(param, grad, exp_avg, exp_avg_sq, **kwargs):
        tensors = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        if kwargs.get("out") is not None:
            tensors["out"] = kwargs["out"]
        for name, t in tensors.items():
            seen.append((name, t.data_ptr() % ALIGN_BYTES, t.numel() % 16))
        real(param, grad, exp_avg, exp_avg_sq, **kwargs)

    update.adam_step = spy
    try:
        for stage in (1, 3):
            for dtype in (torch.float32, torch.bfloat16):
                torch.manual_seed(0)
                model = nn.Sequential(nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)
                opt = zo.ShardedFusedAdam(
                    model, lr=1e-3, stage=stage, reduce_bucket_size=50, stage3_param_persistence_threshold=0
                )
                seen.clear()
                model(torch.randn(4, 13, dtype=dtype)).float().square().mean().backward()
                opt.step()
                assert seen, f"stage {stage} {dtype}: no Adam launch"
                bad = [s for s in seen if s[1] or s[2]]
                assert not bad, f"stage {stage} {dtype} rank {rank}: (tensor, address % 64, numel % 16) {bad[:4]}"
    finally:
        update.adam_step = real


@pytest.mark.distributed
def test_stage_adam_launches_are_aligned(spawn) -> None:
    spawn(_aligned_adam_case, 2)


class _Branchy(nn.Module):
    """Parameters that get a gradient in some steps only, so that their step counts drift apart."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(13, 7), nn.Linear(7, 7), nn.Linear(7, 3)

    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        if mode == "head":
            h = h.detach()
        elif mode == "all":
            h = torch.tanh(self.l2(h))
        return self.l3(h)


MODES = ("head", "all", "skip_mid", "all", "skip_mid", "head")


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_adam_launches_stay_aligned_when_step_counts_differ(stage: int, dtype: torch.dtype) -> None:
    """Runs split where step counts differ still launch on aligned spans of multiples of 16 elements (the
    run is the ``window``), and train as torch.optim.AdamW: a parameter without a gradient is untouched."""
    seen: list[tuple[int, int, tuple[int, int]]] = []
    real = update.adam_step

    def spy(param, grad, exp_avg, exp_avg_sq, **kwargs):
        tensors = [param, grad, exp_avg, exp_avg_sq] + [
            kwargs[k] for k in ("out", "max_exp_avg_sq") if kwargs.get(k) is not None
        ]
        for t in tensors:
            seen.append((t.data_ptr() % 16, t.numel() % 16, kwargs.get("window", (0, param.numel())), param.numel()))
        real(param, grad, exp_avg, exp_avg_sq, **kwargs)

    torch.manual_seed(0)
    model = _Branchy().to(dtype)
    ref = _Branchy().to(dtype)
    ref.load_state_dict(model.state_dict())
    master = {n: p.detach().float().clone().requires_grad_() for n, p in ref.named_parameters()}
    ropt = torch.optim.AdamW(master.values(), lr=1e-2, weight_decay=0.1)
    opt = zo.ShardedFusedAdam(model, lr=1e-2, weight_decay=0.1, stage=stage, impl="triton",
                              reduce_bucket_size=1 << 12, stage3_param_persistence_threshold=1 << 12)  # fmt: skip
    update.adam_step = spy
    try:
        for step, mode in enumerate(MODES):
            x = torch.randn(4, 13, generator=torch.Generator().manual_seed(step)).to(dtype)
            model(x, mode).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            ref(x, mode).float().square().mean().backward()
            for n, p in ref.named_parameters():
                master[n].grad = None if p.grad is None else p.grad.float()
                p.grad = None
            ropt.step()
            with torch.no_grad():
                for n, p in ref.named_parameters():
                    p.copy_(master[n])
    finally:
        update.adam_step = real
    bad = [s for s in seen if s[0] or s[1]]
    assert not bad, f"stage {stage}: (address % 16, numel % 16, window, launch) of misaligned launches: {bad[:4]}"
    assert any(w != (0, n) for _, _, w, n in seen), "no run was split: the case does not exercise the window"
    with opt.gathered_params():
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            tol = 1.3e-6 if dtype == torch.float32 else 1e-2
            assert torch.allclose(p.float(), q.float(), rtol=tol, atol=tol), f"stage {stage} {name} differs"
            assert torch.allclose(
                opt.state[p]["exp_avg"].float().reshape(q.shape),
                ropt.state[master[name]]["exp_avg"],
                rtol=1e-5,
                atol=1e-7,
            ), f"{name} exp_avg"


@pytest.mark.parametrize("impl", ["torch", "cpu", "triton"])
def test_window_updates_its_elements_only(impl: str) -> None:
    """``adam_step(..., window=(lo, hi))`` on an aligned span == ``adam_step`` on the piece ``[lo, hi)``; every
    other element (param, moments, AMSGrad maximum, the low-precision copy) keeps its bits."""
    n, lo, hi = 64, 13, 45
    g = torch.Generator().manual_seed(3)
    state = {k: torch.randn(n, generator=g).abs() for k in ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")}
    state["out"] = torch.randn(n, generator=g).to(torch.bfloat16)  # not the rounded param: must stay so outside
    grad = torch.randn(n, generator=g).to(torch.bfloat16)
    grad[3] = float("nan")  # outside the window: neither applied nor seen by found_inf
    window, piece = {k: v.clone() for k, v in state.items()}, {k: v.clone() for k, v in state.items()}
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=3, grad_scale=0.5)
    flags = {"window": torch.zeros(1), "piece": torch.zeros(1)}
    adam_step(window["param"], grad, window["exp_avg"], window["exp_avg_sq"], out=window["out"],
              max_exp_avg_sq=window["max_exp_avg_sq"], found_inf=flags["window"], window=(lo, hi), impl=impl,
              **hyper)  # fmt: skip
    adam_step(piece["param"][lo:hi], grad[lo:hi], piece["exp_avg"][lo:hi],
              piece["exp_avg_sq"][lo:hi], out=piece["out"][lo:hi], max_exp_avg_sq=piece["max_exp_avg_sq"][lo:hi],
              found_inf=flags["piece"], impl=impl, **hyper)  # fmt: skip
    assert flags["window"].item() == 0 == flags["piece"].item(), "the nan outside the window was seen"
    for k in state:
        assert torch.equal(window[k], piece[k]), f"{impl}: {k} differs from the update of the piece alone"
        outside = torch.cat([window[k][:lo], window[k][hi:]])
        assert torch.equal(outside, torch.cat([state[k][:lo], state[k][hi:]])), f"{impl}: {k} changed outside"
    with pytest.raises(ValueError, match="window"):
        adam_step(window["param"], grad, window["exp_avg"], window["exp_avg_sq"], window=(5, n + 1), impl=impl,
                  **hyper)  # fmt: skip
