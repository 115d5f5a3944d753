"""``deploy/grafana/kervan.json``: a Grafana dashboard whose every query is PromQL over
Kervan's own metric names. That each name is one a running cluster exports is checked
against a real cluster's endpoints in ``tests/test_cli.py`` (``kervan up --metrics
--planner``); here, what needs no cluster: its shape, and no word in a query that is neither
a Kervan metric nor PromQL's."""

from __future__ import annotations

import json

from tests.dashboard_names import DASHBOARD, PROMQL_WORDS, dashboard_queries, query_metric_names, query_words


def test_the_dashboard_is_grafana_json_with_a_prometheus_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36
    assert [v["type"] for v in dashboard["templating"]["list"]] == ["datasource"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])


def test_every_query_names_kervan_metrics_and_promql_only():
    covered = set()
    for expr in dashboard_queries():
        assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]"), expr
        names = query_metric_names(expr)
        assert names, expr
        assert query_words(expr) - names <= PROMQL_WORDS, (expr, query_words(expr) - names - PROMQL_WORDS)
        covered |= names
    # what the issue asks a dashboard to show: TTFT/ITL, throughput, KV per tier, placement reasons,
    # migrations, speculation, the planner's decisions
    for needed in ("kervan_time_to_first_token_seconds_bucket", "kervan_inter_token_latency_seconds_bucket",
                   "kervan_generation_tokens_total", "kervan_kv_cache_usage_perc", "kervan_kv_host_blocks",
                   "kervan_kv_disk_blocks", "kervan_placements_total", "kervan_migrations_total",
                   "kervan_spec_decode_num_accepted_tokens_total", "kervan_planner_target_workers",
                   "kervan_planner_scalings_total"):
        assert needed in covered, needed
