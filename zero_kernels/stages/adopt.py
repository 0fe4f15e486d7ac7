"""Parameters replaced after the optimizer was built: followed when possible, refused when not.

A pipeline makes each ``p.data`` a view of its flat parameter buffer (stage 3: of the gathered
buffer, or an empty tensor while freed). Code outside the optimizer may replace ``p.data``: the
Hugging Face Trainer calls ``model.to(device)`` (on CPUs ``"cpu:0"`` copies every tensor), users
write ``p.data = ...``. The step then updated a buffer the model no longer reads: training
silently stopped. ``follow_replaced`` runs before every step and re-adopts such parameters: the
new values are copied into the buffer, ``p.data`` views it again, and the fp32 master shard takes
the new values wherever they differ from what the master rounds to (``master.adopt_edits``: a copy
with equal values keeps the master's extra precision). Values written in place need none of this:
the step finds them (``master``). A new dtype, device or shape cannot be followed: it raises
``ValueError`` naming the parameter (a freed stage-3 parameter too, whose empty tensor a cast gives the
new dtype: ``check_freed``; cast back, ``model.half(); model.float()``, its shard takes the rounding the casts give
a held tensor: ``cast_through``). ``Parameter`` objects replaced in the model
(``load_state_dict(..., assign=True)``, a module swapped) are caught by ``check_module_params``.

Stage 3 units that are freed take assigned values into their shard (``adopt_freed``) wherever the others
are followed (before the step and before the state is read) and just before their next gather; units
gathered by ``gathered_params()`` re-adopt (``readopt``) when the block ends.

A parameter frozen (``requires_grad=False``) when the optimizer was built has no place in its
buffers (stage 3 keeps it in a frozen unit that no step updates, ``stage3.frozen``): unfrozen later and
left in its param group, it would get gradients that no step uses (``torch.optim.AdamW`` would train it;
DeepSpeed, which also shards only what is trainable at ``initialize``, would not). ``check_unfrozen`` raises
then instead. Given to ``add_param_group`` after it is unfrozen, it is trained from then on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Container, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from . import master
from .aliases import check_no_aliases, overlaps
from .casts import cast_through, take_casts, was_cast

if TYPE_CHECKING:
    from .base import FlatBuffer, Pipeline

NameOf = Callable[[torch.Tensor], str]


def _views(p: torch.Tensor, flat: torch.Tensor, offset: int, shape: torch.Size) -> bool:
    same = p.dtype == flat.dtype and p.device == flat.device and tuple(p.shape) == tuple(shape)
    return same and p.data_ptr() == flat[offset:].data_ptr()


def param_name(module: nn.Module, p: torch.Tensor) -> str:
    """``parameter 'name'`` of ``p`` in ``module`` (for error messages)."""
    for name, q in module.named_parameters():
        if q is p:
            return f"parameter {name!r}"
    return f"a parameter of shape {tuple(p.shape)}"


def _fits(buf: "FlatBuffer", p: torch.Tensor, shape: torch.Size) -> bool:
    return tuple(p.shape) == tuple(shape) and p.dtype == buf.dtype and p.device == buf.device


def remedy(p: torch.Tensor, shape: torch.Size) -> str:
    """What to do about a replacement ``p`` the buffers cannot take (``shape``: the one they hold), for messages."""
    if tuple(p.shape) != tuple(shape):
        return (
            "its shape changed, which a built optimizer cannot follow: resize the model (resize_token_embeddings) "
            "before building the optimizer"
        )
    return "move or cast the model (model.to(...), model.half()) before building the optimizer"


def check_compatible(buf: "FlatBuffer", p: torch.Tensor, shape: torch.Size, name_of: NameOf) -> None:
    """A replacement the buffers can take: same shape, dtype and device."""
    if _fits(buf, p, shape):
        return
    raise ValueError(
        f"{name_of(p)} was replaced after the optimizer was built and is now {p.dtype} {tuple(p.shape)} on "
        f"{p.device}, while the optimizer holds {buf.dtype} {tuple(shape)} on {buf.device}: {remedy(p, shape)}"
    )


def check_freed(buf: "FlatBuffer", params: Sequence[torch.Tensor], name_of: NameOf) -> None:
    """Freed (empty) stage-3 parameters still of the buffer's dtype and device: a cast or move of the model
    (``model.to(torch.bfloat16)``, ``model.double()``) gives them an empty tensor of the new dtype, which the next
    gather would replace without a word. Runs before every gather, so a freed parameter's metadata is read past its
    ``__torch_function__`` (``stage3.guard``): through it, its dtype and device took about 0.1 ms (a busy CPU)."""
    with torch._C.DisableTorchFunctionSubclass():
        p = next((p for p in params if p.numel() == 0 and (p.dtype != buf.dtype or p.device != buf.device)), None)
        if p is None:
            return
        dtype, device = p.dtype, p.device
    raise ValueError(
        f"{name_of(p)} was cast or moved after the optimizer was built and is now {dtype} on {device}, while the "
        f"optimizer holds {buf.dtype} on {buf.device}: move or cast the model (model.to(...), model.half()) before "
        "building the optimizer"
    )


def replaced(buf: "FlatBuffer", flat: torch.Tensor) -> bool:
    """Whether some parameter of ``buf`` no longer views ``flat`` (its ``.data`` was assigned)."""
    return any(s.numel and not _views(buf.params[s.param], flat, s.offset, s.shape) for s in buf.layout.slots)


def readopt(buf: "FlatBuffer", flat: torch.Tensor, name_of: NameOf, everyone: Iterable[torch.Tensor] = ()) -> int:
    """Parameters of ``buf`` whose ``.data`` no longer views ``flat`` (its full buffer): their values are copied
    into ``flat`` and ``.data`` views it again; returns how many. A replacement that shares memory with another
    parameter (``b.data = a.data``: a tie ``torch.optim.AdamW`` would train as one weight) raises first, naming
    both (``aliases``): copied into a slot of its own, it would be untied without a word.

    Args:
        buf: the buffer.
        flat: the full buffer its parameters view (``param_flat``, or a stage-3 unit's gathered buffer).
        name_of: names a parameter in error messages.
        everyone: every parameter of the optimizer (its other buffers' too), checked with ``buf``'s for shared
            memory when one of ``buf``'s was replaced; by default ``buf``'s own.
    """
    moved = [s for s in buf.layout.slots if s.numel and not _views(buf.params[s.param], flat, s.offset, s.shape)]
    if moved:
        everyone = list(everyone) or buf.params
        check_no_aliases(everyone, name_of)
        _copy_misplaced([buf.params[s.param] for s in moved], everyone, buf.params, flat)
    for slot in moved:
        p = buf.params[slot.param]
        check_compatible(buf, p, slot.shape, name_of)
        view = flat.narrow(0, slot.offset, slot.numel)
        view.copy_(p.detach().reshape(-1))
        p.data = view.view(slot.shape)
    return len(moved)


def _copy_misplaced(
    moved: Sequence[torch.Tensor], everyone: Sequence[torch.Tensor], own: Sequence[torch.Tensor], flat: torch.Tensor
) -> None:
    """Parameters that view ``flat`` away from their own slot (``moved`` ones of its buffer, any of another buffer's:
    ``a.data, b.data = b.data, a.data`` swaps two slots) take a copy of their values first: re-adopting one writes
    into the slot another views, which then lost its values (both trained from one of them, 0.6 off AdamW)."""
    mine = {id(p) for p in own}
    for p in [*moved, *(q for q in everyone if id(q) not in mine)]:
        if overlaps(p, flat):
            p.data = p.data.clone()


def misfits(buf: "FlatBuffer", flat: torch.Tensor, name_of: NameOf) -> list[tuple[str, str, str, str]]:
    """(name, what it is now, what ``buf`` holds, ``remedy``) of each parameter whose ``.data`` was replaced by a
    tensor ``readopt`` cannot take (another shape, dtype or device)."""
    found = []
    for slot in buf.layout.slots:
        p = buf.params[slot.param]
        if slot.numel == 0 or _views(p, flat, slot.offset, slot.shape) or _fits(buf, p, slot.shape):
            continue
        now, holds = f"{p.dtype} {tuple(p.shape)} on {p.device}", f"{buf.dtype} {tuple(slot.shape)} on {buf.device}"
        found.append((name_of(p), now, holds, remedy(p, slot.shape)))
    return found


def put_back(buf: "FlatBuffer", flat: torch.Tensor) -> None:
    """Every parameter of ``buf`` views ``flat`` again: a replaced ``.data`` is dropped, its values not taken."""
    for slot in buf.layout.slots:
        p = buf.params[slot.param]
        if slot.numel != 0 and not _views(p, flat, slot.offset, slot.shape):
            p.data = flat.narrow(0, slot.offset, slot.numel).view(slot.shape)


def follow_replaced(pipeline: "Pipeline", name_of: NameOf) -> int:
    """Re-adopt parameters whose ``.data`` no longer views the flat buffer; returns how many.

    Args:
        pipeline: the optimizer's pipeline (buffers without ``param_flat`` are stage-3 units, skipped).
        name_of: names a parameter in error messages.
    """
    return sum(follow_buffer(pipeline, buf, name_of) for buf in pipeline.buffers)


def follow_buffer(pipeline: "Pipeline", buf: "FlatBuffer", name_of: NameOf) -> int:
    """``follow_replaced`` for the parameters of ``buf`` alone; returns how many it re-adopted."""
    if buf.param_flat is None:
        return adopt_freed(pipeline, buf, name_of)
    count = readopt(buf, buf.param_flat, name_of, every_param(pipeline))
    if count:
        master.adopt_edits(pipeline, buf)
    return count


def every_param(pipeline: "Pipeline") -> Iterator[torch.Tensor]:
    """The trainable parameters of every buffer of ``pipeline`` (for ``readopt``'s shared-memory check)."""
    return (p for buf in pipeline.buffers for p in buf.params)


def adopt_freed(pipeline: "Pipeline", buf: "FlatBuffer", name_of: NameOf) -> int:
    """A freed stage-3 unit whose parameters were given values (``p.data = ...`` outside a forward): this rank's
    parts go into its parameter shard (and fp32 master) now, and the parameters are freed again, so state reads
    and the step see the new values and the next gather does not bring back what the step updated; returns how
    many parameters. A unit gathered now (``full``) re-adopts when it is freed (``readopt``).

    Args:
        pipeline: the stage-3 pipeline.
        buf: one of its units' buffers (``Stage3Buffer``).
        name_of: names a parameter in error messages.
    """
    if getattr(buf, "full", None) is not None or getattr(buf, "param_shard", None) is None:
        return 0
    assigned = [p for p in buf.params if p.numel() != 0]
    if given_values(buf.params):
        buf.ready()  # a shard kept in a file (stage 3's offload_param on nvme) is read in to take the values
    if not adopt_assigned_shard(pipeline, buf, buf.param_shard, name_of):
        return 0
    for p in assigned:
        p.data = torch.empty(0, dtype=buf.dtype, device=buf.device)
    return len(assigned)


def current(pipeline: "Pipeline") -> None:
    """Before the optimizer's state is read between steps (state dicts, checkpoints): replaced parameters are
    followed and the fp32 masters take what was written into the parameters (``master.sync``)."""
    follow_replaced(pipeline, pipeline.name_of)
    master.sync(pipeline)


def adopt_assigned_shard(pipeline: "Pipeline", buf: "FlatBuffer", shard: torch.Tensor, name_of: NameOf) -> bool:
    """A freed stage-3 unit whose parameters were given full values: copy this rank's parts into ``shard``.

    Args:
        pipeline: the stage-3 pipeline.
        buf: the unit's buffer (its parameters are empty tensors while freed).
        shard: the unit's parameter shard, the all-gather source.
        name_of: names a parameter in error messages.
    """
    check_freed(buf, buf.params, name_of)
    if not given_values(buf.params):
        return False
    # casts noted before a value was assigned are superseded by it (taken all the same, or a later gather rounds it)
    casts = {id(p): take_casts(p) for p in buf.params}
    pipeline.writing_params(buf)  # a rank whose shard holds none of it is not written (stage 3's hpZ partitions)
    pipeline.uploads.wait()  # a copy up still reading the shard (``uploads``)
    for slot in buf.layout.slots:
        p = buf.params[slot.param]
        if p.numel() != 0:
            check_compatible(buf, p, slot.shape, name_of)
    for seg in buf.layout.segments(pipeline.shard_rank):
        p = buf.param_of(seg.slot)
        target = shard.narrow(0, seg.shard_offset, seg.numel)
        if p.numel() != 0:
            target.copy_(p.detach().reshape(-1).narrow(0, seg.param_offset, seg.numel))
        elif casts.get(id(p)):
            target.copy_(cast_through(target, casts[id(p)]))
    master.adopt_edits(pipeline, buf)
    return True


def given_values(params: Sequence[torch.Tensor]) -> bool:
    """Whether some freed stage-3 parameter of ``params`` was given values (``p.data = ...``) or cast to another
    dtype and back (``model.half(); model.float()``), which its shard must take before it is read or gathered."""
    return any(p.numel() != 0 or was_cast(p) for p in params)


def check_module_params(module: nn.Module, held: Mapping[str, int]) -> None:
    """Every model parameter the optimizer was built with is still the model's ``Parameter`` object, or another
    one the optimizer holds (``model.embed.weight = model.head.weight`` after the optimizer was built ties the two as
    the other direction does: the replaced one gets no gradient and is left alone, as by ``torch.optim.AdamW``).

    Args:
        module: the model.
        held: model name -> ``id`` of the parameter the optimizer holds under that name.
    """
    ids = set(held.values())  # a Parameter the optimizer holds under another name (a weight tied since) trains on
    for name, p in module.named_parameters():
        if name in held and held[name] != id(p) and id(p) not in ids:
            raise ValueError(
                f"model parameter {name!r} is no longer the Parameter the optimizer was built with (replaced by "
                "load_state_dict(..., assign=True), a reassigned module or nn.Parameter): build the optimizer "
                "after that, or copy values in place (load_state_dict without assign=True)"
            )


def check_unfrozen(groups: Sequence[Mapping[str, Any]], trainable: Container[int], name: Callable[[int], str]) -> None:
    """Raise ``ValueError`` when a parameter frozen at construction has a gradient now (see the module docstring).

    Args:
        groups: the optimizer's param groups.
        trainable: optimizer indices of the parameters the pipeline holds (trainable at construction).
        name: names a parameter by its optimizer index in the error.
    """
    index = 0
    for group in groups:
        for p in group["params"]:
            if index not in trainable and p.requires_grad and p.grad is not None:
                raise ValueError(
                    f"{name(index)} was frozen (requires_grad=False) when it was given to the optimizer (at "
                    "construction or add_param_group) and has a gradient now: ZeRO shards only the parameters that "
                    "are trainable when given, so no step would use it. Unfreeze it before giving it (a new "
                    "optimizer can load opt.full_state_dict()), or build the optimizer without it (on the trainable "
                    "parameters only) and give it to opt.add_param_group once unfrozen, or freeze it again; nothing "
                    "was updated"
                )
            index += 1
