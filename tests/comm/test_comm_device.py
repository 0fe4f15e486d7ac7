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
    """The construction-time checksum is a float64 sum that never holds a float64 copy of a whole parameter
    (an 8.4 GB copy for a 128k x 8192 fp32 embedding)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from zero_kernels import agreement

    class LargestFloat64(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
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
    whole = torch.cat([big.double().sum().reshape(1), params[1].double().sum().reshape(1)])
    chunked = torch.stack([agreement._checksum(big)[0], agreement._checksum(params[1])[0]])
    assert torch.allclose(chunked, whole, rtol=1e-12), "the chunked float64 sum is not the sum"
    weights = torch.arange(big.numel(), dtype=torch.float64).remainder(agreement.CHECKSUM_PERIOD) + 1
    weighted = agreement._checksum(big)[1]
    assert torch.allclose(weighted, big.double().dot(weights), rtol=1e-12), "the weighted sum is not the weighted sum"
    assert agreement._checksum(params[2].flip(0))[1] != agreement._checksum(params[2])[1], "a permutation is unseen"
