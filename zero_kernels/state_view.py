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
other ranks in between). A parameter whose state lives only on other ranks, that is frozen, or
that has not stepped yet is absent, as in AdamW before its first step; reading it gives an empty
dict, and setting it raises. ``opt.full_state_dict()`` (a collective) gives whole tensors.

Keys that are not parameters may be stored, as torch allows; the state dicts carry them.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Callable, Iterator, Optional

import torch

from .stages import Pipeline

_KINDS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")


class ParamState(dict):
    """One parameter's state (a dict of views); assigning a key writes into the optimizer's shard."""

    def __init__(self, pipeline: Pipeline, index: int, values: dict[str, torch.Tensor]):
        super().__init__(values)
        self._pipeline = pipeline
        self._index = index

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "step":
            self._pipeline.steps[self._index] = int(float(value))
            super().__setitem__(key, torch.tensor(float(value)))
        elif key in self:
            view = dict.__getitem__(self, key)
            view.copy_(torch.as_tensor(value).reshape(view.shape))
        else:
            raise KeyError(
                f"opt.state[p] holds {', '.join(self)}: {key!r} cannot be added, the state lives in the shards"
            )

    def __delitem__(self, key: str) -> None:
        raise KeyError(f"opt.state[p][{key!r}] cannot be deleted: the state lives in the shards (see load_state_dict)")

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
        self._pieces: dict[int, tuple[int, int, int]] = {}  # id(param) -> (buffer, shard offset, numel)
        self._pieces_of = -1  # number of buffers the table was built for

    def _piece(self, p: torch.Tensor) -> Optional[tuple[int, int, int]]:
        pipeline = self._pipeline
        if self._pieces_of != len(pipeline.buffers):
            self._pieces = {}
            for b, buf in enumerate(pipeline.buffers):
                for seg in buf.layout.segments(pipeline.shard_rank):
                    key = id(buf.params[buf.layout.slots[seg.slot].param])
                    _, start, numel = self._pieces.get(key, (b, seg.shard_offset, 0))
                    self._pieces[key] = (b, start, numel + seg.numel)  # contiguous in the shard (see layout)
            self._pieces_of = len(pipeline.buffers)
        return self._pieces.get(id(p))

    def _index(self, p: torch.Tensor) -> Optional[int]:
        """``p``'s optimizer index when this rank holds state of it, else None."""
        if self._piece(p) is None:
            return None
        b, slot = self._pipeline.where[id(p)]
        buf = self._pipeline.buffers[b]
        index = buf.indices[buf.layout.slots[slot].param]
        return index if self._pipeline.steps[index] > 0 else None

    def entry(self, p: torch.Tensor) -> Optional[ParamState]:
        """``p``'s state on this rank, or None when this rank holds none of it (or it has not stepped)."""
        index = self._index(p)
        if index is None:
            return None
        b, start, numel = self._piece(p)
        buf = self._pipeline.buffers[b]
        slot = buf.layout.slots[self._pipeline.where[id(p)][1]]
        step = self._pipeline.steps[index]
        values = {"step": torch.tensor(float(step))}
        for kind in _KINDS:
            t = getattr(buf, kind)
            if t is not None:
                view = t.narrow(0, start, numel)
                values[kind] = view.view(slot.shape) if numel == slot.numel else view
        return ParamState(self._pipeline, index, values)

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, torch.Tensor):
            return self.extra.setdefault(key, {})  # torch's state is a defaultdict(dict)
        entry = self.entry(key)
        return {} if entry is None else entry

    def __setitem__(self, key: Any, value: Any) -> None:
        if not isinstance(key, torch.Tensor):
            self.extra[key] = value
            return
        entry = self.entry(key)
        if entry is None:
            raise KeyError(
                "opt.state[p] can be set only for a parameter whose state this rank holds (the state lives in the "
                "optimizer's shards; load_state_dict() replaces it)"
            )
        for name, v in dict(value).items():
            entry[name] = v

    def __delitem__(self, key: Any) -> None:
        if isinstance(key, torch.Tensor):
            raise KeyError("the state of a parameter lives in the optimizer's shards: load_state_dict() replaces it")
        del self.extra[key]

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

    def __repr__(self) -> str:
        return f"ShardedState({len(self)} entries on rank {self._pipeline.rank})"
