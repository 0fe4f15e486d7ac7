"""Ranks must agree: the optimizer's options and hyper-parameters compared across ranks.

Ranks that disagree on an option that shapes the collectives (stage, bucket sizes, dtypes, the
param groups) would issue mismatched collectives, which crash inside the backend or hang; ranks that
disagree on a hyper-parameter (``lr``, ...) would train silently wrong, each shard updated with its
own rank's value. So:

- at construction, each param group's parameter values are compared (``check_replicated``), and
  each param group is checked before its first collective (``check_same``: one
  all-gather of a small fingerprint: the options, the group's hyper-parameters and its parameters'
  dtypes and shapes), and the number of groups once construction is done;
- at every step, the values that can change (``lr``, betas, eps, weight decay, clipping, gradient
  scale) travel in the step's existing stats exchange (``stages.stats``) and are compared there.

A disagreement raises ``RanksDisagree`` on every rank, naming the key, every value and its ranks.
"""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from .objects import all_gather_objects

_ABSENT = "(absent)"


class RanksDisagree(ValueError):
    """The ranks were given different options or hyper-parameters; the message names the key and the values."""


def ranks_text(ranks: Sequence[int], global_ranks: Optional[Sequence[int]] = None) -> str:
    """``[0]`` -> ``"rank 0"``; ``[0, 1, 2, 5]`` -> ``"ranks 0-2, 5"``. With ``global_ranks`` (an engine's: the
    global rank of each of its process group's ranks, None where they are the job's), each rank's global rank
    follows: ``[1]`` on the group of ranks 0 and 2 -> ``"rank 1 (global rank 2)"``."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    word = "rank" if len(ranks) == 1 else "ranks"
    if global_ranks is None:
        return f"{word} {text}"
    return f"{word} {text} (global {word} {', '.join(str(global_ranks[r]) for r in sorted(ranks))})"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def disagreement(key: str, values: Sequence[Any], global_ranks: Optional[Sequence[int]] = None) -> Optional[str]:
    """None when every rank's value (``values[rank]``) equals rank 0's, else a sentence naming them all (with their
    global ranks: ``ranks_text``)."""
    if all(_same(v, values[0]) for v in values):
        return None
    groups: list[tuple[Any, list[int]]] = []
    for rank, value in enumerate(values):
        for seen, ranks in groups:
            if _same(seen, value):
                ranks.append(rank)
                break
        else:
            groups.append((value, [rank]))
    shown = ", ".join(f"{v if v is _ABSENT else repr(v)} on {ranks_text(ranks, global_ranks)}" for v, ranks in groups)
    return f"the ranks disagree on {key}: {shown}"


def check_same(engine: Any, fingerprint: Mapping[str, Any], what: str, device: Optional[torch.device] = None) -> None:
    """Raise ``RanksDisagree`` on every rank unless every rank passed an equal ``fingerprint``.

    A collective (``comm.objects.all_gather_objects``) whose shape does not depend on the fingerprint, so it
    is safe whatever the ranks disagree on. Values should be plain (numbers, strings, tuples).

    Args:
        engine: the communication engine (``comm.make_engine``).
        fingerprint: key -> value; keys in the order they should be reported.
        what: who checks, for the message (e.g. "ShardedFusedAdam").
        device: where the exchange runs: the device of the tensors it is about (on NCCL this rank's GPU,
            the parameters' device; None: ``comm.objects.collective_device``).
    """
    if engine.world_size == 1:
        return
    rows = all_gather_objects(engine, dict(fingerprint), name="check.options", device=device)
    keys = list(rows[0])
    for row in rows[1:]:
        keys += [k for k in row if k not in rows[0]]
    for key in keys:
        message = disagreement(key, [row.get(key, _ABSENT) for row in rows], engine.global_ranks)
        if message is not None:
            raise RanksDisagree(
                f"{what}: {message}. Every rank must build the optimizer with the same options, param groups "
                "and hyper-parameters (same config, same code path)"
            )


def options_fingerprint(options: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The optimizer-wide values ranks must agree on: the ``zero_optimization`` options and ``settings``.

    Args:
        options: the ``config.ZeroOptions``.
        settings: other optimizer-wide values by name (``adam_w_mode``, ``max_grad_norm``, ...).
    """
    out: dict[str, Any] = {"stage": options.stage}
    for f in fields(options):
        if f.name != "stage":
            out.update(_option(f"zero_optimization.{f.name}", getattr(options, f.name)))
    out.update(settings)
    return out


RANK_LOCAL = ("nvme_path",)  # options each rank may set for itself (a node's own disk)


def _option(key: str, value: Any) -> dict[str, Any]:
    """A nested block (a dataclass) compared key by key, without its ``RANK_LOCAL`` keys."""
    if not is_dataclass(value):
        return {key: value}
    return {f"{key}.{f.name}": getattr(value, f.name) for f in fields(value) if f.name not in RANK_LOCAL}


def group_fingerprint(g: int, group: Mapping[str, Any], names: Mapping[int, str]) -> dict[str, Any]:
    """Param group ``g``'s hyper-parameters and, per parameter, its dtype, shape, device type and trainability.

    Args:
        g: index of the group.
        group: the group (``params`` and hyper-parameters, as in ``param_groups``).
        names: ``id(parameter)`` -> model name, where known (used in the keys).
    """
    out: dict[str, Any] = {
        f"param_groups[{g}]['lr']": float(group["lr"]),
        f"param_groups[{g}]['betas']": tuple(float(b) for b in group["betas"]),
        f"param_groups[{g}]['eps']": float(group["eps"]),
        f"param_groups[{g}]['weight_decay']": float(group["weight_decay"]),
        f"param_groups[{g}]['amsgrad']": bool(group.get("amsgrad", False)),
        f"param_groups[{g}]['maximize']": bool(group.get("maximize", False)),
        f"the number of parameters of param_groups[{g}]": len(group["params"]),
    }
    for i, p in enumerate(group["params"]):
        name = names.get(id(p))
        key = f"param_groups[{g}]['params'][{i}]" + (f" ({name!r})" if name else "")
        kind = "trainable" if p.requires_grad else "frozen"
        out[key] = f"{str(p.dtype).removeprefix('torch.')} {tuple(p.shape)} {kind} on {p.device.type}"
    return out


def check_optimizer(
    opt: Any, label: str, *, group: Optional[int] = None, names: Optional[Mapping[int, str]] = None
) -> None:
    """Every rank must be at ``label`` of building ``opt`` with the same options and param group ``group``.

    Args:
        opt: the ``ShardedFusedAdam`` being built.
        label: where construction stands ("adding param group 1", ...): ranks at different points
            (a different number of param groups) disagree on it.
        group: the index of the param group being added (None: compare ``label`` only).
        names: ``id(parameter)`` -> model name, to name parameters in the message.
    """
    fingerprint: dict[str, Any] = {"the construction step": label}
    if group is not None:
        scaler = opt.loss_scaler
        settings = {
            "adam_w_mode": opt.adam_w_mode,
            "max_grad_norm": opt.max_grad_norm,
            "gradient_accumulation_steps": opt.gradient_accumulation_steps,
            "fp16 loss scaling": None
            if scaler is None
            else (scaler.scale, scaler.dynamic, scaler.window, scaler.hysteresis, scaler.min_scale),
            "skip_nonfinite_steps": opt.skip_nonfinite_steps,
            "communication_data_type": str(opt.communication_data_type),
            "grad_accum_dtype": str(opt.grad_accum_dtype),
            "the comm engine": opt.pipeline.engine.kind,
        }
        fingerprint.update(options_fingerprint(opt.options, settings))
        fingerprint.update(group_fingerprint(group, opt.param_groups[group], names or {}))
    check_same(opt.pipeline.engine, fingerprint, "ShardedFusedAdam", device=opt.pipeline.device)


CHECKSUM_CHUNK = 1 << 20  # elements checksummed at a time: at most an 8 MiB int64 copy
CHECKSUM_PERIOD = 65521  # the position weights of ``_checksum`` repeat after this many elements (a prime)
CHECKSUM_MODULUS = 16_777_213  # 2**24 - 3, a prime: the checksums are sums of bit patterns modulo it
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}  # element size -> its integer twin


def _checksum(p: torch.Tensor) -> torch.Tensor:
    """Two checksums of ``p``'s values, a float64 tensor of 2 on its device: the sum of their bit patterns, and
    that sum weighted by position (each element times its index mod ``CHECKSUM_PERIOD``, plus one), which a
    permutation of the values (rank 0's reversed) changes where the plain sum does not; both modulo
    ``CHECKSUM_MODULUS``.

    In integers, exact: a float64 ``sum``/``dot`` adds in an order that depends on the thread count (a rank with
    ``torch.set_num_threads(1)`` beside one with 2 had its identical values refused as different), and a NaN made
    it NaN, unequal to itself. Equal bits are equal values (a NaN, on every rank), zeros count as +0.0.
    Chunk by chunk: a whole-parameter copy would hold 8.4 GB for a 128k x 8192 embedding. Each term is below
    2**24 * 2**16, so a chunk's sums stay far inside int64.
    """
    flat = p.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    sums = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start, chunk in zip(range(0, flat.numel(), CHECKSUM_CHUNK), flat.split(CHECKSUM_CHUNK)):
        words = chunk.view(_BITS[chunk.element_size()]) if chunk.is_floating_point() else chunk
        bits = words.to(torch.int64, copy=True)  # for 8-byte elements ``long()`` gave the parameter's own memory
        if chunk.is_floating_point():
            bits.masked_fill_(chunk == 0, 0)
        bits = bits.remainder_(CHECKSUM_MODULUS)
        weights = torch.arange(start, start + bits.numel(), dtype=torch.int64, device=flat.device)
        weighted = bits.mul(weights.remainder_(CHECKSUM_PERIOD).add_(1)).sum()
        sums.add_(torch.stack([bits.sum(), weighted])).remainder_(CHECKSUM_MODULUS)
    return sums.double()


def _stats(params: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Per parameter its size and ``_checksum``s, float64 on ``device``, three numbers each."""
    stats = torch.zeros(len(params), 3, dtype=torch.float64, device=device)
    for i, p in enumerate(params):
        stats[i, 0] = p.numel()
        stats[i, 1:] = _checksum(p).to(device)
    return stats.reshape(-1)


def _same_everywhere(values: torch.Tensor, reduce_max: Callable[[torch.Tensor], Any]) -> torch.Tensor:
    """Per element of ``values`` (float64), whether every rank holds the same: one max-reduction (``reduce_max``, in
    place) of the values and their negations, whose largest equals minus the smallest only where all agree."""
    packed = torch.cat([values, -values])
    reduce_max(packed)
    return packed[: values.numel()] == -packed[values.numel() :]


# A model an optimizer with zero_quantized_weights trained keeps, once that optimizer is deleted, each rank's
# dequantized copy of the other ranks' parts: its values differ by rank, and nothing can make them exact any more.
# Named only once a quantized gather has left such values in this process (``note_dequantized_weights``).
_dequantized_weights = False
_QUANTIZED_LEFTOVER = (
    "; a model trained by an optimizer with zero_quantized_weights that was then deleted keeps the other ranks' "
    "parts dequantized on each rank: take its weights inside that optimizer's gathered_params() (a state_dict(), or "
    "zk.save_pretrained) before deleting it, and load them into the model"
)


def note_dequantized_weights() -> None:
    """A quantized gather (qwZ) wrote other ranks' dequantized values into parameters: from now on a refusal of
    values that differ by rank names that cause too."""
    global _dequantized_weights
    _dequantized_weights = True


def check_replicated(engine: Any, params: Sequence[torch.Tensor], indices: Sequence[int], name_of: Callable) -> None:
    """The values of ``params`` must be the same on every rank (sizes and float64 checksums, two small all-reduces).

    Args:
        engine: the communication engine.
        params: a param group's parameters.
        indices: each parameter's optimizer-wide index.
        name_of: optimizer-wide index -> how errors name the parameter.
    """
    if engine.world_size == 1:
        return
    device = params[0].device if params else torch.device("cpu")
    count = torch.tensor([len(params), -len(params)], dtype=torch.float64, device=device)
    engine.all_reduce(count, op="max", name="check.count").wait()
    if count[0] != -count[1]:
        raise ValueError(
            f"the ranks pass different numbers of parameters to the optimizer ({int(-count[1])} to {int(count[0])})"
        )
    stats = _stats(params, device)
    same = _same_everywhere(stats, lambda t: engine.all_reduce(t, op="max", name="check.params").wait())
    differ = (~same).nonzero().flatten().tolist()
    if differ:
        sized = differ[0] % 3 == 0
        raise ValueError(
            f"{name_of(indices[differ[0] // 3])} has {'a different size' if sized else 'different values'} on some "
            "rank: every rank must start from the same model (same seed, or broadcast rank 0's parameters first)"
            + (_QUANTIZED_LEFTOVER if _dequantized_weights and not sized else "")
        )


def broadcast_differing(params: Sequence[torch.Tensor], group: Any = None) -> list[int]:
    """Give every rank the group's first rank's values of the parameters whose values differ across ranks, as
    ``deepspeed.initialize`` broadcasts rank 0's parameters (a model built with another seed on each rank, or
    initialised on rank 0 only). Checksums first (one small all-reduce): parameters already replicated
    move nothing. Returns the indices (into ``params``) of those broadcast; ranks that disagree on the number or
    the sizes of the parameters are left to ``check_replicated``.
    """
    dist = torch.distributed
    if not params or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return []
    if any(p.is_meta for p in params):  # no values to compare: ``ShardedFusedAdam`` refuses them, naming the parameter
        return []
    count = torch.tensor([float(len(params))], dtype=torch.float64, device=params[0].device)
    stats = torch.cat([_stats(params, params[0].device), count])
    same = _same_everywhere(stats, lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group))
    per_param = same[:-1].reshape(-1, 3)
    if not bool(per_param[:, 0].all()) or not bool(same[-1]):  # not the same model
        return []
    differ = (~per_param[:, 1:].all(dim=1)).nonzero().flatten().tolist()
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for i in differ:
            dist.broadcast(params[i].data, src, group=group)
    return differ
