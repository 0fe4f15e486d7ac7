"""The benchmark runner's plumbing: compare, the summary, progress and ETA, the DeepSpeed peer's
wiring and config, plots and their absence. Nothing here spawns ranks or times anything real."""

from __future__ import annotations

import inspect
import io
import json
import sys

import pytest

from benchmarks import adam, comm, common, compare, e2e, e2e_deepspeed, flatten, plots
from benchmarks.__main__ import main

RUN_A = {
    "adam": [
        {"case": "flat", "n": 8, "provider": "ours:cpu", "median_ms": 10.0, "runs": 5, "GB/s": 2.0},
        {"case": "flat", "n": 8, "provider": "torch fused", "median_ms": 20.0, "runs": 5, "GB/s": 1.0},
        {"case": "list", "n": 8, "provider": "ours:cpu", "note": "unavailable: no compiler"},
        {"case": "gone", "n": 8, "provider": "ours:cpu", "median_ms": 1.0},
    ],
    "e2e": [{"case": "1M params", "provider": "zk-stage2", "rank": r, "step_ms": 100.0 + r} for r in (0, 1)],
}
RUN_B = {
    "adam": [
        {"case": "flat", "n": 8, "provider": "torch fused", "median_ms": 25.0, "runs": 3, "GB/s": 0.8},
        {"case": "flat", "n": 8, "provider": "ours:cpu", "median_ms": 8.0, "runs": 4, "GB/s": 2.5},
        {"case": "list", "n": 8, "provider": "ours:cpu", "median_ms": 2.0},
        {"case": "new", "n": 8, "provider": "ours:cpu", "median_ms": 1.0},
    ],
    "e2e": [{"case": "1M params", "provider": "zk-stage2", "rank": r, "step_ms": 50.0} for r in (0, 1)],
}


def _save(folder, run: dict) -> str:
    for subject, rows in run.items():
        common.write_json(str(folder / f"{subject}.json"), subject, rows)
    return str(folder)


def _find(lines: list[dict], **match) -> dict:
    found = [line for line in lines if all(line.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (match, lines)
    return found[0]


# compare


def test_compare_matches_rows_by_their_descriptive_columns():
    lines = compare.compare(RUN_A, RUN_B)
    ours = _find(lines, subject="adam", case="flat", provider="ours:cpu")
    assert (ours["A"], ours["B"], ours["speedup"]) == (10.0, 8.0, 1.25)  # runs differ: still the same row
    assert _find(lines, subject="adam", case="flat", provider="torch fused")["speedup"] == 0.8
    assert _find(lines, case="list")["note"] == "unavailable: no compiler"
    assert _find(lines, case="gone")["note"] == "only in A"
    assert _find(lines, case="new")["note"] == "only in B"
    assert [line["speedup"] for line in lines if line["subject"] == "e2e"] == [2.0, 101.0 / 50.0]
    assert _find(lines, case="flat", provider="ours:cpu", metric="median_ms")
    gbs = _find(compare.compare(RUN_A, RUN_B, metric="GB/s"), case="flat", provider="ours:cpu")
    assert (gbs["metric"], gbs["speedup"]) == ("GB/s", 0.8)


def test_compare_pairs_rows_that_share_every_descriptive_column_in_order():
    a = {
        "e2e": [
            {"case": "c", "provider": "p", "bucket_MB": 8.0, "step_ms": 10.0},
            {"case": "c", "provider": "p", "bucket_MB": 32.0, "step_ms": 20.0},
        ]
    }
    b = {
        "e2e": [
            {"case": "c", "provider": "p", "bucket_MB": 8.0, "step_ms": 5.0},
            {"case": "c", "provider": "p", "bucket_MB": 32.0, "step_ms": 40.0},
        ]
    }
    assert [line["speedup"] for line in compare.compare(a, b)] == [2.0, 0.5]


def test_compare_command_reads_files_and_folders(tmp_path, capsys):
    a, b = _save(tmp_path / "a", RUN_A), _save(tmp_path / "b", RUN_B)
    assert main(["compare", a, b]) == 0
    out = capsys.readouterr().out
    assert "speedup = A / B" in out and "1.25" in out and "only in B" in out
    assert "adam: geometric mean of A / B over 2 rows: 1.000" in out  # 1.25 and 0.8
    assert main(["compare", f"{a}/e2e.json", f"{b}/e2e.json"]) == 0
    assert "e2e: geometric mean" in capsys.readouterr().out


def test_compare_refuses_files_that_are_not_runs(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([1, 2]))
    with pytest.raises(SystemExit):
        main(["compare", str(bad), str(bad)])
    assert "bad.json: not a benchmark run" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        main(["compare", str(tmp_path / "empty"), str(bad)])
    assert "empty: no JSON files of a benchmark run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compare", str(tmp_path / "missing.json"), str(bad)])
    assert "No such file or directory" in capsys.readouterr().err


# summary


def test_best_vs_peer_compares_our_fastest_with_the_fastest_peer():
    rows = [
        {"case": "flat", "provider": "ours:cpu", "median_ms": 10.0},
        {"case": "flat", "provider": "ours:torch", "median_ms": 30.0},
        {"case": "flat", "provider": "torch fused", "median_ms": 12.0},
        {"case": "flat", "provider": "torch foreach", "median_ms": 20.0},
        {"case": "flat", "provider": "torch other", "note": "unavailable"},
        {"case": "alone", "provider": "ours:cpu", "median_ms": 1.0},
    ]
    flat, alone = common.best_vs_peer(rows)
    assert flat == {
        "case": "flat",
        "ours": "ours:cpu",
        "ours_ms": 10.0,
        "best_peer": "torch fused",
        "peer_ms": 12.0,
        "speedup": 1.2,
    }
    assert alone == {"case": "alone", "ours": "ours:cpu", "ours_ms": 1.0}
    assert common.summary_rows(adam, rows) == common.best_vs_peer(rows)  # adam has no summary of its own


def test_e2e_refuses_an_unknown_provider_naming_it() -> None:
    """Never run as another peer (it once ran as FSDP2)."""
    from torch import nn

    with pytest.raises(ValueError, match="unknown provider 'nope'"):
        e2e._build("nope", nn.Sequential(nn.Linear(2, 2)))


def test_e2e_summary_takes_the_faster_of_the_named_peer_and_deepspeed():
    def rows(provider, *per_rank_rounds):
        return [
            {"case": "1M params", "provider": provider, "rank": r, "step_ms": sorted(ts)[1], "rounds_ms": list(ts)}
            for r, ts in enumerate(per_rank_rounds)
        ]

    all_rows = [
        *rows("zk-stage2", (100.0, 100.0, 100.0), (110.0, 110.0, 110.0)),
        *rows("ddp+adamw-fused", (120.0, 120.0, 120.0), (120.0, 120.0, 120.0)),
        *rows("deepspeed-stage2", (90.0, 90.0, 90.0), (90.0, 90.0, 90.0)),
        *rows("zk-stage3", (200.0, 200.0, 200.0), (200.0, 200.0, 200.0)),
        *rows("fsdp2", (500.0, 400.0, 600.0), (500.0, 400.0, 600.0)),
        {"case": "1M params", "provider": "deepspeed-stage3", "error": "boom"},
    ]
    lines = common.summary_rows(e2e, all_rows)
    stage2 = _find(lines, ours="zk-stage2")
    assert (stage2["best_peer"], stage2["peer_ms"], stage2["speedup"]) == ("deepspeed-stage2", 90.0, 90.0 / 105.0)
    assert stage2["case"] == "stage 2, 1M params" and stage2["verdict"] == "ours slower"
    stage3 = _find(lines, ours="zk-stage3")
    assert (stage3["best_peer"], stage3["speedup"], stage3["low"], stage3["high"]) == ("fsdp2", 2.5, 2.0, 3.0)
    assert stage3["verdict"] == "ours faster"
    assert "speedup" not in _find(lines, ours="zk-stage0")
    with_ratios = e2e._deepspeed_ratios(e2e._with_peer_ratios(all_rows))
    assert [r["vs_deepspeed"] for r in with_ratios if r["provider"] == "zk-stage2"] == [90.0 / 105.0] * 2
    assert not any("vs_deepspeed" in r for r in with_ratios if r["provider"] == "zk-stage3")


def test_comm_summary_puts_the_chosen_primitive_against_gloos_own_collectives():
    def row(engine, primitive, ms, chosen=""):
        return {
            "case": "reduce_scatter 4 MB",
            "provider": engine,
            "primitive": primitive,
            "chosen": chosen,
            "median_ms": ms,
        }

    rows = [
        row("torch", "reduce_scatter_p2p", 3.0, "yes"),
        row("torch", "reduce_scatter_tensor", 4.0),
        row("torch", "all_reduce_slice", 5.0),
        row("cpp", "reduce_scatter_p2p", 2.0, "yes"),
        row("cpp", "reduce_scatter_tensor", 1.0),  # our engine's own path of gloo's collective: not a peer
        {"case": "all_reduce 4 MB", "provider": "cpp", "primitive": "all_reduce", "chosen": "yes", "median_ms": 1.0},
        {"case": "overlap 8 x 1 MB", "provider": "cpp", "mode": "overlapped", "hidden": 0.25, "median_ms": 9.0},
        {"case": "overlap 8 x 1 MB", "provider": "cpp", "mode": "synchronous", "hidden": 0.0, "median_ms": 9.0},
    ]
    rs, overlap = common.summary_rows(comm, rows)
    assert rs == {
        "case": "reduce_scatter 4 MB",
        "ours": "ours: cpp engine, reduce_scatter_p2p",
        "ours_ms": 2.0,
        "best_peer": "torch.distributed reduce_scatter_tensor",
        "peer_ms": 4.0,
        "speedup": 2.0,
    }
    assert overlap == {"case": "overlap 8 x 1 MB", "ours": "cpp engine", "note": "step 9.0 ms: hidden 25%"}


# progress


def test_durations_and_progress_lines():
    assert [common.format_duration(s) for s in (0, 59.6, 65, 3725)] == ["0:00", "1:00", "1:05", "1:02:05"]
    line = common.format_progress("adam", (1, 4), "flat n=8", "ours:cpu", 1, None, 3.2)
    assert line == "[1/4 adam]  flat n=8  ours:cpu  0:03 elapsed"
    assert "ETA" not in common.format_progress("adam", (1, 4), "flat", "ours:cpu", 1, 8, 3.0)  # nothing done yet
    line = common.format_progress("e2e", (4, 4), "21.0M params", "zk-stage2", 3, 11, 40.0)
    assert line == "[4/4 e2e]  21.0M params  zk-stage2  3/11  0:40 elapsed  ETA 3:00"  # 20 s each, 9 to go


def test_reporting_counts_measurements_and_hands_its_state_to_spawned_ranks(monkeypatch, capsys):
    buf = io.StringIO()
    common.progress("not", "reported")  # no runner: nothing happens
    with common.reporting("comm", (3, 4), stream=buf):
        common.expect(5)
        common.progress("reduce_scatter 4 MB", "cpp engine")
        parent = common._active
        monkeypatch.setattr(common, "_active", None)  # as in a rank spawned now: only the environment is left
        common.progress("all_gather 4 MB", "cpp engine")
        assert "[3/4 comm]  all_gather 4 MB  cpp engine  2/5" in capsys.readouterr().err
        monkeypatch.setattr(common, "_active", parent)
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("[3/4 comm]  reduce_scatter 4 MB  cpp engine  1/5  0:00 elapsed")
    assert lines[-1] == "[3/4 comm] done in 0:00"
    assert common._active is None and common._PROGRESS_ENV not in __import__("os").environ


def _fake_rounds(fns, rounds, *, budget_s, max_repeat=50, device=None, on_round=lambda r: None):
    """``interleaved_rounds`` without timing: ours 1 ms, the peers 2 ms, the roofs 1 ms, every round."""
    for r in range(rounds):
        on_round(r)
    times = {k: [(1e-3 if isinstance(k, tuple) or str(k).startswith("ours") else 2e-3)] * rounds for k in fns}
    return times, {k: 3 for k in fns}


@pytest.mark.slow
@pytest.mark.parametrize("module", [adam, flatten])
def test_subjects_expect_as_many_measurements_as_they_report(module, monkeypatch):
    monkeypatch.setattr(module, "our_backends", lambda device: {"cpu": "no compiler", "torch": None})
    monkeypatch.setattr(adam, "interleaved_rounds", _fake_rounds)
    monkeypatch.setattr(module, "_sizes", lambda quick, device: [1 << 15, 1 << 16])
    buf = io.StringIO()
    with common.reporting(module.__name__, (1, 1), stream=buf) as reporter:
        rows = module.run(quick=True)
    cases = len({(r["case"], r["n"]) for r in rows})
    assert reporter.total == reporter.index == cases * 5  # one progress line per round
    assert sum("median_ms" in r for r in rows) == len(rows) * 3 // 4  # every provider but the unavailable one ran
    assert f"{reporter.total}/{reporter.total}" in buf.getvalue().splitlines()[-2]


# item 6 of issue 26: load, spreads, verdicts, roofs, definitions


def test_ratios_come_with_their_spread_over_rounds_and_a_verdict_only_when_it_allows():
    assert common.ratio_stats([2.0, 2.2, 1.8], [1.0, 1.0, 1.0]) == {
        "speedup": 2.0, "low": 1.8, "high": 2.2, "verdict": "ours faster"}  # fmt: skip
    assert common.ratio_stats([0.8, 1.5, 1.1], [1.0, 1.0, 1.0])["verdict"] == "no verdict: the rounds disagree"
    assert common.ratio_stats([0.5, 0.9, 0.8], [1.0, 1.0, 1.0])["verdict"] == "ours slower"
    assert common.ratio_stats([2.0, 2.0], [1.0, 1.0])["verdict"] == "no verdict: 2 round(s)"
    rows = [
        {"case": "c", "provider": "ours:cpu", "median_ms": 1.0, "rounds_ms": [1.0, 1.0, 1.0]},
        {"case": "c", "provider": "torch", "median_ms": 1.1, "rounds_ms": [0.9, 1.1, 1.2]},
    ]
    (line,) = common.best_vs_peer(rows)
    assert (line["low"], line["high"], line["verdict"]) == (0.9, 1.2, "no verdict: the rounds disagree")


def test_rounds_are_interleaved_and_alternate_their_order(monkeypatch):
    calls = []
    fns = {k: (lambda k=k: calls.append(k)) for k in "abc"}
    monkeypatch.setattr(common, "timeit", lambda fn, warmup, repeat, device: (fn(), 1.0)[1])
    times, repeat = common.interleaved_rounds(fns, 3, budget_s=1.0)
    assert times == {k: [1.0, 1.0, 1.0] for k in "abc"}
    assert calls[6:] == list("abccbaabc")  # after two calls each to size the rounds


def test_roofs_are_timed_in_the_same_rounds_and_a_kernel_above_is_marked(monkeypatch):
    monkeypatch.setattr(adam, "our_backends", lambda device: {"cpu": None, "torch": "not timed here"})
    monkeypatch.setattr(adam, "_ours", lambda n, device, impl: lambda: None)
    monkeypatch.setattr(adam, "_torch", lambda shapes, device, **flags: lambda: None)
    seen = []

    def rounds(fns, count, **kwargs):
        seen.append(set(fns))
        times = {k: [1e-3] * count for k in fns}
        times[("roof", "inplace")] = [1e9, 2.0, 1e9][:count]  # its best round: 2 s, slower than ours
        return times, {k: 1 for k in fns}

    monkeypatch.setattr(adam, "interleaved_rounds", rounds)
    rows = adam._rows_for("flat", 1 << 10, adam.torch.device("cpu"), 3)
    assert {("roof", "inplace"), ("roof", "copy"), "ours:cpu", "torch.AdamW fused"} <= seen[0]
    mine = _find(rows, provider="ours:cpu")
    assert mine["inplace_GB/s"] == pytest.approx(2 * 4 * (1 << 12) / 2.0 / 1e9)  # the best round of add_
    assert mine["of_inplace_bw"] > 1 and "above the measured roof" in mine["note"]
    assert (mine["vs_best_peer"], mine["verdict"]) == (1.0, "no verdict: the rounds disagree")


def test_machine_line_shows_load_and_cores_and_warns_when_loaded(monkeypatch, capsys):
    monkeypatch.setattr(common, "load_average", lambda: (5.25, 4.0, 3.0))
    monkeypatch.setattr(common, "usable_cores", lambda: 2)
    import benchmarks.__main__ as runner

    monkeypatch.setattr(runner, "load_average", lambda: (5.25, 4.0, 3.0))
    monkeypatch.setattr(runner, "_prebuild", lambda: None)
    monkeypatch.setattr(adam, "run", lambda quick: [{"case": "flat", "provider": "ours:cpu", "median_ms": 1.0}])
    assert main(["adam"]) == 0
    out = capsys.readouterr().out
    machine = next(line for line in out.splitlines() if line.startswith("machine:"))
    assert "cores=2" in machine and "load_avg=5.25/4.00/3.00" in machine
    assert "WARNING: load average 5.25 at the start exceeds the 2 cores" in out
    assert "load average 5.25/4.00/3.00 at the end" in out and "at the end exceeds the 2 cores" in out
    monkeypatch.setattr(common, "load_average", lambda: (1.5, 1.0, 1.0))
    assert common.load_warning() is None


def test_hidden_is_defined_under_the_comm_table(monkeypatch, capsys):
    import benchmarks.__main__ as runner

    monkeypatch.setattr(runner, "_prebuild", lambda: None)
    row = {"case": "overlap 8 x 1 MB", "provider": "cpp", "mode": "overlapped", "hidden": 0.3, "median_ms": 9.0}
    monkeypatch.setattr(comm, "run", lambda quick: [row])
    assert main(["comm"]) == 0
    out = capsys.readouterr().out
    assert "hidden = (t_compute + t_comm - t) / t_comm" in out
    assert "median over the interleaved rounds" in out  # the summary says what its columns mean


# e2e: the DeepSpeed peer's wiring


def _fake_memory(provider, width, depth, out):
    return [{"peak_rss_mb": 1.0, "params_MiB": 1.0}] * 2


def _fake_timing(providers, rounds, width, depth, steps, out):
    return [{p: [10.0 if p.startswith("zk") else 20.0] * rounds for p in providers}] * 2


def _fake_runs(monkeypatch):
    monkeypatch.setattr(e2e, "_memory", _fake_memory)
    monkeypatch.setattr(e2e, "_timing", _fake_timing)
    monkeypatch.setattr(e2e, "_model", lambda width, depth: e2e.nn.Linear(2, 2))


def test_e2e_runs_deepspeed_at_every_stage_when_installed(monkeypatch):
    _fake_runs(monkeypatch)
    monkeypatch.setattr(e2e_deepspeed, "unavailable", lambda: None)
    rows = e2e.run(quick=True)
    ds = [r for r in rows if r["provider"].startswith("deepspeed-stage")]
    assert sorted({r["provider"] for r in ds}) == [f"deepspeed-stage{s}" for s in range(4)]
    assert all(r["note"] == e2e_deepspeed.NOTE and '"torch_adam": true' in r["note"] for r in ds)
    assert {r["vs_deepspeed"] for r in rows if r["provider"].startswith("zk-") and "@" not in r["provider"]} == {2.0}
    published = [r for r in rows if "@" in r["provider"]]  # DeepSpeed ran with another bucket size than these
    assert {r["bucket"] for r in published} == {"5e7", "5e8"} and not any("vs_deepspeed" in r for r in published)
    assert {r["bucket"] for r in rows if r["provider"] in ("zk-stage2", "deepspeed-stage2")} == {"2e6"}


def test_e2e_without_deepspeed_says_so_in_one_line(monkeypatch, capsys):
    _fake_runs(monkeypatch)
    monkeypatch.setattr(e2e_deepspeed.importlib.util, "find_spec", lambda name: None)
    rows = e2e.run(quick=True)
    assert not any(r["provider"].startswith("deepspeed") for r in rows)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["e2e: deepspeed is not installed: no DeepSpeed rows (pip install -e '.[bench]' adds them)"]


def test_e2e_reports_a_provider_whose_processes_die_in_its_rows(monkeypatch):
    def die(*args, **kwargs):
        raise RuntimeError("process 1 terminated with signal SIGKILL")

    monkeypatch.setattr(common.mp, "spawn", die)
    rows = e2e._memory("deepspeed-stage3", 8, 1, "/nonexistent/out")
    assert rows == [{"error": "RuntimeError: process 1 terminated with signal SIGKILL"}] * 2
    timing = e2e._timing(["zk-stage2", "fsdp2"], 3, 8, 1, 3, "/nonexistent/out")
    assert e2e._row({}, timing[0]["fsdp2"]) == {"error": "RuntimeError: process 1 terminated with signal SIGKILL"}


def test_deepspeed_gets_the_config_ours_runs_with():
    from zero_kernels import ShardedFusedAdam, ZeroConfig

    defaults = inspect.signature(ShardedFusedAdam).parameters
    for stage in range(4):
        cfg = e2e_deepspeed.config(stage, lr=e2e.LR, bucket_elements=e2e.BUCKET_ELEMENTS, micro_batch=8)
        parsed = ZeroConfig.from_deepspeed(cfg, world_size=2)
        assert (parsed.stage, parsed.zero.reduce_bucket_size) == (stage, e2e.BUCKET_ELEMENTS)
        assert parsed.optimizer.lr == e2e.LR and tuple(parsed.optimizer.betas) == defaults["betas"].default
        assert (parsed.optimizer.eps, parsed.optimizer.weight_decay) == (
            defaults["eps"].default,
            defaults["weight_decay"].default,
        )
        assert not parsed.gradient_clipping and cfg["optimizer"]["params"]["torch_adam"] is True


# plots


def test_plot_without_matplotlib_is_a_clear_error_before_anything_runs(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(plots.PlotUnavailable, match=r"--plot needs matplotlib.*pip install matplotlib"):
        plots.require_matplotlib()
    monkeypatch.setattr(adam, "run", lambda quick: pytest.fail("ran although --plot cannot draw"))
    with pytest.raises(SystemExit) as exit_info:
        main(["adam", "--plot", str(tmp_path / "plots")])
    assert exit_info.value.code == 2
    assert "--plot needs matplotlib, which is not installed here: pip install matplotlib" in capsys.readouterr().err
    assert main(["plot", _save(tmp_path / "run", RUN_A), str(tmp_path / "out")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "plots").exists() and not (tmp_path / "out").exists()


def test_figure_titles_name_the_device_measured():
    assert (
        plots.device_label({"cpu": "x86_64", "cores": 2, "torch": "2.13.0+cpu"})
        == "CPU x86_64, 2 cores, torch 2.13.0+cpu"
    )
    assert plots.device_label({"gpu": "NVIDIA H200", "torch": "2.14"}).startswith("GPU NVIDIA H200")


@pytest.mark.slow
def test_plots_of_every_subject(tmp_path):
    pytest.importorskip("matplotlib")
    bandwidth = {"inplace_GB/s": 30.0, "copy_GB/s": 15.0}
    results = {
        "adam": [
            {"case": c, "tensors": 1, "n": 1 << 20, "provider": p, "GB/s": g, **bandwidth}
            for c in ("flat", "list")
            for p, g in (("ours:cpu", 20.0), ("torch.AdamW fused", 18.0))
        ],
        "flatten": [
            {"case": c, "tensors": 200, "n": 1 << 20, "provider": p, "GB/s": 5.0, **bandwidth}
            for c in ("flatten fp32", "unflatten fp32")
            for p in ("ours:cpu", "torch.cat(out=)")
        ],
        "comm": [
            {
                "case": f"all_gather {mb} MB",
                "provider": "cpp",
                "primitive": "all_gather_p2p",
                "chosen": "yes",
                "median_ms": 1.0,
                "GB/s": mb,
            }
            for mb in (0.25, 4)
        ]
        + [{"case": "overlap 8 x 1 MB", "provider": "cpp", "mode": "overlapped", "hidden": 0.3, "median_ms": 9.0}],
        "e2e": [
            {
                "case": "1M params",
                "provider": p,
                "rank": 0,
                "step_ms": 10.0,
                "peak_rss_mb": 500.0,
                "params_MiB": 4.0,
                "grads_MiB": 4.0,
                "optimizer_MiB": 8.0,
            }
            for p in ("zk-stage2", "fsdp2")
        ]
        + [{"case": "1M params", "provider": "deepspeed-stage2", "rank": 0, "error": "boom", "peak_rss_mb": 400.0}],
    }
    paths = plots.write_plots(results, str(tmp_path), {"cpu": "x86_64", "cores": 2, "torch": "2.13.0"})
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["adam.png", "comm.png", "e2e.png", "flatten.png"]
    assert all((tmp_path / name).read_bytes()[:4] == b"\x89PNG" for name in ("adam.png", "e2e.png"))
    with pytest.raises(plots.PlotUnavailable, match="nothing to plot"):
        plots.write_plots(
            {"adam": [{"case": "flat", "provider": "ours:cpu", "note": "unavailable"}]}, str(tmp_path), {}
        )
