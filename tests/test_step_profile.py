"""benchmarks/step_profile.py on the embedded model: every point has its wall time, its op
classes (the linears and attention among them), and both bounds from the run's own
measurements of the machine; where the decode stack serves the decode steps, the share of
their time outside its one native call."""

import json
import subprocess
import sys

from worker.kernels import has_native_kernels


def test_step_profile_reports_each_step_against_its_bounds(tmp_path):
    out = tmp_path / "profile.json"
    subprocess.run([sys.executable, "-m", "benchmarks.step_profile", "--batches", "1,3", "--context", "24",
                    "--steps", "2", "--prefill", "2x40", "--rounds", "2", "--json-out", str(out)], check=True,
                   capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    assert report["memory_bandwidth_gb_s"]["min"] > 0 and report["matmul_peak_tflop_s"]["min"] > 0
    assert len(report["rounds"]) == 2 and all(r["memory_bandwidth_gb_s"] > 0 for r in report["rounds"])
    steps = ["decode batch 1", "decode batch 3", "prefill 2 x 40"]
    assert [p["step"] for p in report["points"]] == steps
    for merged in report["points"]:  # each the rounds' median, the bound share's range beside it
        low, high = merged["bound_share_range"]
        assert merged["rounds"] == 2 and low <= merged["bound_share"] <= high
    for point in [p for r in report["rounds"] for p in r["points"]]:  # each against its own round's bounds
        assert point["wall_ms"] > 0 and point["memory_bound_ms"] > 0 and point["compute_bound_ms"] > 0
        assert {"linear", "attention"} <= set(point["ops_ms"]), point["ops_ms"]
        bound = max(point["memory_bound_ms"], point["compute_bound_ms"])
        assert abs(point["bound_share"] - bound / point["wall_ms"]) < 0.01
        if point["step"].startswith("decode") and has_native_kernels():  # the embedded model's stack serves it
            assert 0 < point["outside_stack_share"] < 1, point
        else:
            assert "outside_stack_share" not in point, point
    costs = report["costs"]
    assert costs["matmul_flops_per_token"] == 2 * costs["weight_bytes"] / (
        4 if report["machine"]["dtype"] == "float32" else 2)
