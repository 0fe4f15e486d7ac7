"""Old import paths, kept for one release: each old dotted name is the new module object itself.

Modules moved into the sub-packages (``optim/``, ``comm/``, ``_build/``, ``stages/stage3/``). Each old
name below is registered in ``sys.modules`` and as an attribute of its parent package, so
``import zero_kernels.optim_state``, ``from zero_kernels import comm_objects`` and a monkeypatch of an
old module all reach the same module object as the new path. New code imports the new paths.
"""

from __future__ import annotations

import importlib
import sys

MOVED = {
    "zero_kernels.optim_args": "zero_kernels.optim.args",
    "zero_kernels.optim_state": "zero_kernels.optim.state_dicts",
    "zero_kernels.optim_copy": "zero_kernels.optim.copies",
    "zero_kernels.state_view": "zero_kernels.optim.state_view",
    "zero_kernels.precision": "zero_kernels.optim.precision",
    "zero_kernels.guards": "zero_kernels.optim.guards",
    "zero_kernels.amp": "zero_kernels.optim.amp",
    "zero_kernels.torch_clip": "zero_kernels.optim.torch_clip",
    "zero_kernels.comm_objects": "zero_kernels.comm.objects",
    "zero_kernels.agreement": "zero_kernels.comm.agreement",
    "zero_kernels.control": "zero_kernels.comm.control",
    "zero_kernels.comm_groups": "zero_kernels.comm.groups",
    "zero_kernels.devices": "zero_kernels.comm.devices",
    "zero_kernels._ext": "zero_kernels._build.ext",
    "zero_kernels._build_lock": "zero_kernels._build.lock",
    "zero_kernels._build_spec": "zero_kernels._build.spec",
    "zero_kernels.layout": "zero_kernels.stages.layout",
    "zero_kernels.model_hints": "zero_kernels.stages.stage3.model_hints",
    "zero_kernels.stages.stage3_check": "zero_kernels.stages.stage3.check",
    "zero_kernels.stages.stage3_guard": "zero_kernels.stages.stage3.guard",
    "zero_kernels.stages.stage3_hooks": "zero_kernels.stages.stage3.hooks",
    "zero_kernels.stages.stage3_plan": "zero_kernels.stages.stage3.plan",
    "zero_kernels.stages.stage3_save": "zero_kernels.stages.stage3.save",
    "zero_kernels.stages.stage3_uses": "zero_kernels.stages.stage3.uses",
    "zero_kernels.stages.state": "zero_kernels.stages.state_door",
}


def register() -> None:
    """Make every old name in ``MOVED`` an alias of its new module (imported now)."""
    for old, new in MOVED.items():
        module = importlib.import_module(new)
        sys.modules.setdefault(old, module)
        parent, leaf = old.rsplit(".", 1)
        setattr(sys.modules[parent], leaf, module)
