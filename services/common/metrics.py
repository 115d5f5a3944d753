"""Prometheus metrics: every service serves its own on ``--metrics-port`` (off by
default), with ``prometheus-client``'s text exposition at ``/metrics``.

Names follow vLLM's (``vllm:time_to_first_token_seconds`` ...) under a ``kervan_``
prefix with unit suffixes; an underscore rather than vLLM's colon, since Prometheus
reserves colons for recording rules and ``promtool check metrics`` says so. Each
service defines its own metrics next to its code (``services/*/metrics.py``); this
module holds what they share: the server, the latency buckets, and the count of
errors every gRPC method answered (the error interceptor's)."""

from __future__ import annotations

import argparse

from prometheus_client import Counter, start_http_server

# seconds: from a millisecond step on a GPU to a minute-long request on a busy CPU
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)

RPC_ERRORS = Counter("kervan_rpc_errors", "gRPC calls answered with an error status, by method and status code",
                     ["method", "code"])


def serve_metrics(port: int | None, host: str, service: str) -> None:
    """Serve ``/metrics`` on ``host:port`` in a daemon thread (0: a free port) and print
    where; nothing when ``port`` is None (metrics off)."""
    if port is None:
        return
    server, _ = start_http_server(port, addr=host)
    print(f"{service} metrics on http://{host}:{server.server_address[1]}/metrics", flush=True)


def add_metrics_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--metrics-port", type=int, default=None,
                    help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port, printed at start)")
