"""PNG plots of a benchmark run (``--plot DIR``, or ``python -m benchmarks plot JSON_DIR OUT_DIR``).

One figure per subject: ``adam.png`` (GB/s per provider and size against the in-place and copy
bandwidth measured in the same run), ``flatten.png`` (GB/s per case and provider against the copy
bandwidth), ``comm.png`` (GB/s per primitive and size for each collective, and the communication
hidden behind compute), ``e2e.png`` (step time and model-state memory per provider). Each title
names the device the run measured (from the run's machine facts): a CPU run says CPU.
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
    """The device a run measured, for figure titles: the GPU's name if the run had one, else the CPU."""
    device = f"GPU {machine['gpu']}" if machine.get("gpu") else f"CPU {machine.get('cpu', '')}".strip()
    cores = f", {machine['cores']} cores" if machine.get("cores") else ""
    return f"{device}{cores}, torch {machine.get('torch', '?')}"


def _bars(ax: Any, groups: list, series: list[str], value: Callable[[Any, str], Any], unit: str) -> None:
    """Grouped bars: one group per entry of ``groups``, one bar per series; ``value`` None leaves a gap."""
    width = 0.8 / max(1, len(series))
    for i, name in enumerate(series):
        xs, ys = [], []
        for g, group in enumerate(groups):
            v = value(group, name)
            if v is not None:
                xs.append(g - 0.4 + (i + 0.5) * width)
                ys.append(v)
        ax.bar(xs, ys, width, label=f" {name}")  # the space: matplotlib leaves labels starting "_" out
    ax.set_xticks(range(len(groups)))
    ax.set_ylabel(unit)


def _lookup(rows: list[dict], column: str, **match: Any) -> Any:
    values = [r[column] for r in rows if column in r and all(r.get(k) == v for k, v in match.items())]
    return statistics.fmean(values) if values else None


def _providers(rows: list[dict], column: str) -> list[str]:
    return list(dict.fromkeys(r["provider"] for r in rows if column in r))


def _roofs(ax: Any, rows: list[dict], roofs: dict[str, str]) -> None:
    for column, label in roofs.items():
        value = next((r[column] for r in rows if column in r), None)
        if value is not None:
            ax.axhline(value, linestyle="--", linewidth=1, color="black" if "inplace" in column else "grey")
            ax.annotate(f"{label} {value:.3g} GB/s", (0, value), xytext=(2, 2), textcoords="offset points", fontsize=7)


def _plot_adam(plt: Any, rows: list[dict]) -> Any:
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4.5), squeeze=False)
    for ax, case in zip(axes[0], cases):
        sub = [r for r in rows if r["case"] == case]
        sizes = sorted({r["n"] for r in sub})
        _bars(ax, sizes, _providers(sub, "GB/s"), lambda n, p: _lookup(sub, "GB/s", n=n, provider=p), "GB/s")
        ax.set_xticklabels([f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else str(n) for n in sizes])
        ax.set_xlabel("parameters")
        _roofs(ax, sub, {"inplace_GB/s": "in-place roof", "copy_GB/s": "copy"})
        count = sub[0]["tensors"]
        ax.set_title(f"Adam step, {case} ({count} tensor{'s' if count != 1 else ''})")
        ax.legend(fontsize=7)
    return fig


def _plot_flatten(plt: Any, rows: list[dict]) -> Any:
    sizes = sorted({r["n"] for r in rows})
    fig, axes = plt.subplots(len(sizes), 1, figsize=(10, 4.5 * len(sizes)), squeeze=False)
    for ax, n in zip(axes[:, 0], sizes):
        sub = [r for r in rows if r["n"] == n]
        cases = list(dict.fromkeys(r["case"] for r in sub))
        _bars(ax, cases, _providers(sub, "GB/s"), lambda c, p: _lookup(sub, "GB/s", case=c, provider=p), "GB/s")
        ax.set_xticklabels(cases, fontsize=8)
        _roofs(ax, sub, {"copy_GB/s": "copy roof"})
        ax.set_title(f"flatten / unflatten, {sub[0]['tensors']} tensors, {n} elements")
        ax.legend(fontsize=7)
    return fig


def _plot_comm(plt: Any, rows: list[dict]) -> Any:
    bandwidth = [r for r in rows if "GB/s" in r and "mode" not in r]
    overlap = [r for r in rows if "hidden" in r]
    ops = list(dict.fromkeys(r["case"].rsplit(" ", 2)[0] for r in bandwidth))
    fig, axes = plt.subplots(1, len(ops) + bool(overlap), figsize=(5 * (len(ops) + bool(overlap)), 4.5), squeeze=False)
    for ax, op in zip(axes[0], ops):
        sub = [r for r in bandwidth if r["case"].rsplit(" ", 2)[0] == op]
        for line in dict.fromkeys((r["provider"], r["primitive"]) for r in sub):
            pts = sorted((float(r["case"].split()[-2]), r["GB/s"], r.get("chosen") == "yes")
                         for r in sub if (r["provider"], r["primitive"]) == line)  # fmt: skip
            chosen = " (chosen)" if any(c for _, _, c in pts) else ""
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{line[0]} engine: {line[1]}{chosen}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("buffer MB")
        ax.set_ylabel("GB/s")
        ax.set_title(op)
        ax.legend(fontsize=6)
    if overlap:
        ax = axes[0][-1]
        engines = list(dict.fromkeys(r["provider"] for r in overlap))
        modes = list(dict.fromkeys(r["mode"] for r in overlap))
        _bars(ax, engines, modes, lambda e, m: _lookup(overlap, "hidden", provider=e, mode=m), "communication hidden")
        ax.set_xticklabels([f"{e} engine" for e in engines])
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_title(f"reduce-scatter behind compute ({overlap[0]['case']})")
        ax.legend(fontsize=7)
    return fig


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
