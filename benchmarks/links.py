"""Two emulated nodes joined by a rate-limited link: every ZeRO stage's step against the link's rate,
the peers beside it, and the planner's prediction beside each measurement.

Two network namespaces joined by a veth pair (``benchmarks.netns``), ``torchrun --nnodes 2
--nproc_per_node 2`` in each with ``GLOO_SOCKET_IFNAME`` on its end of the link: 4 gloo ranks, the two
of a node talking over its loopback, the nodes over the link, limited with ``tc ... tbf`` on both
ends to each rate in turn (``none``: no limit). At each rate: our stages 0-3, stage 3 with ZeRO++
(``ZEROPP``: its ``note`` gives its link bytes and step against plain stage 3's and stage 2's), DDP and FSDP2 (and
DeepSpeed at each stage when it is installed, in a second pass over the rates, so that what it
patches cannot touch the others) train the e2e model (``benchmarks.e2e``: an MLP of Linear-GELU-Linear
blocks, here width 256 and depth 4, 2.1M parameters, 8 rows a step, one thread per rank).

Columns: ``step_ms`` the median step (forward, backward, optimizer step and a barrier), the mean over
ranks; ``link_MB`` the bytes this rank's node sent over the link per step, per rank (from
``/sys/class/net/<end>/statistics``, so headers and retransmissions included); ``link_MB/s`` the
payload rate a probe reached across the link at that rate (every rank exchanging with its partner
on the other node at once); ``fwd_ms``, ``bwd_ms``, ``opt_ms`` the step's parts (waits included).
``planned_ms`` and ``planned_MB`` are the planner's (``zero_kernels.planner.links``): its compute is
fitted to the step measured without a limit (the ``calibration`` row: the mean of a run before the
limited rates and one after), the host's rate (every byte a node sends goes through its CPUs) and
the latency come from that run's probe, and a limited link carries ``rate x tcp_payload_share()``
of payload.
``error_pct`` is the prediction's error against the measurement; the ``check`` row, the table's last,
is the worst where the link limits the step: at the rates whose payload is below what the host moved
without a limit (the planner is held to 25 % there; faster limits leave the step to the host's CPUs,
as without a limit, and their error, the run-to-run noise of this machine, is given in the note).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from zero_kernels.planner.links import (
    Cluster,
    Compute,
    LinkStep,
    calibrate,
    crossover_Bps,
    stage_step,
    tcp_payload_share,
)

from . import e2e, e2e_deepspeed, netns
from .common import best_vs_peer, expect

DESCRIPTION = "2 emulated nodes x 2 gloo ranks over a slowed link: stages 0-3, DDP, FSDP2, DeepSpeed; the planner"
RATES = ("none", "10gbit", "1gbit", "200mbit")
OURS = ("zk-stage0", "zk-stage1", "zk-stage2", "zk-stage3")
# Stage 3 with ZeRO++ (``e2e.ZEROPP``): +qwz quantized weights, +hpz the secondary partition per node, +qwz+hpz
# both, +zpp both and quantized gradients. The default runs +zpp; the others when named.
ZEROPP = e2e.ZEROPP_PROVIDERS
ZEROPP_DEFAULT = ("zk-stage3+zpp",)
PEERS = ("ddp+adamw-fused", "fsdp2")
WIDTH, DEPTH, ROWS = 256, 4, 8
NODES, RANKS_PER_NODE = 2, 2
TOLERANCE = 0.25  # the planner's predictions are held to this relative error at the limited rates
_options: dict[str, Any] = {}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subject's own options on the runner's parser."""
    parser.add_argument(
        "--link-rates",
        metavar="RATES",
        help=f"links: comma-separated link rates in tc syntax, 'none' for no limit (default: {','.join(RATES)})",
    )
    parser.add_argument(
        "--link-providers",
        metavar="NAMES",
        help=f"links: comma-separated providers among {','.join(_all_providers())} "
        "(default: all available but the +overlap ones and of ZeRO++ only zk-stage3+zpp)",
    )


def configure(args: argparse.Namespace) -> None:
    """Take the options ``add_arguments`` registered; a bad value is a ``SystemExit`` naming it."""
    _options.clear()
    if args.link_rates:
        rates = [r.strip() for r in args.link_rates.split(",") if r.strip()]
        for rate in rates:
            if rate != "none":
                try:
                    netns.parse_rate(rate)
                except ValueError as exc:
                    raise SystemExit(f"--link-rates: {exc}") from None
        _options["rates"] = rates
    if args.link_providers:
        providers = [p.strip() for p in args.link_providers.split(",") if p.strip()]
        unknown = [p for p in providers if p not in _all_providers()]
        if unknown:
            raise SystemExit(f"--link-providers: unknown {', '.join(unknown)}; known: {', '.join(_all_providers())}")
        _options["providers"] = providers


def _all_providers() -> list[str]:
    return [*OURS, *ZEROPP, *PEERS, *(f"{e2e_deepspeed.PREFIX}{s}" for s in range(4)), *e2e.OVERLAPPED]


def _plan(rates: list[str], providers: list[str]) -> list[tuple[str, list[str]]]:
    """(rate, providers) phases: everything but DeepSpeed at each rate, then DeepSpeed at each rate. A
    pass that starts without a limit ends without one too: the planner's calibration is the mean of
    the two, one before and one after the limited rates (this machine's load drifts in between)."""
    deepspeed = [p for p in providers if p.startswith(e2e_deepspeed.PREFIX)]
    others = [p for p in providers if p not in deepspeed]
    order = [*rates, "none"] if rates[0] == "none" and len(rates) > 1 else list(rates)
    return [(r, group) for group in (others, deepspeed) if group for r in order]


def _providers() -> list[str]:
    optional = [*e2e.OVERLAPPED, *(p for p in ZEROPP if p not in ZEROPP_DEFAULT)]
    chosen = _options.get("providers") or [p for p in _all_providers() if p not in optional]
    missing = e2e_deepspeed.unavailable()
    if missing and any(p.startswith(e2e_deepspeed.PREFIX) for p in chosen):
        print(f"links: {missing}", file=sys.stderr)
        chosen = [p for p in chosen if not p.startswith(e2e_deepspeed.PREFIX)]
    return chosen


def _num_params() -> int:
    return sum(p.numel() for p in e2e._model(WIDTH, DEPTH).parameters())


def _stage3_units() -> list[int]:
    """Parameters of each unit stage 3 gathers, in forward order: each Linear's weight (the biases are
    under ``stage3_param_persistence_threshold``, so pooled into the persistent unit)."""
    return [m.weight.numel() for m in e2e._model(WIDTH, DEPTH) if hasattr(m, "weight")]


def _launch(plan: list[tuple[str, list[str]]], quick: bool, out: str) -> None:
    config = {
        "plan": plan,
        "width": WIDTH,
        "depth": DEPTH,
        "rows": ROWS,
        "warmup": 2 if quick else 3,
        "steps": 5 if quick else 10,  # timed steps: at least this many, and enough for "seconds"
        "seconds": 1.0 if quick else 3.0,
        "timeout_s": 300,
        "probe_numel": 1_000_000,
    }
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    with netns.emulated_nodes() as nodes:
        target = ["-m", "benchmarks._links_rank", out, json.dumps(config)]
        progress_line = re.compile(r"\[\d+/\d+ links\] ").match  # rank 0's progress (common.progress)
        netns.torchrun_on_nodes(
            nodes, target, nproc_per_node=RANKS_PER_NODE, env=env, timeout_s=1800, echo=progress_line
        )


def _mean(values: list[float]) -> Optional[float]:
    return statistics.fmean(values) if values else None


def _gather(out: str) -> tuple[dict[tuple[str, str], dict], dict[tuple[str, str], dict]]:
    """((rate, provider) -> measurement averaged over ranks and over the phases that measured it, (rate,
    provider) -> the probe of those phases, averaged too)."""
    ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    samples: dict[tuple[str, str], list[dict]] = {}
    probes: dict[tuple[str, str], list[dict]] = {}
    for index, phase in enumerate(ranks[0]["phases"]):
        same = [r["phases"][index] for r in ranks]
        probe = {k: statistics.fmean(p["probe"][k] for p in same) for k in same[0]["probe"]}
        for provider in phase["providers"]:
            rows = [p["providers"][provider] for p in same]
            errors = [r["error"] for r in rows if "error" in r]
            key = (phase["rate"], provider)
            probes.setdefault(key, []).append(probe)
            mean = {k: _mean([r[k] for r in rows if k in r]) for k in rows[0]}
            samples.setdefault(key, []).append({"error": errors[0]} if errors else mean)
    measured = {}
    for key, runs in samples.items():
        failed = [r for r in runs if "error" in r]
        measured[key] = failed[0] if failed else {k: statistics.fmean(r[k] for r in runs) for k in runs[0]}
        measured[key]["runs"] = len(runs)
    return measured, {key: {k: statistics.fmean(p[k] for p in ps) for k in ps[0]} for key, ps in probes.items()}


def _cluster(probe: dict, rate: str) -> Cluster:
    """The cluster at ``rate``, its host measured by ``probe`` (the calibration run's): no limit but the
    host's own without a rate, else a link carrying ``rate x tcp_payload_share()`` of payload."""
    host = probe["host_Bps"]
    link, share = (host, 1.0) if rate == "none" else (netns.parse_rate(rate) / 8, tcp_payload_share())
    return Cluster(
        NODES, RANKS_PER_NODE, link, host, probe["latency_us"] * 0.5e-6, "gloo", payload_share=share, host_Bps=host
    )


class _Planner:
    """The planner fitted to the run without a rate limit (our stages' steps there, and its probe)."""

    rate = "none"

    def __init__(self, measured: dict, probes: dict):
        self.num_params = _num_params()
        self.options = {"bucket_elements": e2e.BUCKET_ELEMENTS, "units": _stage3_units()}
        self.probe = next((p for (rate, provider), p in probes.items() if rate == self.rate and provider in OURS), None)
        self.compute: dict[int, Compute] = {}
        for stage, provider in enumerate(OURS):
            m = measured.get((self.rate, provider), {})
            if self.probe is not None and "step_ms" in m:
                phases = Compute(m["fwd_ms"] / 1e3, m["bwd_ms"] / 1e3, m["opt_ms"] / 1e3)
                cluster = _cluster(self.probe, self.rate)
                self.compute[stage] = calibrate(
                    stage, m["step_ms"] / 1e3, phases, self.num_params, cluster, **self.options
                )

    def predict(self, stage: int, rate: str) -> Optional[LinkStep]:
        """The planner's step of ``stage`` at ``rate``; None when the stage has no calibration."""
        if stage not in self.compute:
            return None
        return stage_step(stage, self.num_params, _cluster(self.probe, rate), self.compute[stage], **self.options)

    def crossover(self) -> str:
        if not {2, 3} <= set(self.compute):
            return "planner: stages 2 and 3 were not both measured without a rate limit"
        limited = _cluster(self.probe, "1gbit")  # any limited rate: the search varies it
        rate, why = crossover_Bps(self.num_params, limited, self.compute, **self.options)
        if rate is None:
            return f"planner: {why}: no crossover"
        return f"planner: stage 3 slower than stage 2 below {netns.format_rate(rate * 8)}"


def _rows(measured: dict, probes: dict, planner: _Planner) -> list[dict]:
    rows = []
    for (rate, provider), m in measured.items():
        row: dict[str, Any] = {"case": rate, "provider": provider}
        if "error" in m:
            rows.append({**row, "error": m["error"]})
            continue
        row.update(step_ms=m["step_ms"])
        prediction = planner.predict(OURS.index(provider), rate) if provider in OURS else None
        if prediction is not None:
            row.update(planned_ms=prediction.step_s * 1e3, error_pct=100 * (prediction.step_s * 1e3 / m["step_ms"] - 1))
        row["link_MB"] = m.get("tx_bytes", float("nan")) / 1e6
        if prediction is not None:
            row["planned_MB"] = prediction.link_bytes / 1e6
        row["link_MB/s"] = probes[(rate, provider)]["link_Bps"] / 1e6
        if not provider.startswith(e2e_deepspeed.PREFIX):  # DeepSpeed's step is timed in one piece
            row.update(fwd_ms=m["fwd_ms"], bwd_ms=m["bwd_ms"], opt_ms=m["opt_ms"])
        if rate == planner.rate and prediction is not None:
            row["note"] = f"calibration (mean of {m['runs']} runs)" if m["runs"] > 1 else "calibration"
        rows.append(row)
    _compare_zeropp(rows)
    return rows


def _compare_zeropp(rows: list[dict]) -> None:
    """On each ZeRO++ row, its link bytes and step against plain stage 3's and stage 2's at the same rate."""
    by = {(r["case"], r["provider"]): r for r in rows if "step_ms" in r}
    for (rate, provider), row in by.items():
        if provider not in ZEROPP:
            continue
        parts = []
        stage3, stage2 = by.get((rate, OURS[3])), by.get((rate, OURS[2]))
        if stage3 is not None:
            parts.append(f"link {row['link_MB'] / stage3['link_MB']:.2f}x stage 3")
            parts.append(f"step {row['step_ms'] / stage3['step_ms']:.2f}x stage 3")
        if stage2 is not None:
            parts.append(f"{row['step_ms'] / stage2['step_ms']:.2f}x stage 2")
        row["note"] = ", ".join(parts)


def _measured_crossover(rows: list[dict]) -> str:
    """Where stage 3's measured step becomes longer than stage 2's as the rate falls (or that it never does)."""
    step = {(r["case"], r["provider"]): r["step_ms"] for r in rows if "step_ms" in r}
    rates = sorted({r for r, _ in step}, key=lambda r: float("inf") if r == "none" else netns.parse_rate(r))[::-1]
    both = [r for r in rates if (r, OURS[2]) in step and (r, OURS[3]) in step]
    if not both:
        return "measured: stages 2 and 3 were not both measured"
    slower = [step[(r, OURS[3])] > step[(r, OURS[2])] for r in both]
    if all(slower):
        return f"measured: stage 3 slower than stage 2 at every rate ({', '.join(both)}): no crossover"
    if not any(slower):
        return f"measured: stage 3 as fast as stage 2 or faster at every rate ({', '.join(both)})"
    first = slower.index(True)
    return f"measured: stage 3 slower than stage 2 from {both[first]} down (faster or equal at {both[first - 1]})"


def _check(rows: list[dict], planner: _Planner) -> dict:
    """The last row: the planner's worst error where the link limits the step: the limited rates slower
    than what the host moved without a limit (faster ones leave the step to the host, as without a limit:
    their error is the run-to-run noise of a CPU-bound step, reported in the note)."""
    if not planner.compute:
        return {"case": "check", "provider": "planner", "note": "no calibration: measure our stages at rate none too"}
    host = planner.probe["host_Bps"]
    limited = [r for r in rows if "error_pct" in r and r["case"] != planner.rate]
    bound = [r for r in limited if netns.parse_rate(r["case"]) / 8 * tcp_payload_share() < host]
    if not bound:
        return {"case": "check", "provider": "planner", "note": "no link-bound rate measured: nothing to check"}
    worst = max(bound, key=lambda r: abs(r["error_pct"]))
    verdict = "within" if abs(worst["error_pct"]) <= 100 * TOLERANCE else "NOT within"
    rates = ", ".join(dict.fromkeys(r["case"] for r in bound))
    where = f"{len(bound)} cases; worst {worst['provider']} at {worst['case']}"
    note = f"{verdict} {100 * TOLERANCE:.0f} % at {rates} ({where})"
    others = [r for r in limited if r not in bound]
    if others:
        other = max(others, key=lambda r: abs(r["error_pct"]))
        note += f"; above the host's {host / 1e6:.0f} MB/s: worst {abs(other['error_pct']):.0f} % ({other['case']})"
    return {"case": "check", "provider": "planner", "error_pct": abs(worst["error_pct"]), "note": note}


def run(quick: bool) -> list[dict]:
    reason = netns.unavailable()
    if reason:
        print(f"links: skipped: {reason}", file=sys.stderr)
        return [{"case": "-", "provider": "-", "skipped": reason}]
    rates = _options.get("rates") or list(RATES)
    plan = _plan(rates, _providers())
    expect(sum(len(providers) for _, providers in plan))
    with tempfile.TemporaryDirectory() as out:
        try:
            _launch(plan, quick, out)
        except RuntimeError as exc:
            print(f"links: {exc}", file=sys.stderr)
            return [{"case": "-", "provider": "-", "error": str(exc).splitlines()[0]}]
        measured, probes = _gather(out)
    planner = _Planner(measured, probes)
    rows = _rows(measured, probes, planner)
    rows.append({"case": "crossover", "provider": "stage 3 vs 2", "note": _measured_crossover(rows)})
    rows.append({"case": "crossover", "provider": "stage 3 vs 2", "note": planner.crossover()})
    rows.append(_check(rows, planner))
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per rate: our fastest stage against the fastest peer."""
    timed = [r for r in rows if "step_ms" in r]
    return best_vs_peer(timed, is_ours=lambda provider: provider.startswith("zk-"), metric="step_ms")


# Drawn beside each of our stages: peers of the same scheme (DDP, FSDP2; DeepSpeed's same stage), and
# beside stage 3 our stage 2, the trade-off the crossover is about.
PEERS_OF = {0: ("ddp+adamw-fused",), 1: (), 2: ("ddp+adamw-fused",), 3: ("fsdp2", "zk-stage2", *ZEROPP)}


def plot(plt: Any, rows: list[dict]) -> Any:
    """Step time against link rate, a panel per stage: ours measured (solid) and planned (dotted), its peers."""
    timed = [r for r in rows if "step_ms" in r]
    limited = sorted({netns.parse_rate(r["case"]) for r in timed if r["case"] != "none"})
    unlimited_x = limited[-1] * 4 if limited else 1e10
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True, sharey=True)
    for stage, ax in enumerate(axes.flat):
        peers = (*PEERS_OF[stage], f"{e2e_deepspeed.PREFIX}{stage}")
        for provider in (OURS[stage], *peers):
            mine = sorted(
                (unlimited_x if r["case"] == "none" else netns.parse_rate(r["case"]), r)
                for r in timed
                if r["provider"] == provider
            )
            if not mine:
                continue
            ours = provider == OURS[stage]
            ax.plot([x for x, _ in mine], [r["step_ms"] for _, r in mine], marker="o", label=provider,
                    linestyle="-" if ours else "--", linewidth=2 if ours else 1)  # fmt: skip
            planned = [(x, r["planned_ms"]) for x, r in mine if "planned_ms" in r]
            if planned and ours:
                ax.plot([x for x, _ in planned], [y for _, y in planned], marker="x", linestyle=":", color="black",
                        label="planner")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks([*limited, unlimited_x])
        ax.set_xticklabels([netns.format_rate(t) for t in limited] + ["none"])
        ax.minorticks_off()
        ax.set_title(f"stage {stage}")
        ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("link rate each way (tc tbf)")
    for ax in axes[:, 0]:
        ax.set_ylabel("step ms (mean over ranks)")
    fig.suptitle(f"2 nodes x 2 gloo ranks, e2e MLP {_num_params() / 1e6:.1f}M parameters")
    return fig
