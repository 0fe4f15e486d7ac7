"""Config sources DeepSpeed accepts besides strict JSON files: a base64-encoded JSON string, and files with
``//`` comments or trailing commas (hjson, which DeepSpeed always reads with; read here when it is installed).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import pathlib
import re
import sys

import pytest
import torch

import zero_kernels as zk
from zero_kernels.config import ZeroConfig

CONFIG = {
    "train_batch_size": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2},
}
HJSON = """{
  // a comment, as hand-written configs have
  "train_batch_size": 8,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3,}},
  "zero_optimization": {"stage": 2,},
}
"""
HAS_HJSON = importlib.util.find_spec("hjson") is not None


def test_a_base64_encoded_config_is_read_as_deepspeed_reads_it() -> None:
    text = json.dumps(CONFIG)
    urlsafe = base64.urlsafe_b64encode(text.encode()).decode()
    assert ZeroConfig.from_deepspeed(urlsafe, world_size=1) == ZeroConfig.from_deepspeed(CONFIG, world_size=1)
    standard = base64.b64encode(text.encode()).decode()
    assert ZeroConfig.from_deepspeed(standard, world_size=1) == ZeroConfig.from_deepspeed(CONFIG, world_size=1)
    duplicated = base64.b64encode(b'{"train_batch_size": 8, "train_batch_size": 8}').decode()
    with pytest.raises(ValueError, match="base64-encoded DeepSpeed config: duplicate key 'train_batch_size'"):
        ZeroConfig.from_deepspeed(duplicated)
    with pytest.raises(ValueError, match=r"'ds\.json' does not exist or is not a file \(nor is it a base64"):
        ZeroConfig.from_deepspeed("ds.json")


def test_without_hjson_a_file_that_is_not_strict_json_says_how_to_read_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "hjson", None)  # import hjson raises ImportError
    path = tmp_path / "ds.json"
    path.write_text(HJSON)
    with pytest.raises(
        ValueError, match=r"is not valid JSON: .* line 2.*DeepSpeed reads configs with hjson.*pip install"
    ):
        ZeroConfig.from_deepspeed(path)


@pytest.mark.skipif(not HAS_HJSON, reason="hjson is not installed (not a requirement of zero_kernels)")
def test_with_hjson_a_file_with_comments_and_trailing_commas_is_read(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(HJSON)
    assert ZeroConfig.from_deepspeed(path, world_size=1) == ZeroConfig.from_deepspeed(CONFIG, world_size=1)
    path.write_text(HJSON.replace('"train_batch_size": 8,', '"train_batch_size": 8, "train_batch_size": 8,'))
    with pytest.raises(ValueError, match="duplicate key 'train_batch_size'"):
        ZeroConfig.from_deepspeed(path)


@pytest.mark.parametrize("config", ["", "  \n", pathlib.Path("  ")], ids=["empty", "whitespace", "whitespace path"])
def test_an_empty_config_is_named_empty_with_what_is_accepted(config) -> None:
    accepted = "pass a dict, the path of a JSON file, or a base64-encoded JSON string"
    with pytest.raises(ValueError, match=re.escape(f"the DeepSpeed config is empty ({str(config)!r}): {accepted}")):
        ZeroConfig.from_deepspeed(config)
    with pytest.raises(ValueError, match="the DeepSpeed config is empty"):
        zk.initialize(torch.nn.Linear(2, 2), config=config)


def test_a_directory_or_an_empty_file_is_named_as_such(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=re.escape(f"config path {str(tmp_path)!r} is a directory: pass")):
        ZeroConfig.from_deepspeed(tmp_path)
    with pytest.raises(ValueError, match=r"the DeepSpeed config path '\.' is a directory"):
        ZeroConfig.from_deepspeed(pathlib.Path(""))  # pathlib reads "" as "."
    path = tmp_path / "ds.json"
    for text in ("", " \n\t"):
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(f"DeepSpeed config file {str(path)!r} is empty: it must hold")):
            zk.initialize(torch.nn.Linear(2, 2), config=str(path))
