"""The fp32 master of bf16/fp16 parameters follows what is written into the parameters.

Low-precision parameters are trained through this rank's fp32 master shard (``FlatBuffer.master``):
each step writes the parameters as the master rounded to their dtype, so between steps every
parameter element is its master rounded, unless code outside the optimizer wrote the parameter:
in place (``model.load_state_dict(pretrained)``, ``p.clamp_()``, ``p.data.mul_()``) or by replacing
``p.data`` (``stages.adopt``). Such writes are found by value, not by version counters (``p.data``
has a version counter of its own, so ``p.data.mul_()`` bumps none the optimizer could watch):

- the step's kernel reads this rank's low-precision shard (``adam_step(adopt_out=True)``: one more
  2-byte read per element) and, where an element is not the master rounded, starts the update from
  the element's value. Elements the step does not update (a parameter no rank has a gradient for, a
  skipped step) keep the written value and are adopted by the next step that updates them;
- ``adopt_edits`` does the same for code that reads the master between steps (state dicts,
  checkpoints): ``sync`` before reading.

A master element that still rounds to its parameter keeps its extra precision.

Writes into the master itself (``opt.state[p]["master"]``, a view of the shard) win over the
parameter: its version counter, which views share, moves, and the next step first writes the
parameters from the master (``push_written``); so does the next read of the state (``sync``), so that
a state dict holds a master that rounds to its parameter (loaded, a master that does not is taken
for an old one and gives way to the parameter: ``state_door``). A copy of the optimizer, which may
copy the parameters before or after it, carries the flag instead (``unrecord``). Every write the
optimizer itself makes into a master (a load, a refresh, a CPU step run by the reference kernel) is
``record``-ed, so only writes from outside count.

Inside stage 3's ``gathered_params()`` the model reads and writes the gathered buffer, which the block's end
writes back to the shards: there the master follows, and is pushed into, that buffer's part of this rank
(``Pipeline.live_param_shard``), so a state read inside the block neither misses the block's edits nor
loses a master written before it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .base import FlatBuffer, Pipeline
    from .layout import Bucket


def record(buf: "FlatBuffer") -> None:
    """The master of ``buf`` as it is now is the optimizer's own (a write made by the optimizer)."""
    if buf.master is not None:
        buf.master_version = buf.master._version


def unrecord(buf: "FlatBuffer") -> None:
    """The master of ``buf`` as it is now counts as written from outside (a copy of a master that was)."""
    if buf.master is not None:
        buf.master_version = -1


def record_all(pipeline: "Pipeline") -> None:
    """``record`` every buffer of ``pipeline``."""
    for buf in pipeline.buffers:
        record(buf)


def written(buf: "FlatBuffer") -> bool:
    """True when code outside the optimizer wrote into the master of ``buf`` since the optimizer last did."""
    return buf.master is not None and buf.master._version != buf.master_version


def edited(params: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """Where ``params`` (low precision) are not ``master`` rounded to their dtype, bit for bit (as the kernels do)."""
    bits = torch.int16 if params.element_size() == 2 else torch.int32
    return params.view(bits) != master.to(params.dtype).view(bits)


def adopt_edits(pipeline: "Pipeline", buf: "FlatBuffer") -> bool:
    """Give the master of ``buf`` the parameter values wherever they are not the master rounded (this rank's shard);
    return whether any element took one."""
    if buf.master is None:
        return False
    buf.ready()
    took = False
    for bucket in buf.layout.buckets:
        took = take(buf, bucket, pipeline.live_param_shard(buf, bucket)) or took
    record(buf)
    return took


def take(buf: "FlatBuffer", bucket: "Bucket", shard: torch.Tensor) -> bool:
    """``bucket``'s part of the master of ``buf`` (whole: ``FlatBuffer.ready``) takes the values of ``shard``, this
    rank's parameters of the bucket, wherever they are not the master rounded; return whether any element did. The
    caller ``record``-s the buffer."""
    master = buf.shard_slice(buf.master, bucket)
    shard = shard.to(master.device)  # a copy down when the state is offloaded
    where = edited(shard, master)
    master.copy_(shard.float().where(where, master))
    return bool(where.any())


def sync(pipeline: "Pipeline") -> None:
    """Before reading the masters between steps: a master written from outside gives the parameters its values
    (as the next step would), every other takes the parameters' edits."""
    for buf in pipeline.buffers:
        settle(pipeline, buf)


def settle(pipeline: "Pipeline", buf: "FlatBuffer") -> bool:
    """After the parameters of ``buf`` may have been written: its master, if written from outside, gives them its
    values, else takes their edits; return whether the master took any."""
    if written(buf):
        push(pipeline, buf)
        return False
    return adopt_edits(pipeline, buf)


def push_written(pipeline: "Pipeline") -> None:
    """At the step, before the update: a master written from outside gives this rank's parameters its values."""
    for buf in pipeline.buffers:
        if written(buf):
            push(pipeline, buf)


def push(pipeline: "Pipeline", buf: "FlatBuffer") -> None:
    """This rank's parameters of ``buf`` take its master's values, rounded, in the shard and where the model reads
    them now (stage 3 inside ``gathered_params()``); the master is the optimizer's again. A host shard is written
    only once the copies up still reading it (stage 3's gathers with ``offload_param``) are done."""
    pipeline.uploads.wait()
    for bucket in buf.layout.buckets:
        value = buf.shard_slice(buf.master, bucket)
        shard, live = pipeline.param_shard(buf, bucket), pipeline.live_param_shard(buf, bucket)
        shard.copy_(value)
        if live.data_ptr() != shard.data_ptr():
            live.copy_(value)
    record(buf)
