"""How ``plan_check`` scores a plan against its cluster: fixed here, before a run, never
after one (``benchmarks/tables.py`` scores the committed reports with the same rule).

- Scored: what the plan predicts that the load does not fix. Mean TTFT and median ITL at
  each load, and the capacity knee (the rate where mean TTFT leaves its target). Output
  throughput is not scored: at a rate the cluster keeps up with, it is the offered load
  (``rate x output_len``) whatever the plan says.
- Within: ``|measured / predicted - 1| <= TOLERANCE``.
- Undecided: a point whose own rounds spread wider than the tolerance (the slowest over
  the fastest above ``1 + TOLERANCE``): the measurement cannot tell within from a miss
  there, so it is counted apart, neither way."""

from __future__ import annotations

TOLERANCE = 0.20
SCORED = ("ttft_ms", "itl_ms")
KNEE_STEPS = (0.6, 0.8, 1.0, 1.25, 1.5)  # the knee's probes, as multiples of the predicted knee


def verdict(measured: float | None, predicted: float, rounds: list[float]) -> str:
    """``within``, ``miss`` or ``undecided`` for one scored value."""
    if measured is None or not predicted:
        return "undecided"
    if len(rounds) > 1 and min(rounds) > 0 and max(rounds) / min(rounds) > 1 + TOLERANCE:
        return "undecided"
    return "within" if abs(measured / predicted - 1) <= TOLERANCE else "miss"


def point_verdicts(point: dict) -> dict[str, str]:
    """Each scored value of one load point of a ``plan_check`` report."""
    rounds = point.get("rounds", [])
    return {k: verdict(point["measured"].get(k), point["predicted"][k], [r["measured"][k] for r in rounds
                                                                          if r["measured"].get(k) is not None])
            for k in SCORED}


def knee_from(probes: list[dict], target_ms: float) -> float | None:
    """The rate where mean TTFT crosses ``target_ms``: between the last probe under it and
    the first over it, linear in TTFT; None when no probe crossed it (or the first did)."""
    for below, above in zip(probes, probes[1:]):
        if below["ttft_ms"] <= target_ms < above["ttft_ms"]:
            share = (target_ms - below["ttft_ms"]) / (above["ttft_ms"] - below["ttft_ms"])
            return below["rate"] + share * (above["rate"] - below["rate"])
    return None


def score(report: dict) -> dict[str, int]:
    """Counts over a report's scored values: within, miss, undecided (knees included), and
    ``median_within``: the load points whose median alone is within, the spread ignored."""
    counts = {"within": 0, "miss": 0, "undecided": 0, "median_within": 0}
    for model in report["models"].values():
        for point in model["points"]:
            for v in point_verdicts(point).values():
                counts[v] += 1
            counts["median_within"] += sum(abs(point["measured"][k] / point["predicted"][k] - 1) <= TOLERANCE
                                           for k in SCORED if point["measured"].get(k) is not None
                                           and point["predicted"][k])
        knee = model.get("knee")
        if knee:  # no crossing among the probes: the knee lies outside them, past the tolerance
            counts["miss" if knee["measured_rate"] is None else
                   verdict(knee["measured_rate"], knee["predicted_rate"], [])] += 1
    return counts
