"""Stage 3: parameters assigned while freed, and copies of the model, on 1-2 gloo ranks, against ``torch.optim.AdamW``.

- ``p.data = new`` outside a forward, while ``p`` is freed, reaches this rank's shard (and the fp32
  master) before anything reads it: a checkpoint saved right after holds ``new``, and a step taken
  right after (its gradients from a backward before the assignment) updates ``new``, as AdamW does,
  instead of leaving the update to be overwritten by the next gather.
- ``copy.deepcopy(model)`` (what ``torch.optim.swa_utils.AveragedModel`` and EMA helpers do) while the
  parameters are freed raises on every rank, naming ``gathered_params()``; made inside
  ``gathered_params()`` it is a plain full copy: the optimizer's hooks in it are inert (its forward,
  run on one rank alone, gathers nothing), and the averaged weights match AveragedModel on AdamW's. Pickling
  the model (``torch.save(model)``, ``torch.save((opt, model))``) raises likewise, and is a full copy inside
  ``gathered_params()``.
- A forked DataLoader worker whose Dataset holds the model: its forward outside ``gathered_params()`` would all-gather
  in a process without the other ranks (it hung); it raises a ``CommError`` naming the fork, and training goes on.
  Workers started inside the block compute with the full weights. A child forked inside a forward, whose gathers were
  in flight, raises too when it waits for one.
"""

from __future__ import annotations

import copy
import io
import multiprocessing
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader, Dataset

import zero_kernels as zk
from tests.helpers.dist import run_ranks_checked
from zero_kernels.comm import CommError

ROWS, LR, BUCKET = 3, 1e-2, 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 7), nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _batch(step: int, world: int) -> torch.Tensor:
    return torch.randn(ROWS * world, 6, generator=torch.Generator().manual_seed(step))


def _backward(model: Net, ref: Net, rank: int, world: int, step: int) -> None:
    x = _batch(step, world)
    model(x[rank * ROWS : (rank + 1) * ROWS]).square().mean().backward()
    ref(x).square().mean().backward()


def _step(opt: torch.optim.Optimizer, ropt: torch.optim.Optimizer) -> None:
    for o in (opt, ropt):
        o.step()
        o.zero_grad()


def _make(world: int) -> tuple[Net, Net, zk.ShardedFusedAdam, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, reduce_bucket_size=BUCKET, stage3_param_persistence_threshold=0)
    return model, ref, opt, torch.optim.AdamW(ref.parameters(), lr=LR)


def _differences(model: nn.Module, ref: nn.Module, what: str) -> list[str]:
    found = []
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        if not torch.allclose(p, r, rtol=1e-5, atol=1e-6 * r.abs().max().item()):
            found.append(f"{what}: {name} differs from AdamW's by {(p - r).abs().max().item():.3g}")
    return found


def _assigned(seed: int) -> torch.Tensor:
    return torch.randn(7, 6, generator=torch.Generator().manual_seed(seed))


def _assign_case(rank: int, world: int, directory: str) -> list[str]:
    model, ref, opt, ropt = _make(world)
    _backward(model, ref, rank, world, 0)
    _step(opt, ropt)
    for m in (model, ref):  # freed in the model: outside any forward
        m.a.weight.data = _assigned(1)
    zk.checkpoint.save(directory, model, opt)
    loaded, _, opt2, _ = _make(world)
    zk.checkpoint.load(directory, loaded, opt2)
    with opt2.gathered_params():
        found = _differences(loaded, ref, f"world {world}: a checkpoint saved after p.data = ...")
    _backward(model, ref, rank, world, 1)
    _step(opt, ropt)
    _backward(model, ref, rank, world, 2)
    for m in (model, ref):  # between the backward and the step
        m.a.weight.data = _assigned(2)
    _step(opt, ropt)
    with opt.gathered_params():
        found += _differences(model, ref, f"world {world}: the step after p.data = ... (after backward)")
    _backward(model, ref, rank, world, 3)
    _step(opt, ropt)
    with opt.gathered_params():
        found += _differences(model, ref, f"world {world}: one step later")
    return found


@pytest.mark.distributed
@pytest.mark.parametrize("world", (1, 2), ids=lambda w: f"world{w}")
def test_data_assigned_while_freed_reaches_the_shard(world: int, tmp_path: Path) -> None:
    run_ranks_checked(_assign_case, world, str(tmp_path), timeout_s=60)


def _saved(obj: object) -> io.BytesIO:
    f = io.BytesIO()
    torch.save(obj, f)
    f.seek(0)
    return f


def _pickles_refused(model: Net, opt: zk.ShardedFusedAdam) -> list[str]:
    """``torch.save(model)`` and ``torch.save((opt, model))`` outside ``gathered_params()``: the first would hold
    empty tensors where parameters are freed, the second a model the loaded optimizer does not train (it trains a
    copy of its own), freed or not."""
    found = []
    for what, obj in {"torch.save(model)": model, "torch.save((opt, model))": (opt, model)}.items():
        try:
            _saved(obj)
            found.append(f"{what} of the freed model did not raise")
        except RuntimeError as exc:
            if "pickling the model" not in str(exc) or "gathered_params()" not in str(exc) or "empty" not in str(exc):
                found.append(f"{what}: {exc}")
    return found


def _copy_case(rank: int, world: int) -> list[str]:
    model, ref, opt, ropt = _make(world)
    _backward(model, ref, rank, world, 0)
    _step(opt, ropt)
    found = []
    for what, fn in {"deepcopy": lambda: copy.deepcopy(model), "AveragedModel": lambda: AveragedModel(model)}.items():
        try:
            fn()
            found.append(f"{what} of the freed model did not raise")
        except RuntimeError as exc:
            if "copy.deepcopy" not in str(exc) or "gathered_params()" not in str(exc):
                found.append(f"{what}: {exc}")
    found += _pickles_refused(model, opt)
    persistent = Net()  # every parameter under the persistence threshold: never freed, pickled whole
    found += _pickles_refused(persistent, zk.ShardedFusedAdam(persistent, lr=LR, stage=3))
    with opt.gathered_params():
        averaged = AveragedModel(model)
        pickled = torch.load(_saved(model), weights_only=False)  # a full copy
    found += _differences(pickled, ref, "the model pickled inside gathered_params()")
    ref_averaged = AveragedModel(ref)
    for step in (1, 2):
        _backward(model, ref, rank, world, step)
        _step(opt, ropt)
        with opt.gathered_params():
            averaged.update_parameters(model)
        ref_averaged.update_parameters(ref)
    found += _differences(averaged.module, ref_averaged.module, "AveragedModel")
    if rank == 0:  # evaluated on one rank alone: the copy gathers nothing
        x = _batch(9, 1)
        if not torch.allclose(averaged(x), ref_averaged(x), rtol=1e-5, atol=1e-6):
            found.append("the AveragedModel's output differs from AdamW's")
    _backward(model, ref, rank, world, 3)
    _step(opt, ropt)
    with opt.gathered_params():
        found += _differences(model, ref, "training after the copy")
    return found


@pytest.mark.distributed
def test_copies_of_the_model_are_full_or_refused() -> None:
    run_ranks_checked(_copy_case, 2, timeout_s=60)


def _shared_case(rank: int, world: int) -> list[str]:
    """The model pickled by ``torch.multiprocessing``'s pickler inside ``gathered_params()`` (what starting DataLoader
    workers or a ``Process`` with the model does under spawn or forkserver): the gathered storages move to shared
    memory; training on after the block must neither crash (torch cannot grow a shared storage resized to none) nor
    differ from AdamW's."""
    from multiprocessing.reduction import ForkingPickler

    model, ref, opt, ropt = _make(world)
    _backward(model, ref, rank, world, 0)
    _step(opt, ropt)
    with opt.gathered_params():
        pickled = bytes(ForkingPickler.dumps(model))
    for step in (1, 2):
        _backward(model, ref, rank, world, step)
        _step(opt, ropt)
    with opt.gathered_params():
        found = _differences(model, ref, f"world {world}: training after a pickle to another process")
    del pickled
    return found


@pytest.mark.distributed
@pytest.mark.parametrize("world", (1, 2), ids=lambda w: f"world{w}")
def test_model_pickled_for_another_process_inside_gathered_params_trains_on(world: int) -> None:
    run_ranks_checked(_shared_case, world, timeout_s=60)


class _Features(Dataset):
    """A Dataset that runs the model, as feature-extraction pipelines do."""

    def __init__(self, model: Net, world: int) -> None:
        self.model, self.world = model, world

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> torch.Tensor:
        with torch.no_grad():
            return self.model(_batch(100 + index, self.world))


def _worker_output(model: Net, world: int) -> torch.Tensor:
    loader = DataLoader(  # timeout: a worker that waits for ever fails the test instead of hanging it
        _Features(model, world), batch_size=None, num_workers=1, multiprocessing_context="fork", timeout=30
    )
    return next(iter(loader))


def _forked_case(rank: int, world: int) -> list[str]:
    """A forked worker's forward raises outside ``gathered_params()`` (it waited for ranks that are not in its
    process), computes with the full weights inside it, and the training process trains on as AdamW."""
    model, ref, opt, ropt = _make(world)
    _backward(model, ref, rank, world, 0)
    _step(opt, ropt)
    found = []
    with pytest.raises(CommError, match="forked from process") as raised:
        _worker_output(model, world)
    if "gathered_params()" not in str(raised.value):
        found.append(f"the error does not name gathered_params(): {raised.value}")
    with opt.gathered_params():
        got = _worker_output(model, world)
    want = ref(_batch(100, world))
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        found.append(f"a worker started inside gathered_params(): {(got - want).abs().max().item():.3g} off AdamW's")
    for step in (1, 2):
        _backward(model, ref, rank, world, step)
        _step(opt, ropt)
    with opt.gathered_params():
        return found + _differences(model, ref, "training after a forked worker's refused forward")


@pytest.mark.distributed
def test_forked_worker_running_the_model_raises_instead_of_waiting() -> None:
    run_ranks_checked(_forked_case, 2, timeout_s=90)


def _pickle_and_copy(model: Net, opt: zk.ShardedFusedAdam) -> None:
    """What a fork-based checkpoint writer does: pickle the model and the optimizer, and deep-copy them."""
    data = io.BytesIO()
    torch.save({"model": model, "opt": opt}, data)
    copied = copy.deepcopy((model, opt))[0]
    data.seek(0)
    loaded = torch.load(data, weights_only=False)["model"]
    if not all(torch.equal(a, b) for a, b in zip(loaded.parameters(), copied.parameters())):
        raise AssertionError("the pickled and the deep copy differ")


def _pickled_in_a_fork_case(rank: int, world: int) -> list[str]:
    """A child forked from the training process (a fork-based checkpoint writer) pickles and deep-copies the
    optimizer at stages 0-2 (no collective: it raised the fork's ``CommError``), and the copy's weights are the
    parent's."""
    found = []
    for stage in (0, 1, 2):
        torch.manual_seed(0)
        model = Net()
        opt = zk.ShardedFusedAdam(model, lr=LR, stage=stage, reduce_bucket_size=BUCKET)
        model(_batch(0, world)[rank * ROWS : (rank + 1) * ROWS]).square().mean().backward()
        opt.step()
        said = _run_in_fork(lambda: _pickle_and_copy(model, opt))
        if said != "returned":
            found.append(f"stage {stage}: pickling the optimizer in a forked child: {said}")
    return found


@pytest.mark.distributed
def test_optimizer_pickled_in_a_forked_child() -> None:
    run_ranks_checked(_pickled_in_a_fork_case, 2, timeout_s=60)


def _run_in_fork(fn) -> str:
    """``fn()`` in a forked child: what it raised, or "returned"; a child that waits for ever fails the test."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child() -> None:
        try:
            fn()
            send.send("returned")
        except Exception as exc:  # the child reports whatever it raised
            send.send(f"{type(exc).__name__}: {exc}")

    process = context.Process(target=child)
    process.start()
    got = receive.recv() if receive.poll(30) else "no answer in 30 s (waiting for ever)"
    process.kill()
    process.join()
    return got


def _fork_mid_forward_case(rank: int, world: int) -> list[str]:
    """A fork inside a forward (a forward hook of the first layer), whose child runs the last layer: its gather was
    issued by the parent's prefetch before the fork, and the child's wait for it raises instead of waiting for ever,
    or, where the gather had completed before the fork (the engine's thread can finish it first), the child reads
    what it received and returns."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    ref = copy.deepcopy(model)
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, reduce_bucket_size=BUCKET, stage3_param_persistence_threshold=0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    said: list[str] = []

    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if not said:
            said.append(_run_in_fork(lambda: model[4](torch.zeros(1, 6))))

    for step in range(3):
        handle = model[0].register_forward_hook(hook) if step == 1 else None
        x = _batch(step, world)
        model(x[rank * ROWS : (rank + 1) * ROWS]).square().mean().backward()
        ref(x).square().mean().backward()
        _step(opt, ropt)
        if handle is not None:
            handle.remove()
    found = [] if "forked from process" in said[0] or said[0] == "returned" else [f"the forked child: {said[0]}"]
    with opt.gathered_params():
        return found + _differences(model, ref, "training after a fork inside a forward")


@pytest.mark.distributed
def test_fork_inside_a_forward_raises_in_the_child_instead_of_waiting() -> None:
    run_ranks_checked(_fork_mid_forward_case, 2, timeout_s=90)
