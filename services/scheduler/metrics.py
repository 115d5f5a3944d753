"""The scheduler's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter

PLACEMENTS = Counter("kervan_placements", "Requests placed, by where the prompt is prefilled and why "
                     "(remote, short, forked, fallback, overflow, ...)", ["reason"])
REFUSALS = Counter("kervan_placement_refusals", "Requests refused because every worker that could take them is busy")
PANICS = Counter("kervan_placement_panics", "Placements that ignored the caller's suspect workers because too few "
                 "others remained (panic threshold)")
