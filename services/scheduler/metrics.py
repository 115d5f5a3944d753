"""The scheduler's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

PLACEMENTS = Counter("kervan_placements", "Requests placed, by where the prompt is prefilled and why "
                     "(remote, short, forked, fallback, overflow, ...)", ["reason"])
KV_FETCHES = Counter("kervan_placement_kv_fetches", "Placements that have the worker computing the prompt fetch "
                     "blocks another worker holds (the cluster KV tier: moving them priced below computing them)")
REFUSALS = Counter("kervan_placement_refusals", "Requests refused because every worker that could take them is busy")
PANICS = Counter("kervan_placement_panics", "Placements that ignored the caller's suspect workers because too few "
                 "others remained (panic threshold)")
DECISION_TIME = Histogram("kervan_placement_decision_seconds", "The scheduler's own work for one placement (pricing "
                          "the workers and choosing), without the registry calls", buckets=(
                              0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1))
