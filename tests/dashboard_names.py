"""The metric names a Grafana dashboard's queries use, and those a running cluster's
``/metrics`` endpoints expose (by their ``# TYPE`` lines, so a labelled family counts before
its first sample), for the dashboard tests."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

DASHBOARD = Path(__file__).parent.parent / "deploy" / "grafana" / "kervan.json"
# what may appear in a query besides metric names: PromQL's functions, aggregations and
# keywords, Grafana's interval variables, and the label names the queries group by
PROMQL_WORDS = {"sum", "rate", "increase", "histogram_quantile", "by", "without", "avg", "max", "min", "le",
                "instance", "job", "reason", "direction", "pool", "finished_reason", "__rate_interval", "m", "s"}
# prometheus-client's text format names a counter's family with its _total already
SUFFIXES = {"counter": ("",), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "info": ("_info",), "summary": ("_sum", "_count", "_created", "")}


def dashboard_queries(path: Path = DASHBOARD) -> list[str]:
    dashboard = json.loads(path.read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


def query_words(expr: str) -> set[str]:
    """Every identifier of a query, without quoted strings, label matchers' values and numbers."""
    bare = re.sub(r'"[^"]*"', "", expr)
    return set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare))


def query_metric_names(expr: str) -> set[str]:
    return {w for w in query_words(expr) if w.startswith("kervan_")}


def exposed_names(urls: list[str]) -> set[str]:
    """Sample names each endpoint's families expose: a histogram ``x`` as ``x_bucket``..."""
    names: set[str] = set()
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
            names.update(family + suffix for suffix in SUFFIXES.get(kind, ("",)))
    return names
