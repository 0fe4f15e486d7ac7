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
outside the forward inside ``gathered_params()``, and copy (``clone()``) what must outlive it.

The buffer, and the empty tensor a freed parameter holds, are made outside ``torch.inference_mode()`` even
when the first gather runs inside it (an evaluation before training): an inference tensor could not be
refilled by the gathers of a later training forward, nor give a parameter that autograd can use.
"""

from __future__ import annotations

from typing import Optional

import torch


class GatherStorage:
    """The full buffer of one unit: ``take()`` before a gather, ``release()`` at a free."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self._tensor: Optional[torch.Tensor] = None

    def take(self) -> torch.Tensor:
        """The buffer to gather into: its storage allocated again (the same storage object every time)."""
        if self._tensor is None:
            with torch.inference_mode(False):
                self._tensor = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        else:
            storage = self._tensor.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(self.numel * self._tensor.element_size())
        return self._tensor

    def release(self) -> None:
        """Give the buffer's bytes back, whatever still views it."""
        if self._tensor is not None:
            self._tensor.untyped_storage().resize_(0)


def freed(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The empty tensor a freed parameter holds (``p.data``), never an inference tensor (outside inference mode
    without entering ``inference_mode(False)``: a free makes one for every parameter)."""
    if not torch.is_inference_mode_enabled():
        return torch.empty(0, dtype=dtype, device=device)
    with torch.inference_mode(False):
        return torch.empty(0, dtype=dtype, device=device)
