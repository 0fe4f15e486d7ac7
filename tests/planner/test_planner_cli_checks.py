"""The ``plan`` command's config carries the batch keys DeepSpeed requires, and options that would be ignored or
misread are refused naming them.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import zero_kernels as zk
from zero_kernels.__main__ import main

PLAN = ["plan", "--params", "1e4", "--gpus", "2", "--gpu-memory", "1GB", "--link", "pcie4"]


@pytest.mark.parametrize("extra, micro, accum", [([], 1, 1), (["--micro-batch", "4", "--grad-accum", "2"], 4, 2)])
def test_the_json_has_deepspeeds_batch_keys_and_loads_in_initialize(tmp_path, capsys, extra, micro, accum) -> None:
    path = tmp_path / "ds.json"
    assert main(PLAN + extra + ["--json", str(path)]) == 0
    written = json.loads(path.read_text())
    assert (written["train_micro_batch_size_per_gpu"], written["gradient_accumulation_steps"]) == (micro, accum)
    model, optimizer = zk.initialize(nn.Linear(4, 2).to(torch.bfloat16), str(path))
    assert optimizer.gradient_accumulation_steps == accum
    assert zk.ZeroConfig.from_deepspeed(str(path), world_size=2).train_batch_size == micro * accum * 2


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--offload-ratio", "0.5"], "--offload-ratio=0.5 is offload_optimizer.ratio, which --offload none does not"),
        (["--gpu-memory", "80"], "--gpu-memory='80': 80 bytes; write the unit (e.g. 80GB or 80GiB)"),
        (["--gpus", "8", "--gpus-per-node", "3"], "--gpus=8 is not a multiple of --gpus-per-node=3"),
        (["--gpus", "12", "--offload", "cpu"], "--gpus=12 does not fill nodes of 8 devices"),
        (["--tokens-per-step", "1M", "--tflops", "0"], "--tflops='0': must be > 0"),
        (["--tflops", "100"], "--tflops without the other: give --tokens-per-step with --tflops, or --compute-s"),
        (["--micro-batch", "0"], "--train-micro-batch-size-per-gpu='0': must be > 0"),
        (
            ["--offload", "cpu", "--offload-ratio", "1.5"],
            "ratio=1.5: the offloaded share must be in (0, 1] (plan --offload-ratio)",
        ),
    ],
    ids=[
        "ratio-without-offload",
        "size-without-unit",
        "uneven-nodes",
        "uneven-default",
        "tflops-0",
        "tflops-alone",
        "mb0",
        "ratio-above-1",
    ],
)
def test_options_that_would_be_ignored_or_misread_are_refused(capsys, extra, message) -> None:
    try:
        status = main(PLAN + extra + ["--bus-gbps", "10", "--cpu-adam-gbps", "10", "--host-memory", "1TB"])
    except SystemExit as exc:  # argparse's refusal of a value
        status = exc.code
    assert status == 2
    assert message in capsys.readouterr().err
