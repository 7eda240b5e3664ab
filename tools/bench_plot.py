"""PNG plots for the benchmarks (`tools/bench.py batching --plot`, `tools/bench_spec.py --plot`).

matplotlib is optional (`pip install 'outrider[bench]'`); it is imported only when a plot is asked
for, with the Agg backend, so the benchmarks run without it and without a display. The plots are
small (about 900 x 380 px at 100 dpi) so that they can live in docs/ and the README.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional, Sequence


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'outrider[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "axes.spines.top": False, "axes.spines.right": False,
                         "savefig.dpi": 100, "figure.dpi": 100})
    return plt


def _save(plt, fig, path: Path, caption: str) -> Path:
    """Lay out, caption at the foot, write `path` (its folder made if needed), close the figure."""
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.text(0.01, 0.01, caption, fontsize=7, color="#555555", ha="left", va="bottom", wrap=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_batching(curves: dict[str, Sequence[dict]], offline: Iterable[dict], path: Path, caption: str) -> Path:
    """Throughput and p99 latency against closed-loop clients, one line per server configuration.

    `curves`: label -> rows with `clients`, `throughput` (requests/s) and `p99` (ms); `offline`:
    rows with `batch` and `throughput`, drawn as horizontal references (the engine alone). A row
    whose `other` (share of the machine's CPU other processes used meanwhile) is above 20% is
    drawn hollow: a neighbour disturbed that point."""
    plt = _pyplot()
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    styles = {"batched": ("#1f77b4", "o"), "unbatched": ("#d62728", "s")}
    for label, rows in curves.items():
        color, marker = styles.get(label, (None, "^"))
        clients = [r["clients"] for r in rows]
        left.plot(clients, [r["throughput"] for r in rows], marker=marker, color=color, label=label)
        right.plot(clients, [r["p99"] for r in rows], marker=marker, color=color, label=label)
        disturbed = [r for r in rows if (r.get("other") or 0) > 0.2]
        for ax, key in ((left, "throughput"), (right, "p99")):
            ax.plot([r["clients"] for r in disturbed], [r[key] for r in disturbed], linestyle="none", marker=marker,
                    markerfacecolor="white", markeredgecolor=color)
    for row in offline:
        left.axhline(row["throughput"], color="#888888", linestyle=":", linewidth=1)
        left.annotate(f"ORT alone, batch {row['batch']:.0f}", (1, row["throughput"]), fontsize=7, color="#555555",
                      xytext=(2, 2), textcoords="offset points")
    for ax, ylabel in ((left, "sentences / s"), (right, "p99 latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients (closed loop)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)
        xs = sorted({r["clients"] for rows in curves.values() for r in rows})
        ax.set_xticks(xs, [str(x) for x in xs])
    right.set_yscale("log")
    right.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    right.yaxis.set_major_formatter(ScalarFormatter())
    right.yaxis.set_minor_formatter(NullFormatter())
    left.set_ylim(bottom=0)
    left.legend(loc="upper left", frameon=False)
    if any((r.get("other") or 0) > 0.2 for rows in curves.values() for r in rows):
        right.text(0.98, 0.02, "hollow: other processes used > 20% of the CPU meanwhile", transform=right.transAxes,
                   fontsize=7, color="#555555", va="bottom", ha="right")
    left.set_title("throughput", fontsize=9)
    right.set_title("tail latency", fontsize=9)
    return _save(plt, fig, path, caption)


def plot_speculation(tables: Sequence[dict], path: Path, caption: str, baseline: Optional[str] = None) -> Path:
    """Speed-up over the first row (plain decoding), grouped by (prompt set, temperature), with
    tokens/s written on each bar. `tables`: dicts with `title` and `rows` of (name, tokens/s).

    Speed-ups, not tokens/s, make the bars: the rows of one table are interleaved prompt by prompt,
    so their ratio survives a busy machine, while tokens/s moves with whatever else runs."""
    plt = _pyplot()
    names = [name for name, _ in tables[0]["rows"]]
    baseline = baseline or names[0]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / len(names)
    colors = ["#888888", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]
    for j, name in enumerate(names):
        xs, heights, rates = [], [], []
        for i, table in enumerate(tables):
            row = dict(table["rows"])
            base = row.get(baseline) or 0.0
            xs.append(i + (j - (len(names) - 1) / 2) * width)
            heights.append(row.get(name, 0.0) / base if base else 0.0)
            rates.append(row.get(name, 0.0))
        bars = ax.bar(xs, heights, width=width * 0.95, label=name, color=colors[j % len(colors)])
        for bar, rate in zip(bars, rates):
            ax.annotate(f"{bar.get_height():.2f}x\n{rate:.1f}/s", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7, xytext=(0, 1), textcoords="offset points")
    ax.axhline(1.0, color="#555555", linewidth=0.8)
    ax.set_xticks(range(len(tables)), [t["title"] for t in tables])
    ax.set_ylabel(f"speed-up over {baseline}")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper right", frameon=False, fontsize=8, ncol=len(names))
    ax.set_ylim(0, ax.get_ylim()[1] * 1.25)
    return _save(plt, fig, path, caption)
