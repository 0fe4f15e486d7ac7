"""The control group: host data between the ranks of a process group, off the devices' queues.

Host data (which parameters got a gradient, the values ranks must agree on, stage 3's gather
checks) is exchanged by the host and read at once. On gloo the data engine carries it itself. On
any other backend (NCCL) waiting for it would wait for everything queued on the GPU before it, so
it goes over a gloo group of the same ranks, numbered alike, instead: the control group, a
``TorchCommEngine``.

That group is

- created once per process group (and process), lazily, at the first host exchange that needs
  it (``ControlLink.get``): building an optimizer, copying it (``copy.deepcopy``) or unpickling it
  never communicates, and every rank reaches its first host exchange at the same point;
- shared by every pipeline on that process group, copies included;
- destroyed with the last of its users that every rank drops at the same point: the process group
  itself (``dist.destroy_process_group``, of it or of the default group). Not when the last
  optimizer goes: Python collects an optimizer (a reference cycle) at a different moment on each
  rank, and torch names a group made with ``use_local_synchronization`` after the number of groups
  a rank holds, so a group destroyed on one rank and not yet on another would give the next group
  made on them (this module's, or the user's own) different names on different ranks: a hang.

The control group of a process group of every rank (the default group) is made by every rank as a group of the
world, named by torch's count of such groups, the same on every rank. A process group of some of the ranks needs
``use_local_synchronization`` (the others are not there): where its ranks hold different numbers of groups when it
is made (one of them is in a group made earlier that another is not in), they wait under different names.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from .engines import CommEngine, TorchCommEngine

log = logging.getLogger("zero_kernels")

HOST_BACKENDS = frozenset({"gloo"})  # backends whose own engine carries host data (no control group)


@dataclass(eq=False)
class _Control:
    data_group: weakref.ref  # the process group it serves; its collection destroys the control group
    group: dist.ProcessGroup  # the gloo group of the same ranks
    engine: TorchCommEngine


_controls: dict[int, _Control] = {}  # id(data process group) -> its control group


def needs_own_group(engine: CommEngine) -> bool:
    """Whether host data among ``engine``'s ranks goes over a control group (else over ``engine`` itself)."""
    return engine.world_size > 1 and engine.backend not in HOST_BACKENDS


class ControlLink:
    """A pipeline's access to the control engine of its data engine, looked up (or made) at first use.

    Args:
        engine: the data engine (``comm.make_engine``).
    """

    def __init__(self, engine: CommEngine):
        self._engine = engine
        self._control: Optional[_Control] = None

    def get(self) -> CommEngine:
        """The engine for host data: the data engine itself on a host backend or alone, else the process
        group's control engine, made now if it does not exist yet (a collective among the group's ranks:
        every rank must call this at the same point)."""
        if not needs_own_group(self._engine):
            return self._engine
        if self._control is None or self._control.data_group() is None:
            self._control = _control_of(self._engine.group)
        return self._control.engine


def _control_of(group: dist.ProcessGroup) -> _Control:
    found = _controls.get(id(group))
    if found is not None and found.data_group() is group:
        return found
    ranks = dist.get_process_group_ranks(group)
    # torch (2.13) names a group made with use_local_synchronization by how many groups this rank has registered,
    # which differs between ranks once some are members of a group the others are not: the ranks would wait for
    # each other under two names. A group of every rank is made by every rank here, so torch's own count names it.
    local = len(ranks) < dist.get_world_size()
    # in the data group's order (new_group([2, 0], sort_ranks=False)): sorted, the ranks' host data came back in
    # another order than their data ranks (a problem of rank 1 said to be rank 0's)
    order = {} if ranks == sorted(ranks) else {"sort_ranks": False}
    made = dist.new_group(ranks, backend="gloo", use_local_synchronization=local, **order)
    key = id(group)
    control = _Control(weakref.ref(group, lambda _: _destroy(key)), made, TorchCommEngine(made))
    _controls[key] = control
    log.info("zero_kernels: control group (gloo) made for the process group of ranks %s", ranks)
    return control


def _destroy(key: int) -> None:
    """The data process group is gone: destroy its control group, unless it went with the default group."""
    control = _controls.pop(key, None)
    if control is None or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group(control.group)
    except ValueError:  # already destroyed: destroy_process_group() of the default group takes every group
        pass
