"""``benchmarks/gpu_check.sh``, the one unattended GPU run: it cannot come back empty.

Without CUDA (this machine) it still runs end to end: the C++ extensions are built (here: loaded
from the cache the tests built), every GPU check is written as skipped in each script's JSON, and
the last line sums up. Its worst case is the sum of its step limits, under 5 minutes. Each script
writes its JSON after every check and guards every check (``benchmarks.gpu_report.Report``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_report import NO_CUDA, SCRIPTS, Report
from tests.helpers.paths import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _limits() -> tuple[dict[str, int], int, int]:
    """(step limits by variable name, GRACE_S, the number of steps) as the script sets them."""
    text = SCRIPT.read_text()
    line = next(row for row in text.splitlines() if row.startswith("BUILD_S="))
    values = {name: int(value) for name, value in re.findall(r"(\w+_S)=(\d+)", line)}
    steps = int(re.search(r"^STEPS=(\d+)$", text, re.M).group(1))
    return {k: v for k, v in values.items() if k != "GRACE_S"}, values["GRACE_S"], steps


def test_worst_case_is_under_five_minutes_by_construction() -> None:
    limits, grace, steps = _limits()
    text = SCRIPT.read_text()
    used = re.findall(r'(?:limit|step) "\$(\w+_S)"', text)
    assert sorted(set(used)) == sorted(limits), f"steps use {sorted(set(used))}, limits are {sorted(limits)}"
    assert steps == len(limits), "STEPS must count every limited step (each may run GRACE_S past its limit)"
    code = "\n".join(row for row in text.splitlines() if not row.lstrip().startswith("#"))
    assert code.count("timeout ") == 1, "every step must go through limit() (one timeout, with -k GRACE_S)"
    assert 'timeout -k "$GRACE_S"' in code
    worst = sum(limits.values()) + steps * grace
    assert worst < 300, f"worst case {worst} s"
    assert f"WORST_CASE_S below, {worst} s" in text, f"the header must state the worst case, {worst} s"
    assert "PYTHON=${PYTHON:-python3}" in text and " python " not in text


@pytest.mark.ext  # the script builds both C++ extensions
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs the GPU checks for real")
def test_runs_end_to_end_without_cuda(tmp_path: Path) -> None:
    from zero_kernels import _ext

    for name in ("ops", "comm"):  # the script's build step then loads them from the cache
        assert _ext.available(name)
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 2, f"exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    total = 0
    for script in SCRIPTS:
        found = json.loads((tmp_path / f"{script}.json").read_text())
        assert found["checks"], f"{script}.json lists no check"
        for check in found["checks"]:
            assert check["status"] == "SKIP" and check["problems"] == [NO_CUDA], f"{script}: {check}"
        total += len(found["checks"])
    for name in ("ops", "comm"):
        assert (tmp_path / f"{name}_build.status").read_text().strip() == "built"
    with tarfile.open(tmp_path / "gpu_check.tgz") as packed:  # one file holds them all
        names = {Path(m.name).name for m in packed.getmembers() if m.isfile()}
    assert names == {p.name for p in tmp_path.iterdir() if p.name != "gpu_check.tgz"}, names
    assert re.match(rf"gpu_check: 0 passed, 0 failed, {total} skipped in \d+ s \(worst case \d+ s\)", lines[-1]), lines[
        -1
    ]


def test_report_is_written_after_every_check_and_guards_each(tmp_path: Path) -> None:
    report = Report(str(tmp_path), "gpu_check")
    written = tmp_path / "gpu_check.json"
    assert json.loads(written.read_text())["checks"] == []

    def fine() -> list[str]:
        assert [c["check"] for c in json.loads(written.read_text())["checks"]] == [], "written before it ran"
        return []

    def broken() -> list[str]:
        assert [c["status"] for c in json.loads(written.read_text())["checks"]] == ["PASS"], "not written after"
        raise RuntimeError("an unattended run reports this and goes on")

    def wrong() -> list[str]:
        return ["a mismatch"]

    report.run_all({"fine": fine, "broken": broken, "wrong": wrong})
    checks = json.loads(written.read_text())["checks"]
    assert [c["status"] for c in checks] == ["PASS", "FAIL", "FAIL"]
    assert "an unattended run reports this" in checks[1]["problems"][0] and checks[2]["problems"] == ["a mismatch"]
    assert report.exit_status() == 1
    skipped = Report(str(tmp_path), "gpu_timing")
    skipped.skip_all(["a", "b"])
    assert skipped.exit_status() == 2


@pytest.mark.ext  # the host tier's C++ Adam
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs the GPU checks for real")
def test_offload_case_smoke_run_on_cpu(tmp_path: Path) -> None:
    from benchmarks import gpu_offload

    script = ROOT / "benchmarks" / "gpu_offload.py"
    done = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--json", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    found = json.loads((tmp_path / "gpu_offload.json").read_text())
    assert [c["check"] for c in found["checks"]] == gpu_offload.check_names()
    assert {c["status"] for c in found["checks"]} == {"PASS"}
    variants = [(r["stage"], r["offload_optimizer"], r["offload_param"]) for r in found["offload"]]
    assert variants == list(gpu_offload.VARIANTS)
    for row in found["offload"]:
        if not row["offload_optimizer"]:  # the sharded units' shards up and down around the device's update
            assert 1.9 < row["up_bytes_per_param"] == row["down_bytes_per_param"] < 2.0, row
            assert row["host_adam_ms"] == 0 and min(row[k] for k in ("plain_ms", "offload_ms", "bus_ms")) > 0
            continue
        assert 2.0 <= row["down_bytes_per_param"] <= 2.0 + gpu_offload.TRAFFIC_SLACK
        if row["offload_param"]:  # the shards are the host copies: only the persistent biases go up
            assert 0 < row["up_bytes_per_param"] < 0.1, row
        else:
            assert 2.0 <= row["up_bytes_per_param"] <= 2.0 + gpu_offload.TRAFFIC_SLACK
        assert min(row[k] for k in ("plain_ms", "offload_ms", "bus_ms", "host_adam_ms")) > 0
        assert row["hidden"] == pytest.approx(
            (row["plain_ms"] + row["bus_ms"] + row["host_adam_ms"] - row["offload_ms"])
            / (row["bus_ms"] + row["host_adam_ms"])
        )


def test_offload_checks_catch_extra_bytes_and_wrong_weights() -> None:
    from benchmarks import gpu_offload

    assert gpu_offload.check_bytes(1000, {"down": 2000.0, "up": 2004.0}) == []
    assert "down: 3.0000 bytes" in gpu_offload.check_bytes(1000, {"down": 3000.0, "up": 2000.0})[0]
    assert "up: 0.0000 bytes" in gpu_offload.check_bytes(1000, {"down": 2000.0})[0]
    assert gpu_offload.check_bytes(1000, {"down": 2000.0, "up": 100.0}, up_share=0.05) == []
    assert "up: 2.0000 bytes" in gpu_offload.check_bytes(1000, {"down": 2000.0, "up": 2000.0}, up_share=0.05)[0]
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    assert gpu_offload.check_weights(a, b) == []
    with torch.no_grad():
        a.weight[0, 0] += 0.1 * float(b.weight.abs().max())
        a.bias[0] = float("nan")
    assert [p.split(":")[0] for p in gpu_offload.check_weights(a, b)] == ["weight", "bias"]
