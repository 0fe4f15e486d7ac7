"""Small exchanges run on the device of the caller's tensors, never on whatever device happens to be current;
the construction-time checks stay small (no float64 copy of a parameter)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from zero_kernels import comm_objects


def test_collective_device_is_the_groups_bound_device() -> None:
    bound = torch.device("cuda", 3)  # what init_process_group(device_id=...) binds: LOCAL_RANK's GPU
    engine = SimpleNamespace(backend="nccl", group=SimpleNamespace(bound_device_id=bound), world_size=4)
    assert comm_objects.collective_device(engine) == bound
    gloo = SimpleNamespace(backend="gloo", group=None, world_size=4)
    assert comm_objects.collective_device(gloo) == torch.device("cpu")


def test_all_gather_objects_uses_the_device_it_is_given() -> None:
    seen = []

    class Recorder:
        backend, world_size = "nccl", 2

        def all_reduce(self, tensor, *, op, name):
            seen.append(tensor.device)
            tensor.fill_(16.0)
            return SimpleNamespace(wait=lambda: None)

        def all_gather(self, output, input, *, name):
            seen.append(output.device)
            output.view(2, -1).copy_(input.expand(2, -1))
            return SimpleNamespace(wait=lambda: None)

    assert comm_objects.all_gather_objects(Recorder(), 7, device="cpu") == [7, 7]
    assert seen == [torch.device("cpu")] * 2


def test_replication_check_makes_no_float64_copy_of_a_parameter() -> None:
    """The construction-time checksum (integer sums of the values' bits) never holds a 64-bit copy of a whole
    parameter (an 8.4 GB copy for a 128k x 8192 fp32 embedding)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from zero_kernels import agreement

    class LargestFloat64(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.dtype in (torch.float64, torch.int64):
                    self.numel = max(self.numel, t.numel())
            return out

    class Replicated:  # two ranks holding the same values: every all-reduce leaves its tensor as it is
        backend, world_size, rank = "gloo", 2, 0

        def all_reduce(self, tensor, *, op, name):
            return SimpleNamespace(wait=lambda: None)

    big = torch.randn((3 << 20) + 5)
    params = [big, torch.randn(7, dtype=torch.bfloat16), torch.randn(2, 3)]
    with LargestFloat64() as seen:
        agreement.check_replicated(Replicated(), params, [0, 1, 2], str)
    assert 0 < seen.numel <= big.numel() // 3, f"a float64 tensor of {seen.numel} elements for {big.numel()}"
    bits = big.view(torch.int32).long().remainder(agreement.CHECKSUM_MODULUS)  # the whole parameter at once
    weights = torch.arange(big.numel()).remainder(agreement.CHECKSUM_PERIOD) + 1
    whole = torch.stack([bits.sum(), bits.mul(weights).remainder(agreement.CHECKSUM_MODULUS).sum()])
    assert torch.equal(agreement._checksum(big), whole.remainder(agreement.CHECKSUM_MODULUS).double()), "chunked"
    assert agreement._checksum(params[2].flip(0))[1] != agreement._checksum(params[2])[1], "a permutation is unseen"


def test_checksum_is_the_same_on_ranks_with_other_thread_counts_and_for_nan() -> None:
    """Identical parameters give identical checksums whatever the rank's CPU thread count (a float64 ``dot`` or
    ``sum`` adds in another order with another number of threads: a rank with ``torch.set_num_threads(1)`` beside
    one with 2 had its identical weights refused as 'different values' at build), and a NaN, +0.0/-0.0 compare as
    equal values; a changed element, rows reversed and a swapped pair stay seen."""
    from zero_kernels.comm import agreement

    threads = torch.get_num_threads()
    try:
        for seed in range(4):
            p = torch.randn((1 << 20) + 3 * seed + 1, generator=torch.Generator().manual_seed(seed))
            torch.set_num_threads(1)
            one = agreement._checksum(p)
            torch.set_num_threads(2)
            two = agreement._checksum(p)
            assert torch.equal(one, two), f"seed {seed}: {one.tolist()} with 1 thread, {two.tolist()} with 2"
    finally:
        torch.set_num_threads(threads)
    nan = torch.randn(10)
    nan[3] = float("nan")
    assert torch.equal(agreement._checksum(nan), agreement._checksum(nan.clone())), "a NaN differs from itself"
    zeros = torch.zeros(5)
    assert torch.equal(agreement._checksum(zeros), agreement._checksum(-zeros)), "-0.0 differs from 0.0"
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        q = torch.randn(4, 6).to(dtype)
        changed = q.clone()
        changed[2, 3] = -changed[2, 3]
        swapped = q.clone().reshape(-1)
        swapped[[1, 5]] = swapped[[5, 1]]
        for other in (changed, q.flip(0), swapped.reshape(4, 6)):
            assert not torch.equal(agreement._checksum(other), agreement._checksum(q)), dtype


def test_checksum_leaves_the_values_of_every_dtype_as_they_were() -> None:
    """The checksum reads a parameter's bits through an integer view: for 8-byte elements (a frozen float64 or int64
    parameter, a complex128 one) that view's ``long()`` was the parameter's own memory, and the checksum's in-place
    remainder wrote its bit patterns modulo 2**24 - 3 into the parameter: on 2 ranks a frozen float64 parameter held
    denormals like 7.6e-317 after ``ShardedFusedAdam`` was built (at every stage), without an error."""
    from zero_kernels.comm import agreement

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float64, torch.complex128, torch.float32, torch.bfloat16, torch.float16):
        p = torch.randn(3, 5, generator=g).to(dtype)
        p[0, 0] = 0.0
        before = p.clone()
        agreement._checksum(p)
        assert torch.equal(p, before), f"{dtype}: the checksum changed the values"
    for dtype in (torch.int64, torch.int32, torch.int8):
        p = torch.randint(-100, 100, (7,), generator=g).to(dtype)
        p[0] = torch.iinfo(dtype).max
        before = p.clone()
        agreement._checksum(p)
        assert torch.equal(p, before), f"{dtype}: the checksum changed the values"
