"""A unit's gathered buffer with one storage for its whole life: a free empties that storage.

Autograd keeps what a forward saves for backward, and what it saves may view a gathered parameter:
``nn.Linear`` saves ``weight.t()``, a view of the storage the weight was gathered into. Dropping the
buffer at a free would release nothing then: the saved views would hold every unit the forward
gathered until its backward ran. So a free resizes the storage itself to no bytes (as FSDP does), and
the next gather refills the same storage: the saved views read the gathered values again once the
backward has gathered the unit before its use (the scheduler's backward pre-hooks), and the forward
holds only the units in use. The cost, as with FSDP: a view of a gathered parameter kept past a free
(``w = self.weight.t()`` stored away in a forward) has no data until the next gather, and computing with
it then is not defined (PyTorch raises for some operations and crashes in others); read parameters
outside the forward inside ``gathered_params()``, and copy (``clone()``) what must outlive it. A storage
moved to shared memory (the model pickled by ``torch.multiprocessing``'s pickler inside ``gathered_params()``:
DataLoader workers or a ``Process`` started there, not forked) is never resized (torch crashes growing it again):
its free leaves it to the processes that share it, and the next gather takes a new storage; so is one a NumPy view
has marked not resizable (``p.detach().numpy()``), whose bytes go with its last reference.

What ``gathered_params()`` hands out is different: a user reads parameters there to keep them
(``sd = model.state_dict()``, ``p.detach()``, ``e.data, p.data = p.data, e.data`` to swap in an EMA), as with
DeepSpeed's ``GatheredParameters`` and torch. So the end of the block leaves a storage that got views while the
block had it gathered to those views (``release(hand_over=True)``): they keep the values, and the next gather
takes a new storage. The storage's use count, above what it was when the block gathered the unit, says whether
any were taken (autograd's saved views of a forward before the block were there already: such a storage is
emptied as at any free). A parameter whose ``.data`` was assigned in the block (the swap above) has its new
values written back through a new storage (``renew``): the old one keeps the values the other tensor was given.

On a GPU the buffer's block belongs to the stream its gather was issued on (a prefetch: the module before's), and a
module run under another stream (``torch.cuda.stream(s)`` in a parent's forward) reads it there: the stream that
first reads it after the gather (``used``) and the one that frees it are told to the allocator (``record_stream``),
so that the free does not hand the block to the gathering stream's next allocation while those reads are queued.

The buffer, and the empty tensor a freed parameter holds, are made outside ``torch.inference_mode()`` even
when the first gather runs inside it (an evaluation before training): an inference tensor could not be
refilled by the gathers of a later training forward, nor give a parameter that autograd can use.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...comm.handles import used_here


def _uses(tensor: torch.Tensor) -> int:
    """How many tensors (and Python storage objects) hold ``tensor``'s storage."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def _in_shared_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s host storage was moved to shared memory (torch.multiprocessing's pickler: a DataLoader
    worker or a ``Process`` started with the model inside ``gathered_params()``): such a storage cannot be resized,
    torch crashes (SIGSEGV) growing it again. (``is_shared()`` is always true of a CUDA storage, which is resized.)"""
    return not tensor.is_cuda and tensor.untyped_storage().is_shared()


def _not_resizable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage cannot be resized: in shared memory (``_in_shared_memory``), or pinned by a
    NumPy view (``p.detach().numpy()``, as ``torch.utils.tensorboard``'s ``add_histogram`` takes of a CPU tensor:
    torch marks the storage not resizable for good, even once the array is gone)."""
    return _in_shared_memory(tensor) or not tensor.untyped_storage().resizable()


class GatherStorage:
    """The full buffer of one unit: ``take()`` before a gather, ``release()`` at a free."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self._tensor: Optional[torch.Tensor] = None
        self._taken_uses = 0  # ``_uses`` of the buffer when last taken

    def take(self) -> torch.Tensor:
        """The buffer to gather into: its storage allocated again (the same storage object every time)."""
        if self._tensor is None:
            with torch.inference_mode(False):
                self._tensor = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        else:
            storage = self._tensor.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(self.numel * self._tensor.element_size())
        self._taken_uses = _uses(self._tensor)  # what views it already (autograd's saved views of an earlier forward)
        return self._tensor

    def renew(self) -> torch.Tensor:
        """A new storage holding the buffer's values (``take()`` must have been called); the old one is left to
        whatever else views it."""
        old, self._tensor = self._tensor, None
        return self.take().copy_(old)

    def used(self) -> None:
        """The buffer is read on the current stream from now on (the gather waited for there): told to the allocator
        where that is not the stream it was taken on (CUDA; see the module docstring)."""
        if self._tensor is not None:
            used_here(self._tensor)

    def release(self, hand_over: bool = False) -> None:
        """Give the buffer's bytes back, whatever still views it; ``hand_over`` (the end of ``gathered_params()``):
        where something else views them (a ``state_dict()`` or ``p.detach()`` taken in the block), leave them to it
        and gather into a new storage next time; a storage that cannot be resized (``_not_resizable``: in shared
        memory, viewed by NumPy) is left likewise (its bytes go with the last reference)."""
        if self._tensor is None:
            return
        used_here(self._tensor)  # the freeing stream's reads (of the module that used it last) come before a reuse
        if (hand_over and _uses(self._tensor) > self._taken_uses) or _not_resizable(self._tensor):
            self._tensor = None
        else:
            self._tensor.untyped_storage().resize_(0)


def freed(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The empty tensor a freed parameter holds (``p.data``), never an inference tensor (outside inference mode
    without entering ``inference_mode(False)``: a free makes one for every parameter)."""
    if not torch.is_inference_mode_enabled():
        return torch.empty(0, dtype=dtype, device=device)
    with torch.inference_mode(False):
        return torch.empty(0, dtype=dtype, device=device)
