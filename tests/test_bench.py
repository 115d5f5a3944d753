"""``kervan bench``: its workloads, its arithmetic, its arrival process, and whole runs
against the shared test cluster through both backends (gRPC and the OpenAI front)."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter

import numpy as np
import pytest

from control_plane.bench import workload
from control_plane.bench.backends import Timed
from control_plane.bench.load import arrival_offsets, run_closed_loop, run_open_loop
from control_plane.bench.report import parse_goodput, summarize
from control_plane.bench.workload import BenchRequest, Lengths, SharedPrefix


def test_length_distributions_parse_draw_and_refuse():
    import random
    rng = random.Random(0)
    assert Lengths.parse("64").draw(rng) == 64 == Lengths.parse("fixed:64").draw(rng)
    uniform = [Lengths.parse("uniform:10:20").draw(rng) for _ in range(2000)]
    assert min(uniform) == 10 and max(uniform) == 20
    normal = [Lengths.parse("normal:100:10").draw(rng) for _ in range(2000)]
    assert abs(statistics.mean(normal) - 100) < 2 and 8 < statistics.stdev(normal) < 12
    for bad in ("uniform:20:10", "fixed:0", "poisson:3", "uniform:1", "x"):
        with pytest.raises(ValueError):
            Lengths.parse(bad)


def test_shared_prefixes_are_zipf_popular_fixed_by_their_seed_and_followed_by_fresh_tokens():
    spec = SharedPrefix.parse("8:32:1.2")
    a = workload.build(4000, Lengths.parse("16"), Lengths.parse("4"), seed=1, shared_prefix=spec)
    counts = Counter(r.prefix_group for r in a)
    expected = np.array(spec.weights()) / sum(spec.weights()) * len(a)
    observed = np.array([counts[k] for k in range(8)])
    assert np.all(np.abs(observed - expected) < 4 * np.sqrt(expected) + 5), (observed, expected)
    assert all(len(r.prompt) == 48 and r.max_tokens == 4 for r in a)
    b = workload.build(50, Lengths.parse("16"), Lengths.parse("4"), seed=2, shared_prefix=spec, prefix_seed=1)
    prefixes_a = {r.prefix_group: r.prompt[:32] for r in a}
    assert all(r.prompt[:32] == prefixes_a[r.prefix_group] for r in b)  # the same system prompts
    assert {tuple(r.prompt[32:]) for r in b}.isdisjoint({tuple(r.prompt[32:]) for r in a})
    assert workload.build(50, Lengths.parse("16"), Lengths.parse("4"), seed=2, shared_prefix=spec,
                          prefix_seed=1) == b  # seeded: the same list again


def test_a_prompts_file_of_json_lines_or_plain_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "first"}\nsecond line\n\n{"text": "third"}\n')
    reqs = workload.build(6, Lengths.parse("1"), Lengths.parse("8"), seed=0, prompts_file=path)
    assert sorted(r.prompt for r in reqs) == sorted(["first", "second line", "third"] * 2)
    path.write_text('{"other": 1}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        workload.read_prompts(path)


def timed(ttft, gaps, start=0.0, error=None, prompt=10, cached=0) -> Timed:
    t = Timed(ttft=ttft, itls=list(gaps), tokens=1 + len(gaps), prompt_tokens=prompt, cached_prompt_tokens=cached,
              started=start, ended=start + ttft + sum(gaps), error=error)
    return t


def test_the_summary_s_arithmetic():
    results = [timed(0.1, [0.02] * 9), timed(0.3, [0.04] * 9, cached=5), timed(0.2, [0.01] * 4),
               timed(0, [], error="RESOURCE_EXHAUSTED")]
    s = summarize(results, 2.0, percentiles=(50, 99), slo=parse_goodput(["ttft:250", "tpot:30"]))
    assert (s["completed"], s["failed"], s["errors"]) == (3, 1, {"RESOURCE_EXHAUSTED": 1})
    assert s["total_output_tokens"] == 25 and s["output_throughput"] == 12.5 and s["request_throughput"] == 1.5
    assert s["cached_prompt_share"] == round(5 / 30, 4)
    assert s["median_ttft_ms"] == 200.0 and s["p99_ttft_ms"] == pytest.approx(np.percentile([100, 200, 300], 99))
    assert s["median_tpot_ms"] == 20.0 and s["mean_itl_ms"] == pytest.approx((9 * 20 + 9 * 40 + 4 * 10) / 22, abs=1e-3)
    assert s["median_e2el_ms"] == pytest.approx(280.0)
    assert s["goodput"] == 1.0 and s["goodput_share"] == 0.5  # the 2nd misses both targets, the failure counts
    with pytest.raises(ValueError):
        parse_goodput(["latency:3"])


def test_a_chunk_of_tokens_is_one_gap_and_e2el_ends_at_the_last_token(monkeypatch):
    """vLLM's definitions: one ITL gap per chunk (a 3-token chunk after 40 ms is one 40 ms
    wait, not three of 13 ms), E2EL to the last token, TPOT over the tokens after the first."""
    clock = iter([0.110, 0.130, 0.170])
    monkeypatch.setattr("control_plane.bench.backends.time.perf_counter", lambda: next(clock))
    t = Timed(started=0.010)
    t.token_arrived(1)  # at 0.110: TTFT 100 ms
    t.token_arrived(1)  # at 0.130
    t.token_arrived(3)  # at 0.170, a speculative step's three tokens at once
    t.ended = 0.500  # the stream's end, after the last token: not latency
    assert t.ttft == pytest.approx(0.100) and t.itls == pytest.approx([0.020, 0.040]) and t.tokens == 5
    assert t.e2e == pytest.approx(0.160) and t.tpot == pytest.approx(0.060 / 4)


class Recorder:
    """A target that answers after ``service_s`` and records when each request came."""

    def __init__(self, service_s: float = 0.0):
        self.sent: list[float] = []
        self.in_flight = self.most_in_flight = 0
        self.service_s = service_s

    async def send(self, req: BenchRequest) -> Timed:
        self.sent.append(time.perf_counter())
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(self.service_s)
        self.in_flight -= 1
        return timed(self.service_s, [])


def test_arrivals_are_a_seeded_poisson_process_at_the_rate():
    offsets = arrival_offsets(20000, 8.0, seed=3)
    gaps = np.diff([0.0, *offsets])
    assert offsets[-1] == pytest.approx(20000 / 8.0, rel=1e-12)  # scaled as vLLM scales them: N arrive by N / rate
    assert gaps.min() > 0 and abs(gaps.mean() - 1 / 8) < 1e-9  # so the mean gap is exactly 1/rate
    assert abs(gaps.std() / gaps.mean() - 1) < 0.03  # exponential: coefficient of variation 1
    assert abs(np.mean(gaps > 1 / 8) - math.exp(-1)) < 0.01  # P(gap > mean) = 1/e
    few = arrival_offsets(5, 2.0, seed=3)
    assert few == arrival_offsets(5, 2.0, seed=3) and few[-1] == pytest.approx(2.5)  # seeded, and exact for few too
    assert arrival_offsets(3, math.inf) == [0.0] * 3


async def test_open_loop_sends_on_schedule_however_slow_the_answers_are():
    reqs = [BenchRequest([5], 1)] * 40
    target = Recorder(service_s=2.0)  # far slower than the arrivals: a closed loop would wait
    before = time.perf_counter()
    _, wall = await run_open_loop(target, reqs, rate=100.0, seed=3, progress=False)
    assert target.most_in_flight == 40  # every request was sent before the first answer came
    offsets = arrival_offsets(40, 100.0, 3)
    # none sent before its arrival time (one sent late, by a busy loop, may be: the schedule does not slip)
    assert all(sent >= before + offset - 0.001 for sent, offset in zip(target.sent, offsets))
    capped = Recorder(service_s=0.05)
    await run_open_loop(capped, reqs[:40], rate=math.inf, max_concurrency=4, progress=False)
    assert capped.most_in_flight == 4


async def test_a_ramp_runs_as_one_open_loop_summarized_whole_and_per_phase():
    from control_plane.bench.command import sweep
    from control_plane.bench.load import Ramp

    ramp = Ramp.parse("1:20,1:0,1:40")  # 20 requests in the first second, none in the next, 40 in the last

    class Backend(Recorder):  # the backend protocol: an async context
        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return None
    backend = Backend()
    [run] = await sweep(backend, lambda i: [BenchRequest([5], 1)] * (ramp.num_requests if i >= 0 else 1),
                        [("ramp", ramp)], seed=2, warmup=0, progress=False, slo={"ttft": 1000.0})
    assert run["load"] == "ramp" and run["summary"]["completed"] == 60 and run["ramp"] == [[1, 20], [1, 0], [1, 40]]
    offsets = ramp.offsets(seed=2)
    per_phase = [sum(ramp.phase_of(t) == i for t in offsets) for i in range(3)]  # Poisson: only the total is fixed
    assert per_phase[1] == 0 and sum(per_phase) == 60 and per_phase[2] > per_phase[0]
    assert [p["summary"]["completed"] for p in run["phases"]] == per_phase  # each request in the phase it came in
    assert [p["summary"]["request_throughput"] for p in run["phases"]] == [float(n) for n in per_phase]  # a 1 s phase
    sent = [t - backend.sent[0] + offsets[0] for t in backend.sent]
    assert all(abs(t - at) < 0.05 for t, at in zip(sent, offsets))  # on the ramp's schedule
    assert run["summary"]["goodput_share"] == 1.0


async def test_closed_loop_keeps_exactly_n_in_flight():
    target = Recorder(service_s=0.01)
    results, _ = await run_closed_loop(target, [BenchRequest([5], 1)] * 30, concurrency=3, progress=False)
    assert len(results) == 30 and target.most_in_flight == 3


def bench_cli(*args: str, rc: int = 0) -> dict:
    res = subprocess.run([sys.executable, "-m", "control_plane.cli", "bench", "--no-progress", *args],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == rc, res.stderr[-3000:]
    return json.loads(res.stdout)


def test_kervan_bench_against_the_mesh_sweeps_rates_with_shared_prefixes_and_plots(cluster, tmp_path):
    out = bench_cli("--addr", cluster.router_address, "--num-prompts", "24", "--input-len", "uniform:8:40",
                    "--output-len", "fixed:6", "--token-range", "3:120", "--shared-prefix", "3:48:1.0",
                    "--request-rate", "20,inf", "--goodput", "ttft:60000", "--plot", str(tmp_path / "c.png"),
                    "--json", str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text()) == out
    assert [r["load"] for r in out["runs"]] == ["20/s", "inf/s"]
    for run in out["runs"]:
        s = run["summary"]
        assert s["completed"] == 24 and s["failed"] == 0 and s["total_output_tokens"] == 24 * 6
        assert s["cached_prompt_share"] > 0.3  # the prefixes are served from cache
        assert s["goodput"] == s["request_throughput"]
        assert 0 < s["median_ttft_ms"] <= s["p99_ttft_ms"] and s["p50_tpot_ms"] > 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_kervan_bench_closed_loop_through_the_openai_front(cluster):
    base = f"http://{cluster.addresses['router-http']}/v1"
    with urllib.request.urlopen(f"{base}/models", timeout=30) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    out = bench_cli("--backend", "openai", "--addr", base, "--model", model, "--num-prompts", "12",
                    "--input-len", "16", "--output-len", "5", "--token-range", "3:120", "--concurrency", "4")
    [run] = out["runs"]
    assert run["concurrency"] == 4 and run["summary"]["completed"] == 12
    assert run["summary"]["total_output_tokens"] == 60 and run["summary"]["total_prompt_tokens"] == 12 * 16


def test_kervan_bench_reports_failures_by_status_not_as_latencies(cluster):
    out = bench_cli("--addr", cluster.router_address, "--num-prompts", "4", "--input-len", "8",
                    "--output-len", "100000", "--token-range", "3:120", "--warmup", "0", rc=1)  # none completed: exit 1
    s = out["runs"][0]["summary"]
    assert s["failed"] == 4 and s["errors"] == {"INVALID_ARGUMENT": 4} and s["median_ttft_ms"] is None
