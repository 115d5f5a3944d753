"""The planner's own Prometheus metrics: what it decided, for the dashboards (the metrics
it reads are the services', ``metrics.py``). In a registry of their own, served by the
standalone planner on ``--metrics-port`` and by ``kervan up --planner`` beside the
services' (the launcher's process holds no other metric to leak into it)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from kervan.worker_info import WorkerRole

REGISTRY = CollectorRegistry()
POOL_NAMES = (str(WorkerRole.PREFILL), str(WorkerRole.DECODE))
TARGET_WORKERS = Gauge("kervan_planner_target_workers", "Workers the planner wants in each pool", ["pool"],
                       registry=REGISTRY)
SCALINGS = Counter("kervan_planner_scalings", "Pool resizes the planner ordered, by pool and direction",
                   ["pool", "direction"], registry=REGISTRY)
INTERVALS = Counter("kervan_planner_intervals", "Planner intervals, by outcome (decided, skipped, stopped)",
                    ["outcome"], registry=REGISTRY)
for _pool in POOL_NAMES:  # every series exists from the start, at 0, as Prometheus advises for known labels
    for _direction in ("up", "down"):
        SCALINGS.labels(_pool, _direction)
for _outcome in ("decided", "skipped", "stopped"):
    INTERVALS.labels(_outcome)


def serve(port: int, host: str = "127.0.0.1") -> str:
    """Serve ``/metrics`` in a daemon thread (0: a free port); returns HOST:PORT."""
    server, _ = start_http_server(port, addr=host, registry=REGISTRY)
    return f"{host}:{server.server_address[1]}"
