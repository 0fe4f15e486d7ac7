"""Flatten tables: built once per layout (no host synchronisation in backward), never reused for an address
whose alignment differs.

Stage 2 and 3 build each flatten table once, on the first step.

Stage 2 copies each gradient into its bucket with one flatten launch as it arrives. The launch's table
(offsets, sizes, chunks) must not depend on where the gradient lives: on CUDA the caching allocator
may hand out new addresses every step, and a table keyed on them is rebuilt (and copied to the
device) for every parameter of every step. Here each step's gradients are kept alive so that the
next step's land at new addresses, and the tables built and host copies made are counted per step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton.language as tl
from torch import nn

import zero_kernels as zk
from zero_kernels.kernels import flatten, triton_flatten

STEPS = 3


@pytest.mark.parametrize("stage", [2, 3])
def test_tables_built_on_the_first_step_only(stage: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 7), nn.LayerNorm(7))
    kept: list[torch.Tensor] = []  # every step's gradients stay alive: the next step's get new addresses
    for p in model.parameters():  # registered first, so it sees p.grad before the optimizer takes it
        p.register_post_accumulate_grad_hook(lambda p: kept.append(p.grad))
    opt = zk.ShardedFusedAdam(
        model, lr=1e-3, stage=stage, impl="triton", reduce_bucket_size=64, stage3_param_persistence_threshold=0
    )
    triton_flatten.cache_clear()
    built, copies, addresses = [], [], []
    for step in range(STEPS):
        before = triton_flatten.cache_info()
        kept_before = len(kept)
        model(torch.randn(5, 12)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        after = triton_flatten.cache_info()
        built.append(after["misses"] - before["misses"])
        copies.append(after["host_copies"] - before["host_copies"])
        addresses.append({g.data_ptr() for g in kept[kept_before:]})
    assert all(not (addresses[i] & addresses[j]) for i in range(STEPS) for j in range(i)), "addresses were reused"
    pieces = sum(len(buf.layout.slot_buckets[i]) for buf in opt._pipeline.buffers for i in range(len(buf.layout.slots)))
    assert 0 < built[0] <= pieces, f"first step: {built[0]} tables built, at most one per parameter piece ({pieces})"
    assert built[1:] == [0] * (STEPS - 1), f"tables built per step: {built}"
    assert copies == built, f"host copies per step: {copies} (one per table built)"


def _hints_fault_when_false(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the interpreter fault as a GPU does on a false ``tl.multiple_of`` hint.

    On a GPU the hint lets the compiler issue 16-byte vector loads and stores, which fault
    (misaligned address) when the pointer is not a multiple of 16 after all; the interpreter only
    records the hint. Here a hint that does not hold for the values it is given raises.
    """
    from triton.runtime import interpreter

    patch_core = interpreter._patch_lang_core

    def patched(lang: Any, scope: Any) -> None:
        patch_core(lang, scope)
        record = lang.multiple_of

        def multiple_of(value: Any, divisor: Any) -> Any:
            if isinstance(value, tl.tensor):
                wrong = [int(v) for v in value.handle.data.reshape(-1) if int(v) % int(divisor)]
                if wrong:
                    raise RuntimeError(f"misaligned address: {wrong[0]:#x} is not a multiple of {divisor}")
            return record(value, divisor)

        scope.set_attr(lang, "multiple_of", multiple_of)

    monkeypatch.setattr(interpreter, "_patch_lang_core", patched)


def test_table_follows_the_flat_buffers_residue(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flat buffer at 4 (mod 16) with an offset of 12 bytes is aligned; at 8 (mod 16) it is not: the table
    built for the first must not serve the second (its vector path would fault on a GPU)."""
    _hints_fault_when_false(monkeypatch)
    base = torch.zeros(128)
    assert base.data_ptr() % 64 == 0, "the CPU allocator is expected to hand out 64-byte aligned blocks"
    tensor = torch.randn(32)  # aligned, 32 elements: the vector path wherever its flat side is aligned too
    triton_flatten.cache_clear()
    at_4, at_8 = base[1:49], base[2:50]  # flat buffers at 4 and 8 (mod 16); the tensor goes to offset 3
    assert triton_flatten.bucket_layouts([tensor], [3], at_4)["aligned"] == 1
    flatten([tensor], at_4, [3], impl="triton")
    assert torch.equal(at_4[3:35], tensor)
    assert triton_flatten.bucket_layouts([tensor], [3], at_8) == {
        "aligned": 0, "contiguous": 1, "strided": 0, "fallback": 0
    }  # fmt: skip
    flatten([tensor], at_8, [3], impl="triton")
    assert torch.equal(at_8[3:35], tensor)
    back = torch.zeros(32)
    triton_flatten.unflatten_triton(at_8, [back], [3])
    assert torch.equal(back, tensor)


def test_tables_kept_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables of one tensor are keyed on its layout: models of new shapes, trained one after another (a search over
    widths), built new ones without end. Both caches keep the most recently used."""
    monkeypatch.setattr(triton_flatten, "LAYOUT_TABLES", 3)
    monkeypatch.setattr(triton_flatten, "POINTER_TABLES", 2)
    triton_flatten.cache_clear()
    for width in range(1, 9):
        tensor, other = torch.randn(width), torch.randn(width + 1)
        flat = torch.zeros(2 * width + 1)
        flatten([tensor], flat, [0], impl="triton")
        flatten([tensor, other], flat, [0, width], impl="triton")
        assert torch.equal(flat[:width], tensor) and torch.equal(flat[width:], other)
        assert triton_flatten.cache_info()["size"] <= 3 + 2
    assert triton_flatten.cache_info()["misses"] == 16
