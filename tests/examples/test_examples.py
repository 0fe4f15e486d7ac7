"""Every example makes its rank's GPU current before anything touches CUDA.

Under ``torchrun`` every process starts with ``cuda:0`` current: an example that moves its model to
``cuda:LOCAL_RANK`` without ``torch.cuda.set_device`` has every rank's NCCL and kernels on GPU 0
(``ShardedFusedAdam`` refuses it). The examples that build their own process group do it through
``examples/train.py``'s ``init_distributed``, checked here with fakes of ``torch.cuda`` and
``init_process_group``; the Hugging Face example leaves the device and the group to the Trainer.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.paths import ROOT

EXAMPLES = ROOT / "examples"
SCRIPTS = sorted(EXAMPLES.glob("*.py"))


def _calls(tree: ast.AST) -> set[str]:
    """Names of the functions called anywhere in ``tree`` (``dist.init_process_group`` -> ``init_process_group``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
    return names


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_examples_exist() -> None:
    assert {p.name for p in SCRIPTS} >= {"train.py", "train_moe.py", "hf_trainer.py"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_example_sets_its_device(script: Path) -> None:
    """``init_distributed`` or the HF Trainer; nothing else makes a process group."""
    tree = ast.parse(script.read_text())
    calls = _calls(tree)
    if "TrainingArguments" in calls:  # the Trainer makes the group and the device current (accelerate)
        assert "init_process_group" not in calls and "set_device" not in calls
        return
    assert "init_distributed" in _calls(_function(tree, "main")), (
        f"{script.name}: main() does not call init_distributed"
    )
    outside = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == "init_distributed")]
    assert "init_process_group" not in _calls(ast.Module(body=outside, type_ignores=[])), (
        f"{script.name} makes a process group outside init_distributed"
    )


@pytest.mark.parametrize("local_rank", [1, 3])
def test_init_distributed_makes_the_ranks_gpu_current_first(monkeypatch: pytest.MonkeyPatch, local_rank: int) -> None:
    """On a GPU machine under torchrun: set_device(cuda:LOCAL_RANK), then NCCL bound to that device."""
    spec = importlib.util.spec_from_file_location("example_train", EXAMPLES / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    log = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: log.append(("set_device", torch.device(device))))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: log.append((backend, kw.get("device_id"))))
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    device = train.init_distributed()
    mine = torch.device("cuda", local_rank)
    assert device == mine
    assert log == [("set_device", mine), ("nccl", mine)], log
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    log.clear()
    assert train.init_distributed() == torch.device("cpu") and log == [("gloo", None)]
