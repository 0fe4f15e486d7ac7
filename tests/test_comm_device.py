"""Small exchanges run on the device of the caller's tensors, never on whatever device happens to be current."""

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
