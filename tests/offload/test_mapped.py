"""``offload.mapped_empty``: host tensors on a mapping of their own, unmapped when freed; and the squared norm of
16-bit gradients widened into one, which must be the term ``stats.partial`` takes of them, bit for bit."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from zero_kernels.offload import mapped_empty
from zero_kernels.stages import stats

# In a child whose glibc serves every allocation under 32 MiB from its heap (the most its run-time threshold reaches):
# the 12 MiB tensor is a mapping of its own all the same (''; the heap's is '[heap]'), and goes when it is freed.
_CHILD = """
import gc, torch
from zero_kernels.offload import mapped_empty

def mapping_of(address):
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5] if len(fields) > 5 else "anonymous"
    return "unmapped"

heap = torch.empty(3 << 20, dtype=torch.float32)
t = mapped_empty(3 << 20, torch.float32)
t.fill_(1.5)
address = t.data_ptr()
print(mapping_of(heap.data_ptr()), mapping_of(address), address % 4096, float(t.sum()) == 1.5 * (3 << 20))
del t
gc.collect()
print(mapping_of(address))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/maps") or platform.libc_ver()[0] != "glibc", reason="glibc, Linux")
def test_tensor_is_its_own_mapping_and_goes_with_it() -> None:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[heap]", "anonymous", "0", "True", "unmapped"], done.stdout


def test_sizes_dtypes_and_bad_numel() -> None:
    assert mapped_empty(0, torch.bfloat16).shape == (0,)
    t = mapped_empty(5, torch.float16)
    t.copy_(torch.arange(5))
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and t.dtype == torch.float16
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="mapped_empty: numel must be an integer >= 0"):
            mapped_empty(bad, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widened_copy_gives_the_same_squared_norm_term(dtype: torch.dtype) -> None:
    for numel, seed in [(1, 0), (4099, 1), (1 << 20, 2), (3_000_001, 3)]:
        torch.manual_seed(seed)
        v = (torch.randn(numel) * 3.0 ** (seed - 2)).to(dtype)
        wide = mapped_empty(numel, torch.float32).copy_(v)
        assert torch.equal(stats.partial(wide, norm=True), stats.partial(v, norm=True)), (dtype, numel)
