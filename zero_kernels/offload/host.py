"""The host tier: this rank's optimizer state in host memory, and what crosses the bus each step.

The state tensors of a buffer (``exp_avg``, ``exp_avg_sq``, AMSGrad's maximum, the fp32 ``master`` of
bf16/fp16 parameters) are host tensors (page-locked when CUDA is available and ``pin_memory`` is
set), allocated by ``zeros``/``empty``. Each buffer also has two host copies in the parameters' and
the gradients' dtypes (``HostShard``):

- ``params``: this rank's parameter shard as the tier last pushed it up. The update writes the new
  low-precision values into it (fp32 parameters: it is their master) and ``up`` copies each bucket
  to the device: 2 bytes per parameter for bf16/fp16, 4 for fp32.
- ``grads``: each bucket of the reduced gradient shard, copied down (``down``) in the dtype the stage
  keeps it in (bf16 gradients: 2 bytes per parameter).

Where the "device" is host memory (a CPU-only machine) the copies would be the device tensors' bytes a
second time in the same memory: the tier makes none (``shares``), and the update reads and writes the
device shards in place (nothing crosses, nothing is counted). ``share_host`` False makes the tier copy
there too, as it does from a GPU (the tests run that path on the CPU).

Writes into the device parameters between steps (a loaded checkpoint, ``p.data.mul_()``) are found
without copying the parameters down (``changed``): the device bucket's ``fingerprint`` (three exact sums
of its bits as 16-bit words, position-weighted 1, i+1 and (i+1)**2, computed on the device) is compared with the one
taken when the tier last pushed it up, on the device; only a bucket that differs is copied down, and
the update then adopts it exactly as without offload. (Where the "device" is the CPU, the bits are
compared directly.)

``bytes_down``/``bytes_up`` count what crossed (``traffic``). The host Adam runs on ``threads``
threads: ``ZERO_KERNELS_CPU_ADAM_THREADS`` when set, else ``cpuadam_cores_perc`` of this process's
cores (``cpu_threads``).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Hashable, Iterator, Optional

import torch

from ..config.offload import OffloadOptimizerConfig
from ..env import cpu_adam_threads

THREADS_VARIABLE = "ZERO_KERNELS_CPU_ADAM_THREADS"  # read by ``env.cpu_adam_threads``
_CHUNK = 1 << 22  # words per pass of ``fingerprint``: its int64 temporaries take 32 MiB each


def cpu_threads(share: float) -> int:
    """Threads of the host Adam: ``ZERO_KERNELS_CPU_ADAM_THREADS``, else ``share`` of the usable cores (>= 1)."""
    given = cpu_adam_threads()
    if given is not None:
        return given
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, int(cores * share))


def words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as 16-bit words (compared bit for bit: -0.0 is not 0.0, a NaN equals itself)."""
    return t.view(torch.int16)


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Three sums of ``t``'s 16-bit words w_i (i = 0, 1, ...) on ``t``'s device, in int64 arithmetic that wraps
    (exact mod 2**64 whatever the order of summation): sum w_i, sum (i+1)*w_i and sum (i+1)**2*w_i.

    Below 2**46 words, no changed word and no swap of two words or of two fp32 elements leaves the prints
    equal, since a nonzero integer below 2**64 in size is not 0 mod 2**64: a changed word moves the first sum
    by d (|d| < 2**16); a swap moves the second by (w_j - w_i)*(j - i). Where that cancels for several words
    moved in step (two swaps the same distance apart with opposite differences, as the two words of an fp32
    swap can be), the squared weights do not: for the fp32 swap, the third moves by 4*d*(j - i).
    Taken in chunks of ``_CHUNK`` words: two int64 temporaries at a time, nothing kept between calls."""
    w = words(t).reshape(-1)
    parts = [_sums(w[at : at + _CHUNK], at) for at in range(0, w.numel(), _CHUNK)]
    return torch.stack(parts).sum(0) if parts else torch.zeros(3, dtype=torch.int64, device=t.device)


def _sums(chunk: torch.Tensor, at: int) -> torch.Tensor:
    """``fingerprint``'s three sums over the words ``chunk`` that start at word ``at``."""
    w = chunk.to(torch.int64)
    position = torch.arange(at + 1, at + 1 + w.numel(), dtype=torch.int64, device=w.device)
    plain = w.sum()
    weighted = w.mul_(position)
    return torch.stack([plain, weighted.sum(), weighted.mul_(position).sum()])


@dataclass
class HostShard:
    """A buffer's host copies over the ``numel`` elements of this rank's shard whose state is in the tier:
    ``params`` (param dtype; None where the device shard is host memory already, ``HostTier.shares``, or where
    stage 3 keeps the shard in a file, ``offload_param`` on nvme) and ``grads`` (``grad_dtype``; made by the
    first bucket copied down, ``HostTier.gradients``); ``state``: that part of each state tensor while the
    pipeline keeps the rest on the device (``spill``)."""

    numel: int
    params: Optional[torch.Tensor]
    grad_dtype: torch.dtype
    grads: Optional[torch.Tensor] = None
    state: dict[str, torch.Tensor] = field(default_factory=dict)


class HostTier:
    """Optimizer state in host memory (see the module docstring).

    Args:
        config: the ``offload_optimizer`` block.
    """

    kind = "host"
    share_host = True  # False: host copies even of host tensors, as from a GPU (see the module docstring)

    def __init__(self, config: OffloadOptimizerConfig):
        self.config = config
        self.pin = bool(config.pin_memory) and torch.cuda.is_available()
        self.threads = cpu_threads(config.cpuadam_cores_perc)
        self.device = torch.device("cpu")
        self.shards: dict[int, HostShard] = {}  # id(buffer) -> its host copies
        self._prints: dict[Hashable, torch.Tensor] = {}  # piece -> fingerprint of its device values (``changed``)
        self.bytes_down = 0
        self.bytes_up = 0
        self.bytes_init = 0  # copied down once, when a buffer joined

    # ---------------------------------------------------------------- host memory
    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor (page-locked when the tier pins)."""
        return torch.empty(numel, dtype=dtype, device=self.device, pin_memory=self.pin)

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.empty(numel, dtype).zero_()

    @classmethod
    def shares(cls, device: torch.device) -> bool:
        """Whether the tensors of a buffer on ``device`` are host memory used in place (no host copy): the tier's
        state and copies, stage 3's parameter shards and frozen chunks with ``offload_param``."""
        return cls.share_host and torch.device(device).type == "cpu"

    def attach(
        self, key: int, shard_numel: int, dtype: torch.dtype, grad_dtype: torch.dtype, device: torch.device
    ) -> HostShard:
        """Register a buffer (``key``: its id) on ``device`` whose state is in the tier over ``shard_numel``
        elements of its shard; a parameter copy unless ``shares(device)`` (the caller fills it with ``init``)."""
        params = None if self.shares(device) else self.empty(shard_numel, dtype)
        shard = HostShard(shard_numel, params, grad_dtype)
        self.shards[key] = shard
        return shard

    def discard(self, key: int) -> None:
        """Forget a buffer that could not be set up (``attach`` done, its state not placed); the others stay."""
        self.shards.pop(key, None)
        for piece in [k for k in self._prints if isinstance(k, tuple) and k[0] == key]:
            del self._prints[piece]  # a later buffer may get the same id: no stale fingerprint for it

    def init(self, dst: torch.Tensor, src: torch.Tensor, key: Hashable) -> None:
        """The first copy of a buffer's parameters down (counted apart from the steps' traffic); ``key`` names
        the piece for ``changed``."""
        dst.copy_(src)
        self.bytes_init += src.numel() * src.element_size()
        self._remember(key, src)

    # ---------------------------------------------------------------- crossing the bus
    def down(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Copy a device tensor into its host copy ``dst`` (same dtype); returns ``dst``."""
        dst.copy_(src)
        self.bytes_down += src.numel() * src.element_size()
        return dst

    def gradients(self, shard: HostShard, src: torch.Tensor, at: int) -> torch.Tensor:
        """A bucket's reduced gradients ``src`` for the host Adam: ``src`` itself where it is host memory in the
        copy's dtype (``shares``), else copied down into ``shard.grads`` from element ``at``."""
        if self.shares(src.device) and src.dtype == shard.grad_dtype:
            return src
        if shard.grads is None:
            shard.grads = self.empty(shard.numel, shard.grad_dtype)
        return self.down(shard.grads.narrow(0, at, src.numel()), src)

    def up(self, dst: torch.Tensor, src: torch.Tensor, key: Optional[Hashable] = None) -> None:
        """Copy a host tensor into its device place ``dst`` (``key``: the piece, for ``changed``)."""
        dst.copy_(src)
        self.bytes_up += src.numel() * src.element_size()
        if key is not None:
            self._remember(key, dst)

    def changed(self, key: Hashable, device_part: torch.Tensor, host_part: torch.Tensor) -> bool:
        """Whether the device tensor differs from the host copy last pushed up or taken down for ``key``.

        Where the "device" is host memory too (a CPU-only machine, ``bitwise``) the bits themselves are
        compared; else the device's ``fingerprint`` is compared with the one taken when the copy was made,
        on the device: nothing but the answer crosses the bus, and the host does no work.
        """
        if self.bitwise(device_part.device):
            return not torch.equal(words(device_part), words(host_part))
        return self._print_changed(key, device_part)

    def bitwise(self, device: torch.device) -> bool:
        """Whether ``changed`` compares a piece on ``device`` with its host copy bit for bit (``device`` is the
        tier's own memory) rather than by ``fingerprint`` (a GPU; the tests force that branch here)."""
        return torch.device(device) == self.device

    def _print_changed(self, key: Hashable, device_part: torch.Tensor) -> bool:
        now = fingerprint(device_part)
        before = self._prints.get(key)
        self._prints[key] = now
        return before is None or not torch.equal(now, before)

    def _remember(self, key: Hashable, device_part: torch.Tensor) -> None:
        if not self.bitwise(device_part.device):
            self._prints[key] = fingerprint(device_part)

    def traffic(self) -> dict[str, int]:
        """Bytes that crossed since construction: ``down``, ``up`` (steps), ``init`` (first copies)."""
        return {"down": self.bytes_down, "up": self.bytes_up, "init": self.bytes_init}

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """The host Adam's threads inside the block (torch's intra-op pool, which the C++ kernel uses)."""
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    # ---------------------------------------------------------------- the state
    def spill(self, key: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep the tier's part of a buffer's state (``{kind: host tensor}``: copies are kept)."""
        kept = {}
        for kind, t in tensors.items():
            kept[kind] = self.empty(t.numel(), t.dtype).copy_(t)
        self.shards[key].state = kept

    def fill(self, key: int, tensors: dict[str, torch.Tensor]) -> None:
        """Copy the part ``spill`` kept into ``{kind: host tensor}`` and let it go."""
        kept = self.shards[key].state
        for kind, t in tensors.items():
            t.copy_(kept[kind])
        self.shards[key].state = {}

    def host_tensors(self) -> list[torch.Tensor]:
        """The tier's own host copies and the state parts it keeps (the resident state tensors are the buffers')."""
        copies = [t for s in self.shards.values() for t in (s.params, s.grads) if t is not None]
        return copies + [t for s in self.shards.values() for t in s.state.values()]

    def disk_bytes(self) -> int:
        """Bytes of the state's files (none: the state is in memory)."""
        return 0

    def finish(self) -> None:
        """After a step's last bucket (the disk tier waits for its writes)."""

    def close(self) -> None:
        """Nothing to release beyond memory (the disk tier removes its files)."""
