"""``opt.state``: ``torch.optim``'s per-parameter state, made of views of this rank's shards.

``opt.state[p]`` is, for a parameter whose state this rank holds (all of it or a piece) and that
has stepped at least once, a ``dict`` with AdamW's keys:

- ``"step"``: a 0-dim float tensor, the parameter's step count when read (a new tensor per read);
- ``"exp_avg"``, ``"exp_avg_sq"``, and ``"max_exp_avg_sq"`` once its group uses AMSGrad;
- ``"master"``: the fp32 master copy, only for bf16/fp16 parameters (fp32 ones are their own).

The tensors are views of the flat shards the kernel updates, so they stay current without copies
and writing into them (``.zero_()``, ``.copy_()``, or assigning a key, which copies into the shard)
changes the optimizer. Shapes: the parameter's shape when this rank holds every element of it
(always at stage 0 and on one rank); otherwise a 1-D view of this rank's piece, the elements it
holds of the flattened parameter in order (with several buckets a piece may skip the elements of
other ranks in between). A value assigned may have the view's shape or the whole parameter's (this
rank takes its elements). A parameter whose state lives only on other ranks, that is frozen, or
that has not stepped yet is absent, as in AdamW before its first step; reading it gives an empty
dict (asked by ``torch.distributed.checkpoint``'s loader, its keys with values None: ``dcp``).
``opt.full_state_dict()`` (a collective) gives whole tensors.

Resetting, as with AdamW (run the same statement on every rank, as any optimizer call):
``opt.state[p] = {}``, ``del opt.state[p]``, ``opt.state.clear()`` and ``opt.state = {}`` (or
``defaultdict(dict)``) reset what they name: the step count, on every rank, and the moments
(``exp_avg``, ``exp_avg_sq``, AMSGrad's maximum), zeroed where this rank holds them (a rank that
holds none of ``p`` has nothing to zero: no error). The next step is then ``p``'s step 1 from zero
moments, as AdamW's after the same reset. The fp32 master of a bf16/fp16 parameter is not Adam
state: it is the parameter's value, and a reset keeps it (the weights do not change).
``opt.state[p] = {"step": ..., "exp_avg": ..., "exp_avg_sq": ...}`` replaces ``p``'s state: its step
count on every rank, its moments where this rank holds them (a key left out starts at zero).
``del opt.state[p]`` of a parameter that has no state raises ``KeyError``, as a dict does. The step
counts must stay the same on the ranks that hold a parameter: each step checks it (``stages.stats``).

Keys that are not parameters may be stored, as torch allows; the state dicts carry them.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from ..stages import Pipeline
from ..stages import state_door as door
from ..stages.state_door import KINDS as _KINDS
from ..stages.state_door import MOMENTS as _MOMENTS
from ..stages.state_door import HeldPiece as _Piece
from . import dcp


def _take(piece: _Piece, value: torch.Tensor, shape: torch.Size, full: torch.Size) -> torch.Tensor:
    """``value`` shaped as ``piece``'s view (``shape``): given so, or as the whole parameter (``full``)."""
    value = torch.as_tensor(value)
    if tuple(value.shape) == tuple(shape) or value.numel() == piece.numel:
        return value.reshape(shape)
    if value.numel() == full.numel():
        flat = value.reshape(-1)
        return torch.cat([flat.narrow(0, lo, n) for lo, n in piece.ranges]).reshape(shape)
    raise ValueError(
        f"opt.state[p]: a value of shape {tuple(value.shape)} fits neither this rank's piece {tuple(shape)} "
        f"nor the parameter's shape {tuple(full)}"
    )


def _undeletable(key: str) -> KeyError:
    return KeyError(
        f"opt.state[p][{key!r}] cannot be deleted: the state lives in the shards (del opt.state[p] resets it)"
    )


class ParamState(dict):
    """One parameter's state (a dict of views); assigning a key writes into the optimizer's shard."""

    def __init__(
        self,
        pipeline: Pipeline,
        index: int,
        values: dict[str, torch.Tensor],
        piece: _Piece,
        full: torch.Size,
        on_write: Callable[[], None],
    ):
        super().__init__(values)
        self._on_write = on_write
        self._pipeline = pipeline
        self._index = index
        self._piece = piece
        self._full = full  # the parameter's shape

    def _check_key(self, key: str) -> None:
        if key not in self:
            raise KeyError(
                f"opt.state[p] holds {', '.join(self)}: {key!r} cannot be added, the state lives in the shards; keep "
                "values of your own per parameter (a Lookahead's slow weights, timm's 'lookahead_slow_buff') in a "
                "dict of your own keyed by the parameter, not in the optimizer's state"
            )

    def __setitem__(self, key: str, value: Any) -> None:
        self._check_key(key)
        self._on_write()
        if key == "step":
            self._pipeline.steps[self._index] = int(float(value))
            super().__setitem__(key, door.step_tensor(float(value)))
        else:
            view = dict.__getitem__(self, key)
            view.copy_(_take(self._piece, value, view.shape, self._full))

    def __delitem__(self, key: str) -> None:
        raise _undeletable(key)

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Assign each key as ``opt.state[p][key] = value`` does (into the shard); a key not held changes nothing."""
        values = dict(*args, **kwargs)
        for key in sorted(values):  # every key checked before anything is written
            self._check_key(key)
        for key, value in values.items():
            self[key] = value

    def __ior__(self, other: Any) -> "ParamState":
        self.update(other)
        return self

    def setdefault(self, key: str, default: Any = None) -> Any:
        self._check_key(key)  # a key held is never set: its value is returned
        return self[key]

    def pop(self, key: str, *default: Any) -> Any:
        raise _undeletable(key)

    def popitem(self) -> tuple[str, Any]:
        raise _undeletable("step")

    def clear(self) -> None:
        raise _undeletable("step")

    def __reduce__(self):  # a copy or a pickle is a plain dict of tensors, detached from the optimizer
        return (dict, (dict(self),))


class ShardedState(MutableMapping):
    """``opt.state`` of a ``ShardedFusedAdam`` (see the module docstring).

    Args:
        pipeline: the optimizer's pipeline (shards, layout, step counts).
        params: returns the optimizer's parameters in ``state_dict`` order (``param_groups`` order).
    """

    def __init__(self, pipeline: Pipeline, params: Callable[[], list[torch.Tensor]]):
        self._pipeline = pipeline
        self._params = params
        self.extra: dict[Any, Any] = {}  # the keys that are not parameters
        self._pieces: dict[int, _Piece] = {}  # id(param) -> this rank's piece of its state
        self._pieces_of = -1  # number of buffers the table was built for
        self.version = 0  # counts the writes and resets made through this mapping (not those into its views)

    def _written(self) -> None:
        self.version += 1

    def _piece(self, p: torch.Tensor) -> Optional[_Piece]:
        pipeline = self._pipeline
        if self._pieces_of != len(pipeline.buffers):
            self._pieces = door.held_pieces(pipeline)
            self._pieces_of = len(pipeline.buffers)
        return self._pieces.get(id(p))

    def _trained(self, p: torch.Tensor) -> Optional[int]:
        """``p``'s optimizer index when the optimizer trains it (on any rank), else None."""
        return door.trained_index(self._pipeline, p)

    def _index(self, p: torch.Tensor) -> Optional[int]:
        """``p``'s optimizer index when this rank holds state of it, else None."""
        if self._piece(p) is None:
            return None
        index = self._trained(p)
        return index if self._pipeline.steps[index] > 0 else None

    def _views(self, piece: _Piece) -> dict[str, torch.Tensor]:
        return door.piece_views(self._pipeline, piece)

    def entry(self, p: torch.Tensor) -> Optional[ParamState]:
        """``p``'s state on this rank, or None when this rank holds none of it (or it has not stepped)."""
        index = self._index(p)
        if index is None:
            return None
        piece = self._piece(p)
        values = {"step": door.step_tensor(self._pipeline.steps[index]), **self._views(piece)}
        return ParamState(self._pipeline, index, values, piece, self._pipeline.param_shape(p), self._written)

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, torch.Tensor):
            return self.extra.setdefault(key, {})  # torch's state is a defaultdict(dict)
        entry = self.entry(key)
        if entry is None and dcp.asked_by_dcp():
            return self._names_for_dcp(key)
        return {} if entry is None else entry

    def _names_for_dcp(self, p: torch.Tensor) -> dict[str, None]:
        """The state keys of ``p`` (values None) where another rank holds its state: DCP's loader of a flattened
        optimizer state dict (``flatten_optimizer_state_dict``) takes the keys of ``opt.state[p]`` for the entries
        it rebuilds, and this rank loads the whole state too."""
        index = self._trained(p)
        if index is None or self._pipeline.steps[index] == 0:
            return {}
        b, _ = self._pipeline.where[id(p)]
        return dict.fromkeys(("step", *door.state_tensors(self._pipeline.buffers[b])))

    # ---------------------------------------------------------------- resets and replacements
    def _reset(self, p: torch.Tensor, index: int) -> None:
        """Step count 0 (on every rank) and zero moments where this rank holds them; the master stays."""
        self._written()
        self._pipeline.steps[index] = 0
        piece = self._piece(p)
        if piece is not None:
            for kind, view in self._views(piece).items():
                if kind in _MOMENTS:
                    view.zero_()

    def __setitem__(self, key: Any, value: Any) -> None:
        if not isinstance(key, torch.Tensor):
            self.extra[key] = value
            return
        if not isinstance(value, Mapping):
            raise TypeError(f"opt.state[p] must be set to a dict (AdamW's keys), not a {type(value).__name__}")
        index = self._trained(key)
        if index is None:
            if value:
                raise KeyError(
                    f"opt.state[p]: a parameter of shape {tuple(key.shape)} that this optimizer does not train "
                    "(frozen, or not in its param groups) has no state to set"
                )
            return
        value = dict(value)
        unknown = sorted(set(value) - {"step", *_KINDS})
        if unknown:
            raise KeyError(f"opt.state[p] holds step, {', '.join(_KINDS)}: {unknown[0]!r} cannot be set")
        if value and "step" not in value:
            raise KeyError("opt.state[p] = {...} needs 'step' (AdamW reads state['step']), or {} to reset")
        piece = self._piece(key)
        views = self._views(piece) if piece is not None and value else {}
        full = self._pipeline.param_shape(key)
        taken = {k: _take(piece, v, views[k].shape, full).clone() for k, v in value.items() if k in views}
        step = int(float(value["step"])) if value else 0  # everything checked: now change
        self._reset(key, index)
        self._pipeline.steps[index] = step
        for k, v in taken.items():
            views[k].copy_(v)

    def __delitem__(self, key: Any) -> None:
        if not isinstance(key, torch.Tensor):
            del self.extra[key]
            return
        index = self._trained(key)
        if index is None or self._pipeline.steps[index] == 0:
            raise KeyError(key)
        self._reset(key, index)

    def clear(self) -> None:
        """Reset every parameter's state (on every rank, see the module docstring) and drop the other keys."""
        for p in self._params():
            index = self._trained(p)
            if index is not None:
                self._reset(p, index)
        self.extra.clear()

    def replace(self, state: Mapping[Any, Any]) -> None:
        """``opt.state = state``: everything reset, then each entry of ``state`` set (its tensors copied first:
        they may be views of the shards the reset zeroes, as ``opt.state = dict(opt.state)`` gives)."""
        entries = {
            key: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in value.items()}
            if isinstance(key, torch.Tensor) and isinstance(value, Mapping)
            else value
            for key, value in state.items()
        }
        self.clear()
        for key, value in entries.items():
            self[key] = value

    # ---------------------------------------------------------------- mapping
    def __contains__(self, key: object) -> bool:
        if isinstance(key, torch.Tensor):
            return self._index(key) is not None
        return key in self.extra

    def get(self, key: Any, default: Any = None) -> Any:
        if not isinstance(key, torch.Tensor):
            return self.extra.get(key, default)
        entry = self.entry(key)
        return default if entry is None else entry

    def _with_state(self) -> list[torch.Tensor]:
        seen, out = set(), []
        for p in self._params():
            if id(p) not in seen:
                seen.add(id(p))
                if self._index(p) is not None:
                    out.append(p)
        return out

    def __iter__(self) -> Iterator[Any]:
        yield from self._with_state()
        yield from list(self.extra)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __bool__(self) -> bool:
        """Asked by ``torch.distributed.checkpoint`` (``_init_optim_state`` steps an optimizer whose ``state`` is
        empty, to make one): whether any rank holds state, the same answer on every rank; a rank holding no
        parameter's state (a model smaller than the ranks' shards) stepped alone and the ranks hung. Else, as a
        dict: whether this rank holds any."""
        if dcp.asked_by_dcp():
            return any(n > 0 for n in self._pipeline.steps.values()) or bool(self.extra)
        return len(self) > 0

    def __repr__(self) -> str:
        return f"ShardedState({len(self)} entries on rank {self._pipeline.rank})"
