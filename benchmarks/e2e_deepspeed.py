"""DeepSpeed as a peer in the e2e benchmark: the same model and config through ``deepspeed.initialize``.

DeepSpeed is optional (the ``bench`` extra); nothing here imports it until a rank builds its
provider. The config is the one our ``zero_optimization`` keyword arguments spell (stage,
``reduce_bucket_size``; every other key at its DeepSpeed default, which ours shares), AdamW with
the e2e benchmark's learning rate, and no gradient clipping, as ours runs. ``"torch_adam": true``
makes DeepSpeed step with ``torch.optim.AdamW`` instead of building its CPU FusedAdam with ninja on
first use (minutes); the rows say so in their ``note``. DeepSpeed's CPU shared-memory op, which only
its inference all-reduce uses, is not built either (minutes too): its collectives run on gloo.

Memory per rank, measured after the last step: ``params`` (the module's parameters; at stage 3
their partitions), ``optimizer`` (the torch optimizer's state and the fp32 partitions it steps,
when they are copies of the parameters), ``grads`` (gradients still held by the parameters or the
partitions), ``buffers`` (every other live tensor: DeepSpeed's gradient and communication buffers).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

PREFIX = "deepspeed-stage"
NOTE = '"torch_adam": true (torch.optim.AdamW)'
INSTALL_HINT = "pip install -e '.[bench]'"


def unavailable() -> Optional[str]:
    """None when ``deepspeed`` can be imported here, else why not (one line, with the fix)."""
    if importlib.util.find_spec("deepspeed") is None:
        return f"deepspeed is not installed: no DeepSpeed rows ({INSTALL_HINT} adds them)"
    return None


def config(stage: int, *, lr: float, bucket_elements: int, micro_batch: int) -> dict:
    """The DeepSpeed config of the e2e runs at ``stage`` (ours takes the same ``zero_optimization`` keys)."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "torch_adam": True},
        },
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket_elements},
        "steps_per_print": 1 << 30,
    }


def _storages(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
            out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return out


def _memory(engine, inputs: torch.Tensor) -> dict:
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)  # the ZeRO optimizers step a torch optimizer inside
    params = _storages(getattr(p, "ds_tensor", p) for p in engine.module.parameters())
    partitions = [p for group in inner.param_groups for p in group["params"]]
    state = [t for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    optimizer = {k: v for k, v in _storages([*state, *partitions]).items() if k not in params}
    grads = _storages(p.grad for p in [*engine.module.parameters(), *partitions])
    counted = {**params, **optimizer, **grads, **_storages([inputs])}
    with warnings.catch_warnings():  # some objects warn when asked for their class
        warnings.simplefilter("ignore")
        live = _storages(o for o in gc.get_objects() if isinstance(o, torch.Tensor))
    buffers = {k: v for k, v in live.items() if k not in counted}
    kinds = {"params": params, "grads": grads, "optimizer": optimizer, "buffers": buffers}
    return {k: sum(v.values()) for k, v in kinds.items()}


def engine(model: nn.Module, cfg: dict) -> Any:
    """A DeepSpeed engine of ``model`` under ``cfg`` on the gloo group this rank already joined."""
    import deepspeed
    import deepspeed.comm.torch as ds_torch_comm

    # On CPUs DeepSpeed builds a shared-memory op with ninja on first use (minutes) that serves only its
    # inference all-reduce; training collectives go through torch.distributed (gloo) either way.
    if hasattr(ds_torch_comm, "build_shm_op"):
        ds_torch_comm.build_shm_op = lambda: None
    # DeepSpeed 0.19 calls torch.distributed names that torch 2.13 deprecates, with a warning per call.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    rank = str(dist.get_rank())
    os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=str(dist.get_world_size()))  # DeepSpeed reads them
    deepspeed.init_distributed(dist_backend="gloo")  # takes over the process group this rank already joined
    built, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return built


def build(
    provider: str, model: nn.Module, inputs: torch.Tensor, *, lr: float, bucket_elements: int
) -> tuple[Callable[[], None], Callable[[], dict]]:
    """(one training step, memory report) of ``model`` under DeepSpeed on the gloo group already joined.

    Args:
        provider: ``deepspeed-stageN``.
        model: the e2e model, the same on every rank.
        inputs: this rank's batch.
        lr: the learning rate ours runs with.
        bucket_elements: ours' ``reduce_bucket_size``.
    """
    cfg = config(int(provider[len(PREFIX) :]), lr=lr, bucket_elements=bucket_elements, micro_batch=inputs.shape[0])
    ds = engine(model, cfg)

    def step() -> None:
        ds.backward(ds(inputs).square().mean())
        ds.step()  # steps and clears the gradients

    return step, lambda: _memory(ds, inputs)
