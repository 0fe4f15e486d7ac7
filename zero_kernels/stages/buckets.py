"""How many elements a bucket holds: the config bounds it, the communication backend chooses inside.

``reduce_bucket_size`` (and, for the stages that all-gather parameters bucket by bucket after the
step, ``allgather_bucket_size``) are read as DeepSpeed documents them: the number of elements one
reduction (one all-gather) handles at a time, a bound on the memory it holds. Within that bound
the bucket is cut at the size the backend overlaps best with backward (``GRANULE_BYTES``): a
bucket of the whole model (what 5e7 or DeepSpeed's default 5e8 gives on most models) would start
its reduction only after backward ends, so nothing would overlap.

Measured per backend: gloo on 2 CPU ranks of this project's machine (``benchmarks/RESULTS.md``).
NCCL's value follows DDP's 25 MB bucket and the tens of MB where NCCL reaches its bandwidth; it was
not measured here (no GPU). A backend not listed (or no process group) uses the bound alone.
"""

from __future__ import annotations

from typing import Optional

GRANULE_BYTES: dict[str, int] = {
    "gloo": 8_000_000,  # 2M fp32 elements, measured: see benchmarks/RESULTS.md (issue 17)
    "nccl": 32 << 20,  # not measured here: DDP's 25 MB buckets, NCCL's bandwidth plateau
}


def bucket_numel(
    backend: str, element_size: int, reduce_bucket_size: int, allgather_bucket_size: Optional[int] = None
) -> int:
    """Elements per bucket: the backend's granule, never more than the configured bounds.

    Args:
        backend: the process group's backend (``engine.backend``: gloo, nccl, local, ...).
        element_size: bytes per element of the buffer.
        reduce_bucket_size: ``zero_optimization.reduce_bucket_size`` (elements).
        allgather_bucket_size: ``zero_optimization.allgather_bucket_size`` (elements) when the stage
            all-gathers parameters by bucket; None when it does not.
    """
    bound = int(reduce_bucket_size)
    if allgather_bucket_size is not None:
        bound = min(bound, int(allgather_bucket_size))
    granule = GRANULE_BYTES.get(backend)
    if granule is None:
        return bound
    return max(1, min(bound, granule // element_size))
