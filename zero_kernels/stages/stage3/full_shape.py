"""Stage 3: each parameter tells its full shape under the names DeepSpeed gives it, ``ds_shape`` and ``ds_numel``.

Between uses a parameter holds an empty tensor and reports shape ``(0,)`` and ``numel() == 0``, as DeepSpeed's do.
Code written for ZeRO-3 reads the full size from these two attributes instead: PEFT's count of trainable parameters
(``print_trainable_parameters``) and the shapes of the adapters it adds, the Hugging Face Trainer's count of
parameters where it knows of ZeRO-3.
"""

from __future__ import annotations

import torch


def label(p: torch.Tensor, shape: torch.Size) -> None:
    """Give ``p`` its full ``shape`` as ``ds_shape`` and ``ds_numel``."""
    p.ds_shape = torch.Size(shape)
    p.ds_numel = torch.Size(shape).numel()


def unlabel(p: torch.Tensor) -> None:
    """Take ``label``'s attributes off ``p`` (the optimizer is closed: ``p`` holds its full value again)."""
    for name in ("ds_shape", "ds_numel"):
        p.__dict__.pop(name, None)
