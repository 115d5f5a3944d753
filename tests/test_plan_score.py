"""plan_check's scoring rule (benchmarks/plan_score.py): only what the load does not fix is
scored, a point whose own rounds spread past the tolerance is undecided, and the knee is
read where mean TTFT crosses its target between two probes."""

from benchmarks.plan_score import TOLERANCE, knee_from, point_verdicts, score, verdict


def point(predicted: dict, rounds: list[dict]) -> dict:
    middle = {k: sorted(r[k] for r in rounds)[len(rounds) // 2] for k in predicted}
    return {"predicted": predicted, "measured": middle, "rounds": [{"measured": r} for r in rounds]}


def test_within_miss_and_undecided():
    assert TOLERANCE == 0.20
    assert verdict(110.0, 100.0, [105.0, 110.0, 115.0]) == "within"
    assert verdict(130.0, 100.0, [125.0, 130.0, 135.0]) == "miss"
    assert verdict(110.0, 100.0, [90.0, 110.0, 130.0]) == "undecided"  # 130 / 90 > 1.2: the rounds cannot tell
    assert verdict(None, 100.0, []) == "undecided"


def test_throughput_is_never_scored_and_the_spread_decides_undecided_points():
    p = point({"output_tokens_per_s": 500.0, "ttft_ms": 100.0, "itl_ms": 10.0},
              [{"output_tokens_per_s": 100.0, "ttft_ms": 100.0, "itl_ms": 10.0},
               {"output_tokens_per_s": 100.0, "ttft_ms": 101.0, "itl_ms": 14.0},
               {"output_tokens_per_s": 100.0, "ttft_ms": 102.0, "itl_ms": 10.5}])
    assert point_verdicts(p) == {"ttft_ms": "within", "itl_ms": "undecided"}  # throughput 5x off: not scored
    report = {"models": {"m": {"points": [p], "knee": {"predicted_rate": 2.0, "measured_rate": 3.0}}}}
    assert score(report) == {"within": 1, "miss": 1, "undecided": 1, "median_within": 2}  # the knee 1.5x: a miss


def test_the_knee_is_where_ttft_crosses_its_target_between_two_probes():
    probes = [{"rate": 1.0, "ttft_ms": 500.0}, {"rate": 2.0, "ttft_ms": 1500.0}, {"rate": 3.0, "ttft_ms": 2500.0}]
    assert knee_from(probes, 2000.0) == 2.5
    assert knee_from(probes[:2], 2000.0) is None  # never crossed: outside the probes
    assert knee_from([{"rate": 1.0, "ttft_ms": 2500.0}], 2000.0) is None
