"""Parameters whose memory overlaps, refused: the optimizer gives each parameter a slot of its own in its flat
buffers, so two parameters on one storage (``head.weight.data = embed.weight.data``), trained by
``torch.optim.AdamW`` as one tied weight, would be untied without a word. Checked when the optimizer is built
(``optim.args``) and where a ``.data`` replaced since is followed (``adopt.readopt``). Disjoint views of one tensor
(interleaved columns, every other row) do not overlap and are taken."""

from __future__ import annotations

from typing import Callable, Iterable

import torch


def check_no_aliases(params: Iterable[torch.Tensor], describe: Callable[[torch.Tensor], str]) -> None:
    """``ValueError`` for two parameters whose memory overlaps (``head.weight.data = embed.weight.data``): each gets a
    slot of its own in the flat buffers, which would untie them silently."""
    spans = []
    for p in params:
        if p.numel() == 0 or p.device.type == "meta":
            continue
        start, end = _span(p)
        spans.append((p.untyped_storage().data_ptr(), start * p.element_size(), end * p.element_size(), p))
    spans.sort(key=lambda span: span[:3])
    open_spans: list[tuple[int, int, torch.Tensor]] = []  # (storage, end, tensor) that may reach the next ones
    for where_b, start_b, end_b, b in spans:
        open_spans = [span for span in open_spans if span[0] == where_b and span[1] > start_b]
        a = next((t for _, _, t in open_spans if _share_elements(t, b)), None)
        open_spans.append((where_b, end_b, b))
        if a is not None:
            raise ValueError(
                f"{describe(a)} and {describe(b)} share memory (one was given the other's storage, as "
                "`b.data = a.data` does): ShardedFusedAdam gives each parameter a slot of its own, which would "
                "untie them. Tie them as one Parameter (`model.head.weight = model.embed.weight`), as torch's weight "
                "tying does"
            )


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of ``a`` and ``b`` (first to last element used) overlap."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (start_a, end_a), (start_b, end_b) = _span(a), _span(b)
    return (
        start_a * a.element_size() < end_b * b.element_size() and start_b * b.element_size() < end_a * a.element_size()
    )


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The first element of ``t``'s storage it uses and one past its last."""
    start = t.storage_offset()
    return start, start + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one storage whose spans overlap use a common element (interleaved slices of one
    tensor, ``big[:, :4]`` and ``big[:, 4:]``, do not); another element size counts as sharing."""
    if (a.is_contiguous() and b.is_contiguous()) or a.element_size() != b.element_size():
        return True
    lo, end = min(a.storage_offset(), b.storage_offset()), max(_span(a)[1], _span(b)[1])
    used = torch.zeros(end - lo, dtype=torch.bool)
    used.as_strided(a.shape, a.stride(), a.storage_offset() - lo).fill_(True)
    return bool(used.as_strided(b.shape, b.stride(), b.storage_offset() - lo).any())
