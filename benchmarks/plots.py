"""PNG plots for the benchmarks, when matplotlib is installed (``pip install -e '.[bench]'``).

Each benchmark calls one function here with its report; without matplotlib it
says so and the JSON stays the result."""

from __future__ import annotations

import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, name: str) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", file=sys.stderr)
    return path


def latency_cdfs(name: str, title: str, series: dict[str, list[float]], xlabel: str = "latency (ms)") -> None:
    """One empirical CDF per series (values in ms), log-scaled x."""
    plt = _pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for label, values in series.items():
        values = sorted(values)
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of samples")
    ax.axhline(0.99, color="grey", lw=0.5, ls=":")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    save(fig, name)
    plt.close(fig)


def grouped_bars(name: str, title: str, groups: list[str], series: dict[str, list[float]], ylabels: list[str]) -> None:
    """One panel per group (a metric), one bar per series (a system) in each."""
    plt = _pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(groups), figsize=(3.6 * len(groups), 3.8))
    for k, (ax, group) in enumerate(zip(axes, groups)):
        labels = list(series)
        ax.bar(labels, [series[s][k] for s in labels], color=[f"C{i}" for i in range(len(labels))])
        ax.set_title(group)
        ax.set_ylabel(ylabels[k])
        ax.tick_params(axis="x", labelrotation=20)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    save(fig, name)
    plt.close(fig)


def lines(name: str, title: str, x: list[float], series: dict[str, list[float]], xlabel: str, ylabel: str,
          marks: dict[str, float] | None = None) -> None:
    """One line per series over ``x`` (log2-scaled), with horizontal reference ``marks``."""
    plt = _pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for label, values in series.items():
        ax.plot(x, values, marker="o", label=label)
    for label, value in (marks or {}).items():
        ax.axhline(value, color="grey", lw=0.8, ls="--")
        ax.annotate(label, (x[0], value), textcoords="offset points", xytext=(2, 3), fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    save(fig, name)
    plt.close(fig)
