"""Checks of ``ShardedFusedAdam``'s arguments, with ``torch.optim.AdamW``'s wording where AdamW has the check.

Every check runs before the optimizer changes anything, and each error names the argument (or the
parameter, by its model name when the optimizer knows the model) and what is allowed.

AdamW's keyword arguments split in two kinds:

- ``amsgrad`` and ``maximize`` change the algorithm: implemented, per param group as in AdamW.
- ``foreach``, ``fused``, ``capturable``, ``differentiable`` choose among torch's implementations.
  The update here is always one fused kernel per flat shard, so ``foreach`` and ``fused`` are
  accepted with any of AdamW's values and have no effect. ``capturable=True`` (CUDA-graph capture)
  and ``differentiable=True`` (autograd through the step) cannot be honoured and are refused.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Collection, Mapping, Optional

import torch
import torch.distributed as dist

from ..config.schema import COMM_DTYPES
from ..env import IMPLS
from ..stages.aliases import check_no_aliases
from ..stages.ownership import refuse_held

ALGORITHM_FLAGS = {"amsgrad": False, "maximize": False}
IMPLEMENTATION_FLAGS = {"foreach": None, "fused": None, "capturable": False, "differentiable": False}
TRAINABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_TENSOR_WITH_FOREACH = "{} as a Tensor is not supported for capturable=False and foreach=True"  # AdamW's words
_REFUSED = {
    "capturable": "the step reads the ranks' gradient flags and norm on the host, so it cannot be captured in "
    "a CUDA graph",
    "differentiable": "the step updates the parameters in place outside autograd",
}


def _is_real(x: Any) -> bool:
    """A real number (Python's or numpy's), not a boolean."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_flag(x: Any) -> bool:
    """A boolean as ``torch.optim.AdamW`` takes one: ``True``/``False``, ``0``/``1`` or a numpy boolean."""
    if isinstance(x, numbers.Integral):
        return x in (0, 1)
    return type(x).__module__ == "numpy" and type(x).__name__ in ("bool", "bool_")


def _is_scalar(x: Any) -> bool:
    return _is_real(x) or (isinstance(x, torch.Tensor) and x.numel() == 1 and not x.dtype.is_complex)


def check_group_values(group: Mapping[str, Any], where: str) -> None:
    """At every step: a group's hyper-parameters are still numbers (or 1-element tensors) and its flags booleans,
    whoever set them since (a scheduler, the user, a loaded state dict): nothing is converted quietly.

    Args:
        group: the param group.
        where: how the error names it ("param group 1").
    """
    for key in ("lr", "eps", "weight_decay"):
        if not _is_scalar(group[key]):
            raise TypeError(f"{where}: {key} must be a number or a 1-element tensor, got {group[key]!r}")
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_is_scalar(b) for b in betas)):
        raise TypeError(f"{where}: betas must be a pair of numbers or 1-element tensors, got {betas!r}")
    check_flags(group, where)


def decay_mode(adam_w_mode: Any, decoupled_weight_decay: Any) -> bool:
    """The optimizer's weight-decay mode from ``adam_w_mode`` and torch's name for it, ``decoupled_weight_decay``
    (None: not given); ``ValueError`` when they disagree with ``adam_w_mode`` set off its default."""
    for name, value in (("adam_w_mode", adam_w_mode), ("decoupled_weight_decay", decoupled_weight_decay)):
        if value is not None and not _is_flag(value):
            raise ValueError(f"ShardedFusedAdam: {name} must be True or False, got {value!r}")
    if decoupled_weight_decay is None:
        return bool(adam_w_mode)
    if not adam_w_mode and decoupled_weight_decay:
        raise ValueError(
            "ShardedFusedAdam: adam_w_mode=False and decoupled_weight_decay=True contradict each other (both name "
            "the weight-decay mode): give one"
        )
    return bool(decoupled_weight_decay)


def check_decay_mode(group: Mapping[str, Any], where: str, mode: bool) -> None:
    """A group's ``decoupled_weight_decay`` (torch's key), when it has one, is the optimizer's one mode."""
    value = group.get("decoupled_weight_decay", mode)
    if not _is_flag(value) or bool(value) != mode:
        raise ValueError(
            f"{where}: decoupled_weight_decay={value!r}, but this ShardedFusedAdam decays "
            f"{'decoupled (AdamW)' if mode else 'as L2 added to the gradient (Adam)'} in every group (adam_w_mode="
            f"{mode}): build it with adam_w_mode={not mode} for the other mode; nothing was updated"
        )


def check_hyper(
    lr: Any, betas: Any, eps: float, weight_decay: float, *, same_kind_betas: bool = True, foreach: Any = None
) -> None:
    """``torch.optim.AdamW``'s checks of the hyper-parameters, with its wording (a tensor ``lr``
    or tensor ``betas`` must have one element; both betas are numbers or both tensors, which torch asks of the
    constructor's ``betas`` only: ``same_kind_betas=False`` for a param group's, where a scheduler cycling the
    momentum, ``OneCycleLR``, writes a float beta1 beside a tensor beta2). ``foreach``: the constructor's flag,
    which refuses a tensor ``lr`` or ``betas`` as AdamW does (no effect here, but the same input is refused)."""
    if isinstance(lr, torch.Tensor) and foreach:
        raise ValueError(_TENSOR_WITH_FOREACH.format("lr"))
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if isinstance(beta, torch.Tensor) and beta.numel() != 1:
            raise ValueError(f"Tensor betas[{i}] must be 1-element")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    tensors = [isinstance(b, torch.Tensor) for b in betas]
    if same_kind_betas and not (all(tensors) or all(_is_real(b) for b in betas)):
        raise ValueError("betas must be either both floats or both Tensors")
    if foreach and any(tensors):
        raise ValueError(_TENSOR_WITH_FOREACH.format(f"betas[{tensors.index(True)}]"))


def check_flags(values: Mapping[str, Any], where: str) -> None:
    """AdamW's flags: ``amsgrad``/``maximize`` booleans; ``foreach``/``fused`` None or booleans (no
    effect); ``capturable``/``differentiable`` must be False.

    Args:
        values: the flags given (others are ignored).
        where: how the error names their origin ("ShardedFusedAdam" or "param group 1").
    """
    for key in ALGORITHM_FLAGS:
        if key in values and not _is_flag(values[key]):
            raise ValueError(f"{where}: {key} must be True or False (or 0, 1), got {values[key]!r}")
    for key in ("foreach", "fused"):
        if key in values and values[key] is not None and not isinstance(values[key], bool):
            raise ValueError(f"{where}: {key} must be None, True or False (it has no effect here), got {values[key]!r}")
    for key, why in _REFUSED.items():
        if key in values and values[key] not in (False, None):
            raise ValueError(
                f"{where}: {key}={values[key]!r} is not supported: {why}; leave {key}=False "
                f"(torch.optim.AdamW offers it)"
            )


def check_impl(impl: Optional[str]) -> None:
    """``impl`` names a kernel backend (None: ``ZERO_KERNELS_IMPL``)."""
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not a kernel backend; allowed: {', '.join(IMPLS)} (or None)")


def data_type(
    value: Any, name: str = "communication_data_type", names: Mapping[str, torch.dtype] = COMM_DTYPES
) -> Optional[torch.dtype]:
    """A dtype option (``communication_data_type``, ``grad_accum_dtype``): ``"fp32"``, ``"fp16"``, ``"bf16"`` (any
    case, as DeepSpeed reads them; ``grad_accum_dtype`` also DeepSpeed's other spellings, ``"float32"`` and
    the like, as its config), one of those torch dtypes, or None (the gradients' own dtype).

    Args:
        value: what was given.
        name: the keyword, for the error.
        names: the spellings it takes (the config's table of that key, ``config.schema``).
    """
    if value is None or value in names.values():
        return value
    if isinstance(value, str) and value.lower() in names:
        return names[value.lower()]
    raise ValueError(
        f"{name}={value!r}; allowed: {', '.join(names)} (any case), the torch dtypes they name, "
        "or None (the gradients' dtype)"
    )


def check_process_group(process_group: Any) -> None:
    """``process_group`` is a ``torch.distributed`` process group of this rank, or None (the default group)."""
    if process_group is None:
        return
    if dist.is_available() and dist.is_initialized() and process_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"rank {dist.get_rank()} is not a member of process_group: build the optimizer only on its member ranks "
            "(dist.new_group() returns the group to its members only)"
        )
    if not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise TypeError(
            f"process_group must be a torch.distributed ProcessGroup (e.g. from dist.new_group()) or None for "
            f"the default group, got {type(process_group).__name__} {process_group!r}; the backend ('gloo', "
            "'nccl') is chosen by dist.init_process_group"
        )


def check_ordered(params: Any, world_size: int) -> None:
    """A top-level set of parameters is refused on more than one rank: ``torch.optim.AdamW`` takes it (in the
    set's order), but that order follows the tensors' ids, so it differs between processes, and the ranks would
    lay out, shard and reduce the parameters in different orders (same-shape parameters with the same values
    pass the construction's agreement check, and then get each other's gradients).

    Args:
        params: the optimizer's ``params`` argument.
        world_size: the ranks of the optimizer's process group.
    """
    if isinstance(params, (set, frozenset)) and world_size > 1:
        raise TypeError(
            f"params is a {type(params).__name__}: its order follows the tensors' ids, so it differs between the "
            f"{world_size} processes, which must list the parameters in the same order; pass a list, "
            "model.parameters() or the model itself, or param groups"
        )


def check_structure(
    params: Any, previous_named: list[bool], names_key: bool = False
) -> tuple[list[torch.Tensor], dict[int, str]]:
    """``torch.optim.Optimizer.add_param_group``'s checks of a group's ``params``, with its wording, run
    before anything is built; returns the tensors and their names (from ``(name, tensor)`` pairs).

    Args:
        params: the group's ``params`` (a tensor, or an iterable of tensors or pairs; not a set).
        previous_named: for each group before it, whether its parameters were given with names.
        names_key: the group carries torch's ``param_names`` key (a group taken from another optimizer's
            ``param_groups``): named, as torch counts it.
    """
    if isinstance(params, set):
        raise TypeError(
            "optimizer parameters need to be organized in ordered collections, but the ordering of tensors in sets "
            "will change between runs. Please use a list instead."
        )
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    pairs = [p for p in params if isinstance(p, tuple)]
    if pairs and len(pairs) != len(params):
        raise ValueError("all optimizer params should be with/without names. Some param names are missing")
    tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError("optimizer can only optimize Tensors, but one of the params is " + torch.typename(t))
        if not (t.is_leaf or t.retains_grad):
            raise ValueError("can't optimize a non-leaf Tensor")
    named = bool(pairs) or names_key
    if any(before != named for before in previous_named):
        raise ValueError(
            "all optimizer param groups should be with/without names. "
            f"cannot add param group {'with names' if named else 'without names'} to the optimizer"
        )
    return tensors, {id(t): name for name, t in pairs}


def check_params(
    params: list[torch.Tensor],
    group: int,
    previous: list[list[torch.Tensor]],
    describe: Callable[[torch.Tensor], str],
) -> None:
    """The parameters of a new param group, against themselves and the groups before it.

    Args:
        params: the new group's tensors.
        group: the index the new group will have.
        previous: the tensors of each group before it.
        describe: names a parameter in errors.
    """
    seen: dict[int, int] = {}
    for g, other in enumerate(previous):
        for p in other:
            seen.setdefault(id(p), g)
    mine: set[int] = set()
    for p in params:
        if id(p) in mine:
            raise ValueError(
                f"optimizer contains a parameter group with duplicate parameters: {describe(p)} appears twice in "
                f"param group {group}; list each parameter once"
            )
        if id(p) in seen:
            raise ValueError(
                f"some parameters appear in more than one parameter group: {describe(p)} is in param groups "
                f"{seen[id(p)]} and {group}"
            )
        mine.add(id(p))
        _check_tensor(p, describe)
    everything = [p for other in previous for p in other] + params
    check_no_aliases(everything, describe)
    devices = {}
    for p in everything:
        devices.setdefault(p.device, p)
    if len(devices) > 1:
        (da, a), (db, b) = list(devices.items())[:2]
        raise ValueError(
            f"parameters on two devices: {describe(a)} is on {da}, {describe(b)} on {db}; every parameter must be "
            "on this rank's one device (move the model with model.to(device) first)"
        )
    if devices and next(iter(devices)).type == "meta":
        raise ValueError(
            f"ShardedFusedAdam needs the parameters' values: {describe(next(iter(devices.values())))} is on the meta "
            "device (it has none). Materialize the model first (model.to_empty(device=...) then its initialisation, "
            "or load its weights), then build the optimizer"
        )


def _check_tensor(p: torch.Tensor, describe: Callable[[torch.Tensor], str]) -> None:
    if any(c.__name__ == "DTensor" for c in type(p).__mro__):
        raise ValueError(
            f"ShardedFusedAdam cannot train {describe(p)}: it is a DTensor (FSDP2's fully_shard or tensor "
            "parallelism shards it already). ShardedFusedAdam shards plain parameters itself: build it on the model "
            "without fully_shard (stage 3 is the ZeRO counterpart of FSDP), or train DTensor parameters with "
            "torch.optim.AdamW"
        )
    if getattr(p, "_fsdp_flattened", False):  # torch's mark on the parameters FullyShardedDataParallel flattened
        raise ValueError(
            f"ShardedFusedAdam cannot train {describe(p)}: FullyShardedDataParallel (FSDP1) flattened and shards it "
            "already, and reduces its gradients itself. Build ShardedFusedAdam on the model without "
            "FullyShardedDataParallel (stage 3 is the ZeRO counterpart of FSDP), or train FSDP's parameters with "
            "torch.optim.AdamW"
        )
    if p.layout != torch.strided:
        raise ValueError(f"ShardedFusedAdam does not support sparse parameters: {describe(p)} has layout {p.layout}")
    if not p.requires_grad:
        return
    if p.is_complex():
        raise ValueError(
            f"ShardedFusedAdam does not support complex parameters: {describe(p)} is {p.dtype}; store it as a real "
            "tensor with a last dimension of 2 (torch.view_as_real(...).clone()) and train that, read in the forward "
            "as torch.complex(w[..., 0], w[..., 1]) (the update is then AdamW's on the complex parameter; not "
            "torch.view_as_complex(w), which needs an even storage offset, and the optimizer packs parameters "
            "end to end in its buffers)"
        )
    if p.dtype not in TRAINABLE_DTYPES:
        allowed = ", ".join(str(d).replace("torch.", "") for d in TRAINABLE_DTYPES)
        raise ValueError(
            f"ShardedFusedAdam trains {allowed} parameters; {describe(p)} is {str(p.dtype).replace('torch.', '')}: "
            "cast it (e.g. model.float()) or freeze it (requires_grad=False)"
        )
    with torch._C.DisableTorchFunctionSubclass():  # past a freed stage-3 parameter's guard (it has no values)
        stride, shape = p.stride(), p.shape
    if any(step == 0 and size > 1 for step, size in zip(stride, shape)):
        raise ValueError(
            f"ShardedFusedAdam cannot train {describe(p)}: it is expanded (stride {tuple(stride)}), so several "
            "of its elements share one memory location, which torch.optim.AdamW's step refuses too; give it memory "
            "of its own (nn.Parameter(t.clone())) or freeze it (requires_grad=False)"
        )


Describe = Callable[[torch.Tensor, Mapping[int, str]], str]


def checked_groups(params: Any, defaults: dict[str, Any], describe: Describe) -> list[Any]:
    """The param groups of an optimizer's ``params`` argument, every one checked (``check_group``) before
    the first is built.

    Args:
        params: what the optimizer was given: tensors, or dicts of param groups.
        defaults: the optimizer's default hyper-parameters.
        describe: how errors name a parameter, given the group's names by ``id``.
    """
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
            + torch.typename(params)
        )
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    previous: list[tuple[list[torch.Tensor], bool]] = []
    for g, group in enumerate(groups):
        if not isinstance(group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(group)}")
        previous.append(check_group(group, g, previous, defaults, describe))
    return groups


def check_group(
    group: dict[str, Any],
    index: int,
    previous: list[tuple[list[torch.Tensor], bool]],
    defaults: dict[str, Any],
    describe: Describe,
    own: Collection[int] = (),
) -> tuple[list[torch.Tensor], bool]:
    """A new group's structure (as torch checks it), hyper-parameters, flags and parameters, against the
    groups before it, and no parameter held by a stage-3 optimizer but the one adding the group
    (``stages.ownership``); returns, as ``previous`` lists them, its tensors and whether they have names.

    ``group["params"]`` becomes a list, as ``torch.optim.Optimizer.add_param_group`` makes it.

    Args:
        group: the param group (a dict with ``params``).
        index: its index among the optimizer's groups.
        previous: (tensors, named) of each group before it.
        defaults: the optimizer's default hyper-parameters.
        describe: how errors name a parameter, given the group's names by ``id``.
        own: ``id`` of the parameters the optimizer adding the group holds already (its own checks name them).
    """
    if "params" not in group:
        raise ValueError(f"param group {index} has no 'params'")
    if not isinstance(group["params"], (torch.Tensor, set)):
        group["params"] = list(group["params"])
    tensors, names = check_structure(group["params"], [named for _, named in previous], "param_names" in group)
    merged = {**defaults, **group}
    check_hyper(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"], same_kind_betas=False)
    check_flags(group, f"param group {index}")
    if "decoupled_weight_decay" in defaults:
        check_decay_mode(group, f"param group {index}", defaults["decoupled_weight_decay"])
    check_params(tensors, index, [t for t, _ in previous], lambda p: describe(p, names))
    refuse_held([t for t in tensors if id(t) not in own], lambda p: describe(p, names))
    return tensors, bool(names) or "param_names" in group


def check_groups_unchanged(built: list[list[torch.Tensor]], groups: list[Mapping[str, Any]]) -> None:
    """``ValueError`` when ``groups`` (``opt.param_groups`` at a step) no longer hold the parameters the flat buffers
    were built for (``built``: each group's as the constructor or ``add_param_group`` took them): a group removed or
    appended, or parameters added to or removed from one, by editing ``param_groups`` directly. Raised before the
    step changes anything (``torch.optim.AdamW`` would follow the edit; the buffers cannot)."""
    if len(groups) < len(built):
        raise ValueError(
            f"opt.param_groups has {len(groups)} param groups where the optimizer was built with {len(built)}: a "
            "param group cannot be removed from a ShardedFusedAdam (its parameters live in flat buffers built for "
            "them); set its lr to 0 to stop training it, or build a new optimizer; nothing was updated"
        )
    if len(groups) > len(built):
        raise ValueError(
            f"opt.param_groups has {len(groups)} param groups where {len(built)} were added through the optimizer: "
            "add a param group with opt.add_param_group(group), which builds its flat buffers; nothing was updated"
        )
    for g, (params, group) in enumerate(zip(built, groups)):
        now = group["params"]
        if len(now) != len(params) or any(a is not b for a, b in zip(now, params)):
            raise ValueError(
                f"param group {g} holds {len(now)} parameters where it was given {len(params)}, or others: the "
                "parameters of a ShardedFusedAdam live in flat buffers built for the ones it was given; add new ones "
                "with opt.add_param_group({'params': [...]}), build a new optimizer to drop some; nothing was updated"
            )


def check_numbering_unchanged(built: list[list[torch.Tensor]], groups: list[Mapping[str, Any]]) -> None:
    """``check_groups_unchanged``'s error where the state dicts and checkpoints would number the parameters wrongly:
    they key the state by the index each parameter was built with, and the groups' ``params`` as torch numbers
    ``groups`` (a parameter listed again keeps its first index), so that numbering must give every parameter its
    built index and list no other. ``param_groups.extend(param_groups)`` passes; a parameter added, removed or moved
    does not."""
    flat = [p for params in built for p in params]
    index: dict[int, int] = {}
    start = 0
    for group in groups:
        for i, p in enumerate(group["params"], start):
            index.setdefault(id(p), i)
        start += len(group["params"])
    if len(index) != len(flat) or any(index.get(id(p)) != i for i, p in enumerate(flat)):
        check_groups_unchanged(built, groups)
