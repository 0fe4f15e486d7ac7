"""PNG plots of a benchmark run (``--plot DIR``, or ``python -m benchmarks plot JSON_DIR OUT_DIR``).

One figure per subject: ``adam.png`` (GB/s per provider and size against the in-place and copy
roofs measured in the same rounds), ``flatten.png`` (GB/s per case and provider against the copy
roof), ``comm.png`` (GB/s per primitive and size for each collective, and the times of the
overlap experiment with the share of communication hidden), ``e2e.png`` (step time and
model-state memory per provider). Bars carry the spread over the interleaved rounds (the fastest
and slowest round); a roof is drawn over its own group of bars and named for what it is (torch's
``add_``/``copy_`` at the case's footprint, the best round), and a bar above its roof is marked.
Each title names the device the run measured (from the run's machine facts) and its load.
``links.png`` (step time against link rate, and the planner's predictions) is drawn by ``links.plot``.
matplotlib is an optional extra (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Callable

PLOT_HINT = "pip install matplotlib (or pip install -e '.[bench]')"


class PlotUnavailable(RuntimeError):
    """Plots were asked for and cannot be drawn (matplotlib missing, nothing to plot)."""


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend; ``PlotUnavailable`` naming the fix without it."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(f"--plot needs matplotlib, which is not installed here: {PLOT_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def device_label(machine: dict) -> str:
    """The device a run measured, for figure titles: the GPU's name if the run had one, else the CPU; and the
    load average when the run started."""
    device = f"GPU {machine['gpu']}" if machine.get("gpu") else f"CPU {machine.get('cpu', '')}".strip()
    cores = f", {machine['cores']} cores" if machine.get("cores") else ""
    load = f", load average {machine['load_avg']}" if machine.get("load_avg") else ""
    return f"{device}{cores}, torch {machine.get('torch', '?')}{load}"


def _spread(rows: list[dict], column: str, **match: Any) -> Any:
    """(value below, value above) the mean of ``column``: the slowest and fastest round, from ``rounds_ms``."""
    found = [r for r in rows if column in r and r.get("rounds_ms") and all(r.get(k) == v for k, v in match.items())]
    if not found:
        return None
    r = found[0]
    per_ms = r[column] * r["median_ms"]  # GB/s x ms: the bytes, so that a round's time gives its GB/s
    values = [per_ms / t for t in r["rounds_ms"]]
    return r[column] - min(values), max(values) - r[column]


def _bars(
    ax: Any,
    groups: list,
    series: list[str],
    value: Callable[[Any, str], Any],
    unit: str,
    spread: Callable[[Any, str], Any] = lambda g, s: None,
) -> list[tuple[float, float]]:
    """Grouped bars: one group per entry of ``groups``, one bar per series; ``value`` None leaves a gap.
    ``spread`` gives (down, up) error bars. Returns each bar's (x, top)."""
    width = 0.8 / max(1, len(series))
    tops = []
    for i, name in enumerate(series):
        xs, ys, errs = [], [], []
        for g, group in enumerate(groups):
            v = value(group, name)
            if v is not None:
                xs.append(g - 0.4 + (i + 0.5) * width)
                ys.append(v)
                errs.append(spread(group, name) or (0.0, 0.0))
        yerr = [[e[0] for e in errs], [e[1] for e in errs]] if any(any(e) for e in errs) else None
        ax.bar(xs, ys, width, yerr=yerr, capsize=2, label=f" {name}")  # " ": matplotlib drops labels that start "_"
        tops += list(zip(xs, ys))
    ax.set_xticks(range(len(groups)))
    ax.set_ylabel(unit)
    return tops


def _lookup(rows: list[dict], column: str, **match: Any) -> Any:
    values = [r[column] for r in rows if column in r and all(r.get(k) == v for k, v in match.items())]
    return statistics.fmean(values) if values else None


def _providers(rows: list[dict], column: str) -> list[str]:
    return list(dict.fromkeys(r["provider"] for r in rows if column in r))


ROOF_LABELS = {
    "inplace_GB/s": "roof: torch add_ in place (best round)",
    "copy_GB/s": "roof: torch copy_ (best round)",
}


def _roofs(ax: Any, groups: list, rows_of: Callable[[Any], list[dict]], columns: list[str]) -> dict:
    """Each roof as a line over its own group of bars; returns group index -> the lowest roof drawn there."""
    lowest = {}
    for g, group in enumerate(groups):
        for column in columns:
            value = next((r[column] for r in rows_of(group) if column in r), None)
            if value is None:
                continue
            dark = column == columns[0]
            ax.hlines(value, g - 0.45, g + 0.45, linestyles="--", linewidth=1, colors="black" if dark else "grey")
            label = f"{ROOF_LABELS.get(column, column)} {value:.3g} GB/s"
            ax.annotate(label, (g - 0.45, value), xytext=(0, 2), textcoords="offset points", fontsize=6)
            lowest[g] = min(value, lowest.get(g, value)) if dark else lowest.get(g, value)
    return lowest


def _mark_above(ax: Any, tops: list[tuple[float, float]], roof_of: dict) -> None:
    for x, top in tops:
        roof = roof_of.get(round(x))
        if roof is not None and top > roof:
            ax.annotate("above roof", (x, top), ha="center", va="bottom", fontsize=6, color="red")


def _plot_adam(plt: Any, rows: list[dict]) -> Any:
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4.8), squeeze=False)
    for ax, case in zip(axes[0], cases):
        sub = [r for r in rows if r["case"] == case]
        sizes = sorted({r["n"] for r in sub})
        tops = _bars(ax, sizes, _providers(sub, "GB/s"), lambda n, p: _lookup(sub, "GB/s", n=n, provider=p), "GB/s",
                     lambda n, p: _spread(sub, "GB/s", n=n, provider=p))  # fmt: skip
        ax.set_xticklabels([f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else str(n) for n in sizes])
        ax.set_xlabel("parameters")
        roof = _roofs(ax, sizes, lambda n: [r for r in sub if r["n"] == n], ["inplace_GB/s", "copy_GB/s"])
        _mark_above(ax, tops, roof)
        count = sub[0]["tensors"]
        ax.set_title(f"Adam step, {case} ({count} tensor{'s' if count != 1 else ''})")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    return fig


def _plot_flatten(plt: Any, rows: list[dict]) -> Any:
    sizes = sorted({r["n"] for r in rows})
    fig, axes = plt.subplots(len(sizes), 1, figsize=(10, 4.8 * len(sizes)), squeeze=False)
    for ax, n in zip(axes[:, 0], sizes):
        sub = [r for r in rows if r["n"] == n]
        cases = list(dict.fromkeys(r["case"] for r in sub))
        tops = _bars(ax, cases, _providers(sub, "GB/s"), lambda c, p: _lookup(sub, "GB/s", case=c, provider=p), "GB/s",
                     lambda c, p: _spread(sub, "GB/s", case=c, provider=p))  # fmt: skip
        ax.set_xticklabels(cases, fontsize=8)
        _mark_above(ax, tops, _roofs(ax, cases, lambda c: [r for r in sub if r["case"] == c], ["copy_GB/s"]))
        ax.set_title(f"flatten / unflatten, {sub[0]['tensors']} tensors, {n} elements")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=4)
    return fig


def _plot_comm(plt: Any, rows: list[dict]) -> Any:
    bandwidth = [r for r in rows if "GB/s" in r and "mode" not in r]
    overlap = [r for r in rows if "hidden" in r]
    ops = list(dict.fromkeys(r["case"].rsplit(" ", 2)[0] for r in bandwidth))
    panels = len(ops) + bool(overlap)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 5.5), squeeze=False)
    for ax, op in zip(axes[0], ops):
        sub = [r for r in bandwidth if r["case"].rsplit(" ", 2)[0] == op]
        for line in dict.fromkeys((r["provider"], r["primitive"]) for r in sub):
            pts = sorted((float(r["case"].split()[-2]), r["GB/s"], r.get("chosen") == "yes")
                         for r in sub if (r["provider"], r["primitive"]) == line)  # fmt: skip
            chosen = any(c for _, _, c in pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linewidth=2.5 if chosen else 1,
                    linestyle="-" if line[0] == "cpp" else ":",
                    label=f"{line[0]} engine: {line[1]}{' (chosen)' if chosen else ''}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("buffer MB (log scale)")
        ax.set_ylabel("GB/s (full buffer bytes / time)")
        ax.set_title(op.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    if overlap:
        _plot_overlap(axes[0][-1], overlap)
    return fig


def _plot_overlap(ax: Any, overlap: list[dict]) -> None:
    """Times of the overlap experiment per engine, and the share of communication hidden (defined in the title)."""
    engines = list(dict.fromkeys(r["provider"] for r in overlap))
    kinds = {"compute alone": "t_compute_ms", "communication alone": "t_comm_ms"}
    modes = list(dict.fromkeys(r["mode"] for r in overlap))
    series = [*kinds, *modes]

    def value(engine: str, name: str) -> Any:
        if name in kinds:
            return _lookup(overlap, kinds[name], provider=engine)
        return _lookup(overlap, "median_ms", provider=engine, mode=name)

    tops = _bars(ax, engines, series, value, "ms")
    for (x, top), (engine, name) in zip(tops, [(e, s) for s in series for e in engines if value(e, s) is not None]):
        if name in modes:
            hidden = _lookup(overlap, "hidden", provider=engine, mode=name)
            ax.annotate(f"hidden {hidden:.0%}", (x, top), ha="center", va="bottom", fontsize=7)
    ax.set_xticklabels([f"{e} engine" for e in engines])
    ax.set_title(
        f"reduce-scatter behind compute ({overlap[0]['case']})\n"
        "hidden = (compute + communication - time) / communication",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2)


def _plot_e2e(plt: Any, rows: list[dict]) -> Any:
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 5))
    step = {p: _lookup(rows, "step_ms", provider=p) for p in providers}
    families = {"ours": "tab:blue", "DeepSpeed": "tab:orange", "torch": "tab:grey"}
    family = ["ours" if p.startswith("zk-") else "DeepSpeed" if p.startswith("deepspeed") else "torch"
              for p in providers]  # fmt: skip
    for name, color in families.items():
        mine = [i for i, f in enumerate(family) if f == name]
        ax_t.bar(mine, [step[providers[i]] or 0 for i in mine], color=color, label=name)
    ax_t.legend(fontsize=7)
    for i, p in enumerate(providers):
        if step[p] is None:
            ax_t.annotate("failed", (i, 0), ha="center", va="bottom", fontsize=7, color="red")
    ax_t.set_ylabel("step ms (mean over ranks)")
    ax_t.set_title(f"training step, {rows[0]['case']}, 2 gloo ranks")
    kinds = [k for k in ("params_MiB", "grads_MiB", "optimizer_MiB", "buffers_MiB") if any(k in r for r in rows)]
    bottom = [0.0] * len(providers)
    for kind in kinds:
        values = [_lookup(rows, kind, provider=p) or 0 for p in providers]
        ax_m.bar(range(len(providers)), values, bottom=bottom, label=kind.replace("_MiB", ""))
        bottom = [b + v for b, v in zip(bottom, values)]
    rss = [_lookup(rows, "peak_rss_mb", provider=p) for p in providers]
    ax_m.plot(range(len(providers)), rss, "k_", markersize=18, label="peak RSS")
    ax_m.set_ylabel("MiB per rank")
    ax_m.set_title("model state per rank, and peak RSS")
    ax_m.legend(fontsize=7)
    for ax in (ax_t, ax_m):
        ax.set_xticks(range(len(providers)))
        ax.set_xticklabels(providers, rotation=30, ha="right", fontsize=8)
    return fig


def _plot_links(plt: Any, rows: list[dict]) -> Any:
    from .links import plot

    return plot(plt, rows)


PLOTTERS = {"adam": _plot_adam, "flatten": _plot_flatten, "comm": _plot_comm, "e2e": _plot_e2e, "links": _plot_links}


def write_plots(results: dict[str, list[dict]], out_dir: str, machine: dict) -> list[str]:
    """Write one PNG per subject that has a plot and rows to draw; return their paths.

    Args:
        results: subject -> rows of one run.
        out_dir: folder for the PNG files (made if missing).
        machine: the run's machine facts (``common.machine_info()``), named in every title.
    """
    plt = require_matplotlib()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    written = []
    for subject, rows in results.items():
        drawable = [r for r in rows if any(k in r for k in ("GB/s", "hidden", "step_ms"))]
        if subject not in PLOTTERS or not drawable:
            continue
        fig = PLOTTERS[subject](plt, rows if subject == "e2e" else drawable)  # e2e shows its failed providers
        fig.suptitle(f"{subject}: measured on {device_label(machine)}", fontsize=10)
        fig.tight_layout()
        path = str(Path(out_dir) / f"{subject}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    if not written:
        raise PlotUnavailable(f"nothing to plot: no rows of {', '.join(PLOTTERS)} in this run")
    return written
