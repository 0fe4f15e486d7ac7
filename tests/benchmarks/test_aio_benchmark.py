"""``python -m benchmarks aio``: sizes on the command line, every provider measured in every round on the
same file, the summary's ratio, and the file removed afterwards (a small file, the Python engine only)."""

from __future__ import annotations

import argparse
import io

import pytest

from benchmarks import aio as bench
from benchmarks import common
from zero_kernels._build import ext as _ext
from zero_kernels.offload import aio


def test_sizes_are_read_as_dd_writes_them():
    assert bench.parse_size("1G") == bench.parse_size("1GiB") == 1 << 30
    assert bench.parse_size("256M") == 256 << 20
    assert bench.parse_size("100M") == 112 << 20  # whole 16 MiB requests of the largest dd
    assert bench.parse_size("1") == 16 << 20
    with pytest.raises(ValueError, match="not a size"):
        bench.parse_size("lots")


def test_bad_options_name_the_option(tmp_path):
    with pytest.raises(SystemExit, match="--size"):
        bench.configure(argparse.Namespace(size="x", path=None))
    with pytest.raises(SystemExit, match="--path"):
        bench.configure(argparse.Namespace(size=None, path=str(tmp_path / "missing")))


@pytest.mark.slow
def test_every_provider_is_measured_on_the_same_file_then_removed(tmp_path, monkeypatch):
    def unavailable() -> None:
        raise _ext.ExtensionUnavailable("no compiler in this test")

    monkeypatch.setattr(aio, "_extension", unavailable)
    monkeypatch.setitem(bench._options, "size", 16 << 20)
    monkeypatch.setitem(bench._options, "path", str(tmp_path))
    buf = io.StringIO()
    with common.reporting("aio", (1, 1), stream=buf) as reporter:
        rows = bench.run(quick=True)
    assert reporter.total == reporter.index == 9
    assert {(r["case"], r["provider"]) for r in rows} == {
        (case, provider)
        for case in ("write new", "write", "read")
        for provider in ("dd bs=1M", "dd bs=16M", "ours python-odirect")
    }
    assert all(len(r["rounds_ms"]) == 3 and r["GB/s"] > 0 and r["MiB"] == 16 for r in rows)
    for r in rows:  # the engine against the better dd of each round
        if r["provider"].startswith("ours"):
            dds = [x["rounds_ms"] for x in rows if x["case"] == r["case"] and x["provider"].startswith("dd")]
            ratios = sorted(min(d) / o for *d, o in zip(*dds, r["rounds_ms"]))
            assert (r["vs_disk_low"], r["vs_disk"], r["vs_disk_high"]) == pytest.approx(tuple(ratios))
        else:
            assert "vs_disk" not in r
    summary = common.best_vs_peer(rows)
    assert {line["case"] for line in summary} == {"write new", "write", "read"}
    assert all(line["best_peer"].startswith("dd") and line["speedup"] > 0 for line in summary)
    assert list(tmp_path.iterdir()) == []
