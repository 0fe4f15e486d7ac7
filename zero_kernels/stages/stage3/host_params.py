"""Stage 3's parameter shards off the device where the optimizer state is not all offloaded: ``offload_param``
without ``offload_optimizer``, or with its ``ratio`` below 1.

With all the state in the tier (``offload_optimizer``, ``ratio`` 1) a unit's shard is the tier's host copy and the
host Adam writes it (``Stage3Pipeline._allocate``). Otherwise ``place`` moves each sharded unit's shard (persistent
units stay on the device) into a host tensor of its own, page-locked with ``offload_param.pin_memory`` where CUDA
is there; the tier's host copy of its part of the shard (``ratio`` below 1) becomes a view of it, so the host Adam
writes the shard itself there too. With ``offload_param`` on nvme the units past ``max_in_cpu`` then go on to their
files (``disk_params``), and the host tensor is dropped (``drop``).

- Gathers copy a host shard up first (``gathers.on_device``), as with the tier.
- The update of a bucket whose state is on the device runs the device's kernel on a copy of the bucket's shard
  on the device (``staged``; a shard in a file is read into a pool buffer first and written back after, by the
  pipeline): the shard goes up (the kernel adopts what was written into it since the last step, as without
  offload), the kernel writes the new values there, and they go down into the shard. Per step: 2 + 2 bytes per
  parameter in bf16/fp16, 4 + 4 in fp32 (whose shard is its own master), counted in ``traffic``.

Where the device is host memory (a CPU-only machine) the shard is there already: it stays where it is and nothing
is copied, unless ``HostTier.share_host`` is off (the tests run the copies on the CPU that way).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from ...offload import HostShard, HostTier
from .. import placement

if TYPE_CHECKING:
    from .pipeline import Stage3Buffer


class HostParams:
    """The host shards of the units ``place`` moved (see the module docstring).

    Args:
        pin: ``offload_param.pin_memory`` (page-locked where CUDA is there).
    """

    def __init__(self, pin: bool):
        self.pin = pin and torch.cuda.is_available()
        self.shards: dict[int, torch.Tensor] = {}  # id(buffer) -> its shard in host memory
        self.moved: set[int] = set()  # id(buffer) of every unit whose shard left the device (host memory, a file)
        self.bytes_up = 0
        self.bytes_down = 0

    def place(self, buf: "Stage3Buffer", tier_shard: Optional[HostShard]) -> None:
        """Move ``buf``'s parameter shard into host memory (``tier_shard``: the tier's host copies of its part of
        ``buf``, whose ``params`` become a view of the shard), unless it is host memory already."""
        if HostTier.shares(buf.param_shard.device):
            return
        host = torch.empty(buf.param_shard.numel(), dtype=buf.dtype, pin_memory=self.pin)
        host.copy_(buf.param_shard)
        buf.param_shard = host
        self.shards[id(buf)] = host
        self.moved.add(id(buf))
        if tier_shard is not None and tier_shard.params is not None:
            tier_shard.params = host.narrow(0, placement.cut(buf), placement.tier_numel(buf))

    def drop(self, buf: "Stage3Buffer") -> None:
        """``buf``'s shard went on to a file (``disk_params``): its host tensor is no longer held."""
        self.shards.pop(id(buf), None)

    @contextlib.contextmanager
    def staged(self, buf: "Stage3Buffer", shard: torch.Tensor) -> Iterator[torch.Tensor]:
        """``shard`` (this rank's parameters of one bucket of ``buf``) where the device's update reads and writes
        it: a copy on the device when ``buf``'s shard left the device, written back after the block."""
        if id(buf) not in self.moved:
            yield shard
            return
        scratch = torch.empty(shard.shape, dtype=shard.dtype, device=buf.device)
        scratch.copy_(shard)
        self.bytes_up += shard.numel() * shard.element_size()
        yield scratch
        shard.copy_(scratch)
        self.bytes_down += shard.numel() * shard.element_size()

    def tensors(self) -> list[torch.Tensor]:
        """The host shards (``memory_report()["host"]``)."""
        return list(self.shards.values())

    def traffic(self) -> dict[str, int]:
        """Bytes that crossed for the device's updates since construction: ``up`` and ``down``."""
        return {"up": self.bytes_up, "down": self.bytes_down}
