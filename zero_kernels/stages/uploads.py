"""Copies up from page-locked host memory still in flight, which a host write into their source must wait for.

A parameter shard in host memory (``offload_param``; the tier's host copies) is copied up to the device for a
gather without waiting (``non_blocking``): the copy reads the host memory when the device's queue reaches it,
which may be long after the host went on. A host write into that memory before then (the step's host update, a
loaded state dict or checkpoint, values assigned to a freed parameter, ``gathered_params()`` writing back) would
change what the copy reads, and a gather still queued would see half-new values. So each such copy records an
event on its stream (``copy_up``) and every host writer of a shard calls ``wait()`` first. A copy from pageable
memory returns once it has read it, and where the device is host memory nothing is copied: nothing is recorded.
"""

from __future__ import annotations

import torch


class Uploads:
    """The last copy up from page-locked host memory on each stream, until ``wait``."""

    def __init__(self) -> None:
        self._last: dict[tuple[int, int], torch.cuda.Event] = {}  # (device, stream) -> after its last copy up

    def copy_up(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` (host memory) copied to ``device`` without waiting; its host memory stays read until ``wait``."""
        up = t.to(device, non_blocking=True)
        if device.type == "cuda" and t.is_pinned():
            stream = torch.cuda.current_stream(device)
            event = torch.cuda.Event()
            event.record(stream)
            self._last[(stream.device_index, stream.stream_id)] = event
        return up

    def wait(self) -> None:
        """Before a host write into a shard: every copy up recorded so far has read its host memory."""
        for event in self._last.values():
            event.synchronize()
        self._last.clear()
