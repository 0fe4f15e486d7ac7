"""A checkpoint directory is untrusted input: every bad field is a ``CheckpointError`` before anything is read.

Each case damages the metadata (or ``extra.pt``) of a good one-process checkpoint and tries the
three readers, ``checkpoint.load``, ``inspect --verify`` and ``consolidate``: each must refuse it
with a ``CheckpointError`` (``inspect`` exits with status 2), read nothing outside the directory,
allocate nothing the files do not hold, and, for ``load``, change nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import zero_kernels.checkpoint as ck
import zero_kernels.optim as zo
from zero_kernels.__main__ import main
from zero_kernels.checkpoint.metadata import check_objects

Meta = dict[str, Any]


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))


def make_opt(model: nn.Module) -> zo.ShardedFusedAdam:
    return zo.ShardedFusedAdam(model, lr=1e-2, stage=1, reduce_bucket_size=5)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint root after one step, with an ``extra`` object."""
    root = tmp_path_factory.mktemp("good") / "ckpt"
    model = make_net()
    opt = make_opt(model)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    ck.save(root, model, opt, extra={"epoch": 1})
    return root


def _copy(good: Path, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "ckpt"
    shutil.copytree(good, root)
    return root, root / "v000001"


def _edit(version: Path, change: Callable[[Meta], None]) -> None:
    meta = json.loads((version / "metadata.json").read_text())
    change(meta)
    (version / "metadata.json").write_text(json.dumps(meta))


def _first_model_tensor(meta: Meta) -> dict[str, Any]:
    return meta["tensors"][next(iter(meta["model"].values()))]


def _refused_everywhere(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture, pattern: str) -> None:
    model = make_net()
    opt = make_opt(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ck.CheckpointError, match=pattern):
        ck.load(root, model, opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "a refused load changed the model"
    capsys.readouterr()
    assert main(["inspect", str(root), "--verify"]) == 2
    assert "checkpoint:" in capsys.readouterr().err
    with pytest.raises(ck.CheckpointError, match=pattern):
        ck.consolidate(root, tmp_path / "out.pt")


def _set(path: list, value: Any) -> Callable[[Meta], None]:
    """An edit that sets ``meta[path[0]][path[1]]... = value`` (a callable step picks a part of ``meta``)."""

    def change(meta: Meta) -> None:
        node: Any = meta
        for step in path[:-1]:
            node = step(node) if callable(step) else node[step]
        node[path[-1]] = value

    return change


def _last_piece_twice(meta: Meta) -> None:
    """The pieces cover the tensor in order, then its last piece again."""
    pieces = _first_model_tensor(meta)["pieces"]
    pieces.append(list(max(pieces, key=lambda piece: piece[1])))


def _piece_past_its_file_in_elements(meta: Meta) -> None:
    """A piece whose elements end past its file, though as many bytes as it has elements would not."""
    piece = _first_model_tensor(meta)["pieces"][0]
    piece[2] = meta["files"][piece[0]]["bytes"] - piece[3]


CASES = {
    "absolute file name": (_set(["files", 0, "name"], "/etc/hostname"), "not a plain file name"),
    "file name in a subdirectory": (_set(["files", 0, "name"], "sub/rank00000.bin"), "not a plain file name"),
    "file entry not an object": (_set(["files", 0], "rank00000.bin"), r"files\[0\] must be a JSON object"),
    "negative file size": (_set(["files", 0, "bytes"], -5), r"files\[0\].bytes must be >= 0"),
    "checksums not a list": (_set(["files", 0, "crc32"], "x"), r"files\[0\].crc32 must be a JSON list"),
    "block size 0": (_set(["block_bytes"], 0), "block_bytes must be >= 1"),
    "stage 7": (_set(["stage"], 7), r"stage must be in 0..3"),
    "tensors not an object": (_set(["tensors"], []), "tensors must be a JSON object"),
    "short piece": (_set([_first_model_tensor, "pieces", 0], [0, 0, 0]), r"must be \[file, first element"),
    "piece in no file": (_set([_first_model_tensor, "pieces", 0, 0], 7), r"\[0\] \(file\) must be in 0..0"),
    "piece past its file": (_set([_first_model_tensor, "pieces", 0, 2], 10**9), "reads bytes"),
    "piece past its file in elements": (_piece_past_its_file_in_elements, "reads bytes"),
    "last piece twice": (_last_piece_twice, "exactly once"),
    "unknown dtype": (_set([_first_model_tensor, "dtype"], "complex64"), "is not one of"),
    "negative dimension": (_set([_first_model_tensor, "shape", 0], -1), r"shape\[0\] must be >= 0"),
    "shape of 10**12": (_set([_first_model_tensor, "shape"], [10**12]), "do not cover the 1000000000000 elements"),
    "model not an object": (_set(["model"], []), "model must be a JSON object"),
    "model names a missing tensor": (_set(["model", "0.weight"], "model/nope"), "which the checkpoint does not hold"),
    "parameter entry empty": (_set(["params", 0], {}), r"params\[0\].name must be a string"),
    "param groups not a list": (_set(["param_groups"], "x"), "param_groups must be a JSON list"),
    "lr not a number": (_set(["param_groups", 0, "lr"], "fast"), r"param_groups\[0\].lr must be a finite number"),
    "loss scaler without scale": (_set(["loss_scaler"], {"good_steps": 1}), "loss_scaler.scale must be"),
    "negative skipped_steps": (_set(["skipped_steps"], -1), "skipped_steps must be >= 0, not -1"),
    "dequantized not a bool": (_set(["dequantized"], 1), "dequantized must be true, false or a list of param group"),
    "dequantized group out of range": (_set(["dequantized"], [7]), r"dequantized\[0\] must be in 0\.\.0, not 7"),
    "extra entry not an object": (_set(["extra"], [1]), "extra must be a JSON object"),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_bad_metadata_is_a_checkpoint_error(good: Path, tmp_path: Path, capsys, case: str) -> None:
    root, version = _copy(good, tmp_path)
    change, pattern = CASES[case]
    _edit(version, change)
    _refused_everywhere(root, tmp_path, capsys, pattern)


def test_deeply_nested_metadata_is_a_checkpoint_error(good: Path, tmp_path: Path, capsys) -> None:
    root, version = _copy(good, tmp_path)
    (version / "metadata.json").write_text("[" * 200_000)
    _refused_everywhere(root, tmp_path, capsys, "cannot be read")


def test_a_shard_file_outside_the_checkpoint_is_never_opened(good: Path, tmp_path: Path, capsys) -> None:
    """A valid rank file placed outside the version and named ``../outside.bin`` would load without the check."""
    root, version = _copy(good, tmp_path)
    shutil.copy(version / "rank00000.bin", root / "outside.bin")
    (version / "rank00000.bin").unlink()
    _edit(version, _set(["files", 0, "name"], "../outside.bin"))
    _refused_everywhere(root, tmp_path, capsys, r"'\.\./outside\.bin' is not a plain file name")


def test_a_file_smaller_than_its_metadata_is_refused_before_any_allocation(good: Path) -> None:
    """Metadata that claims a 4 TB rank file and a tensor of 10**12 elements in it: the reader opens the
    file, finds its real size and refuses, before it allocates the tensor."""
    version = good / "v000001"
    meta = json.loads((version / "metadata.json").read_text())
    meta["files"][0]["bytes"] = 4 * 10**12
    entry = _first_model_tensor(meta)
    entry["shape"], entry["pieces"] = [10**12], [[0, 0, 0, 10**12]]
    with ck.format.TensorSource(version, meta) as src, pytest.raises(ck.CheckpointError, match="the metadata says"):
        src.read(next(iter(meta["model"].values())))


class Sneaky:
    """Unpickling it creates a directory: what a malicious ``extra.pt`` could do instead."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.mkdir, (self.marker,))


def test_a_malicious_extra_is_refused_and_never_run(good: Path, tmp_path: Path) -> None:
    root, version = _copy(good, tmp_path)
    marker = tmp_path / "ran"
    torch.save({"epoch": Sneaky(str(marker))}, version / "extra.pt")
    data = (version / "extra.pt").read_bytes()
    _edit(version, _set(["extra"], {"bytes": len(data), "crc32": zlib.crc32(data)}))
    model = make_net()
    with pytest.raises(ck.CheckpointError, match="weights_only"):
        ck.load(root, model, make_opt(model))
    assert not marker.exists()
    with pytest.raises(ck.CheckpointError, match="weights_only"):
        ck.save(root, model, make_opt(model), extra=Sneaky(str(marker)))  # refused when saved, too
    assert not marker.exists() and (root / "latest").read_text() == "v000001"


def test_next_save_removes_what_killed_saves_left(good: Path, tmp_path: Path) -> None:
    root, _ = _copy(good, tmp_path)
    for name in (".tmp-v000002", ".tmp-v000003"):
        (root / name).mkdir()
        (root / name / "rank00000.bin.tmp").write_bytes(b"partial")
    model = make_net()
    opt = make_opt(model)
    assert ck.load(root, model, opt) == {"epoch": 1}
    assert ck.save(root, model, opt).name == "v000004"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "v000001", "v000004"]


def test_window_keys_of_earlier_versions_get_their_defaults() -> None:
    """A window saved before ``owed`` and ``sums`` existed reads as one without a debt or wider sums; present, they
    are checked."""
    flags = {"synced": False, "has_grad": [0], "stepped_with": [], "grads": [0], "shards": [], "written": [[]]}
    meta = {"world_size": 1, "param_groups": []}

    def book(ranks: dict) -> dict:
        window = {"micro_step": 1, "layout": [], "ranks": [ranks]}
        return {"param_groups": [], "lr_scheduler": None, "loss_scaler": None, "window": window}

    read = check_objects(book(dict(flags)), meta, Path("objects.pt"))["window"]["ranks"][0]
    assert read == {**flags, "owed": False, "sums": []}
    with pytest.raises(ck.CheckpointError, match=r"window.ranks\[0\].owed must be a boolean"):
        check_objects(book({**flags, "owed": 1}), meta, Path("objects.pt"))
    with pytest.raises(ck.CheckpointError, match=r"window.ranks\[0\].sums"):
        check_objects(book({**flags, "sums": [-1]}), meta, Path("objects.pt"))
