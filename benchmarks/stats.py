"""How the benchmarks report a number measured over several rounds or seeds."""

from __future__ import annotations

import statistics


def spread(values: list[float | None], label: str = "rounds") -> dict | None:
    """The median, the extremes, and every value in order (None where a round measured
    nothing: no request of the kind completed)."""
    measured = [v for v in values if v is not None]
    if len(measured) < len(values):
        return {"median": None, label: values} if not measured else {**spread(measured, label), label: values}
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3), label: [round(v, 3) for v in values]}
