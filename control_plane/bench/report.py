"""What a run measured, in the terms ``vllm bench serve`` uses.

- throughput: completed requests, output tokens and all tokens per second of wall
  time (the run's start to its last answer);
- TTFT (time to first token), TPOT (a request's mean time per output token after the
  first), ITL (the gap before each chunk of tokens after the first, all requests
  pooled) and E2EL (end-to-end latency, to the last token): mean, median and the asked
  percentiles, in milliseconds;
- goodput: completed requests per second that met every latency target given
  (``ttft``, ``tpot``, ``e2el`` in ms), as in DistServe;
- failures by status. Only completed requests enter the latencies."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from .backends import Timed

SLO_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slo = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"goodput target {item!r}: expected one of {', '.join(SLO_METRICS)} as NAME:MS")
        try:
            slo[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput target {item!r}: MS must be a number") from None
    return slo


def summarize(results: list[Timed], duration_s: float, percentiles=(50, 90, 99),
              slo: dict[str, float] | None = None) -> dict:
    done = [r for r in results if r.error is None]
    out_tokens = sum(r.tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    summary = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": dict(Counter(r.error for r in results if r.error is not None)),
        "duration_s": round(duration_s, 3),
        "request_throughput": round(len(done) / duration_s, 4) if duration_s else None,
        "output_throughput": round(out_tokens / duration_s, 2) if duration_s else None,
        "total_token_throughput": round((out_tokens + prompt_tokens) / duration_s, 2) if duration_s else None,
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": prompt_tokens,
        "cached_prompt_share": round(sum(r.cached_prompt_tokens for r in done) / prompt_tokens, 4)
        if prompt_tokens else None,
    }
    series = {
        "ttft": [r.ttft for r in done if r.tokens],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itls],
        "e2el": [r.e2e for r in done],
    }
    for name, values in series.items():
        summary.update(stats_ms(name, values, percentiles))
    if slo:
        good = sum(1 for r in done if meets(r, slo))
        summary["goodput"] = round(good / duration_s, 4) if duration_s else None
        summary["goodput_share"] = round(good / len(results), 4) if results else None
        summary["slo_ms"] = slo
    return summary


def stats_ms(name: str, values: list[float], percentiles) -> dict:
    if not values:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None,
                **{f"p{p:g}_{name}_ms": None for p in percentiles}}
    ms = np.asarray(values) * 1000.0
    return {f"mean_{name}_ms": round(float(ms.mean()), 3), f"median_{name}_ms": round(float(np.median(ms)), 3),
            **{f"p{p:g}_{name}_ms": round(float(np.percentile(ms, p)), 3) for p in percentiles}}


def meets(r: Timed, slo: dict[str, float]) -> bool:
    measured = {"ttft": r.ttft, "tpot": r.tpot if r.tpot is not None else 0.0, "e2el": r.e2e}
    return all(measured[name] * 1000.0 <= limit for name, limit in slo.items())


def plot_sweep(runs: list[dict], path: Path, title: str = "") -> None:
    """The latency-throughput curve of a sweep: TTFT and TPOT (median and p99) against
    output throughput, one point per rate or concurrency, labelled with it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in runs if r["summary"]["completed"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [r["summary"]["output_throughput"] for r in runs]
    for ax, metric in zip(axes, ("ttft", "tpot")):
        p99 = next((k for k in runs[0]["summary"] if k.startswith("p99") and k.endswith(f"_{metric}_ms")), None) \
            if runs else None
        for key, style in ((f"median_{metric}_ms", "o-"), (p99, "s--")):
            if key:
                ax.plot(xs, [r["summary"][key] for r in runs], style, label=key.replace("_ms", "").replace("_", " "))
        for x, r in zip(xs, runs):
            ax.annotate(r["load"], (x, r["summary"][f"median_{metric}_ms"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "latency against throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
