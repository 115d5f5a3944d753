"""The SLA planner's parts, each against real inputs: Prometheus text written by
prometheus-client itself, the policy's arithmetic on a stated profile, the loop's failure
handling, the ramp ``kervan bench`` sends, and the Kubernetes scaler through the official
client against a local HTTP endpoint that serves the ``scale`` subresource (a stand-in: no
API server runs here)."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from control_plane.bench.load import Ramp
from control_plane.plan.hardware import CATALOG
from control_plane.plan.model_shape import ModelShape
from control_plane.plan.profile import Profile
from control_plane.plan.sizing import Sizer, Slo
from control_plane.planner import metrics
from control_plane.planner.metrics import Observation, Scrape, observe, quantile
from control_plane.planner.policy import PlannerConfig, Policy
from control_plane.planner.predictor import Average, Constant, Trend
from control_plane.planner.scaler import KubernetesScaler
from control_plane.planner.sla_planner import SlaPlanner
from services.common.metrics import LATENCY_BUCKETS

SHAPE = ModelShape(name="tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=256, max_position=2048, tied_embeddings=False)


def router_text(admitted: int, prompt_tokens: int, finished: int, out_tokens: int, ttfts: list[float],
                itls: list[float]) -> str:
    """What a router exports after ``admitted`` requests of ``prompt_tokens`` in all and
    ``finished`` samples of ``out_tokens`` in all (the router's own metric names)."""
    from services.router.metrics import TOKEN_BUCKETS
    reg = CollectorRegistry()
    prompts = Histogram("kervan_request_prompt_tokens", "", buckets=TOKEN_BUCKETS, registry=reg)
    outputs = Histogram("kervan_request_generation_tokens", "", buckets=TOKEN_BUCKETS, registry=reg)
    for _ in range(admitted):
        prompts.observe(prompt_tokens / admitted)
    for _ in range(finished):
        outputs.observe(out_tokens / finished)
    Counter("kervan_generation_tokens", "", registry=reg).inc(out_tokens + 999)  # streamed: not what lengths use
    ttft = Histogram("kervan_time_to_first_token_seconds", "", buckets=LATENCY_BUCKETS, registry=reg)
    itl = Histogram("kervan_inter_token_latency_seconds", "", buckets=LATENCY_BUCKETS, registry=reg)
    for v in ttfts:
        ttft.observe(v)
    for v in itls:
        itl.observe(v)
    return generate_latest(reg).decode()


def worker_text(running: int, waiting: int, kv: float) -> str:
    reg = CollectorRegistry()
    Gauge("kervan_num_requests_running", "", registry=reg).set(running)
    Gauge("kervan_num_requests_waiting", "", registry=reg).set(waiting)
    Gauge("kervan_kv_cache_usage_perc", "", registry=reg).set(kv)
    return generate_latest(reg).decode()


def scrapes(router: str, decode: list[str]) -> dict[str, Scrape]:
    out = {pool: Scrape() for pool in metrics.POOLS}
    out["router"].add_text(router)
    for text in decode:
        out["decode"].add_text(text)
    return out


def test_an_interval_is_the_difference_of_two_scrapes_of_prometheus_text():
    before = scrapes(router_text(10, 1000, 8, 400, [0.1] * 10, [0.02] * 300), [worker_text(0, 0, 0.0)])
    after = scrapes(router_text(30, 3000, 28, 1400, [0.1] * 10 + [0.3] * 20, [0.02] * 300 + [0.05] * 1000),
                    [worker_text(3, 1, 0.5), worker_text(5, 0, 0.75)])
    obs = observe(before, after, 10.0)
    assert obs.rate == 2.0 and obs.input_len == 100.0 and obs.output_len == 50.0
    assert obs.ttft_mean_s == pytest.approx(0.3) and obs.itl_mean_s == pytest.approx(0.05)
    assert 0.25 < obs.ttft_p99_s <= 0.5 and 0.04 < obs.itl_p99_s <= 0.06  # within the bucket the rank is in
    assert (obs.decode_running, obs.decode_waiting, obs.decode_kv_usage) == (4.0, 1.0, 0.75)
    assert obs.num_workers == {"prefill": 0, "decode": 2}
    # a router that restarted (its counters went back) counts from zero, never negative
    restarted = observe(after, scrapes(router_text(4, 400, 0, 0, [], []), []), 10.0)
    assert restarted.rate == 0.4 and restarted.input_len == 100.0 and restarted.output_len == 0.0


def test_histogram_quantiles_interpolate_within_a_bucket_like_prometheus():
    assert quantile({0.1: 0.0, 0.2: 10.0, math.inf: 10.0}, 0.5) == pytest.approx(0.15)
    assert quantile({0.1: 5.0, math.inf: 10.0}, 0.99) == 0.1  # in +Inf: the last finite bound
    assert quantile({0.1: 0.0, math.inf: 0.0}, 0.5) is None


def test_predictors_constant_trend_and_average():
    c, t, a = Constant(), Trend(window=4), Average(window=4)
    assert c.predict() is None and t.predict() is None and a.predict() is None
    for v in (1.0, 2.0, 3.0, 4.0, 5.0):
        c.add(v)
        t.add(v)
        a.add(v)
    assert c.predict() == 5.0 and t.predict() == pytest.approx(6.0)  # the line through 2..5, one ahead
    assert a.predict() == 3.5  # the mean of the last four
    for v in (3.0, 1.0, 0.0, 0.0):
        t.add(v)
    assert t.predict() == 0.0  # a falling line never predicts a negative load


def profile(step0: float = 0.04, per_seq: float = 0.02) -> Profile:
    steps = {b: step0 + per_seq * b for b in (1, 2, 4, 8, 16)}
    return Profile("tiny", "float32", {}, {64: steps, 512: steps}, {16: 0.01, 64: 0.02, 512: 0.1})


def policy(**changes) -> Policy:
    config = PlannerConfig(**{"slo": Slo(5.0, 0.1), "min_decode": 1, "max_decode": 4, "min_prefill": 1,
                              "max_prefill": 2, "interval_s": 1.0, "scale_up_cooldown_s": 1.0,
                              "scale_down_cooldown_s": 5.0, "correct": False, **changes})
    return Policy(Sizer(SHAPE, "float32", "float32", CATALOG["l40s"], profile=profile()), config)


def obs(rate: float, output_len: float = 24.0, **changes) -> Observation:
    base = dict(seconds=1.0, rate=rate, input_len=24.0 if rate else 0.0, output_len=output_len if rate else 0.0,
                ttft_mean_s=None, ttft_p99_s=None, itl_mean_s=None, itl_p99_s=None, decode_running=0.0,
                decode_waiting=0.0, decode_kv_usage=0.0, prefill_waiting=0.0, num_workers={"prefill": 1, "decode": 1})
    return Observation(**{**base, **changes})


def test_the_decode_pool_is_the_load_over_a_worker_s_tokens_within_the_itl_target():
    # steps 40 ms + 20 ms a sequence: 3 sequences within 100 ms, 30 tokens/s a worker
    p = policy()
    assert p.decide(obs(0.0), {"prefill": 1, "decode": 1}, 0.0).target == {"prefill": 1, "decode": 1}
    d = p.decide(obs(2.0), {"prefill": 1, "decode": 1}, 1.0)  # 48 tok/s: two workers
    assert d.needed["decode"] == 2 and d.target == {"prefill": 1, "decode": 2} and "decode: 1 -> 2" in d.reasons
    d = p.decide(obs(10.0), {"prefill": 1, "decode": 2}, 2.0)  # 240 tok/s: eight, capped at four
    assert d.needed["decode"] == 8 and d.target["decode"] == 4


def test_pools_grow_at_once_and_shrink_one_drain_at_a_time_once_their_window_is_quiet():
    p = policy()  # scale-down window 5 s, scale-up cool-down 1 s
    assert p.decide(obs(10.0), {"prefill": 1, "decode": 1}, 0.0).target["decode"] == 4
    d = p.decide(obs(0.5), {"prefill": 1, "decode": 4}, 1.0)  # one quiet interval: noise
    assert d.target["decode"] == 4 and any("decode: 4 -> 1 waits" in r for r in d.reasons)
    assert p.decide(obs(0.5), {"prefill": 1, "decode": 4}, 5.0).target["decode"] == 4  # 4 still in the window
    assert p.decide(obs(0.5), {"prefill": 1, "decode": 4}, 5.5).target["decode"] == 3  # quiet for 5 s: one less
    assert p.decide(obs(0.5), {"prefill": 1, "decode": 3}, 6.0).target["decode"] == 2  # one per interval
    assert p.decide(obs(3.0), {"prefill": 1, "decode": 2}, 7.0).target["decode"] == 3  # 3 req/s needs three
    d = p.decide(obs(10.0), {"prefill": 1, "decode": 3}, 7.5)  # growing again waits out the scale-up cool-down
    assert d.target["decode"] == 3 and any("scale-up cool-down" in r for r in d.reasons)
    assert p.decide(obs(0.5), {"prefill": 1, "decode": 3}, 8.0).target["decode"] == 3  # 3 and 4 in the window
    assert p.decide(obs(10.0), {"prefill": 1, "decode": 3}, 8.5).target["decode"] == 4


def test_a_planner_that_starts_on_a_large_pool_shrinks_nothing_before_a_whole_window():
    p = policy()  # scale-down window 5 s: a restarted planner must not drain on its first quiet interval
    assert p.decide(obs(0.5), {"prefill": 1, "decode": 4}, 100.0).target["decode"] == 4
    assert p.decide(obs(0.5), {"prefill": 1, "decode": 4}, 104.0).target["decode"] == 4
    assert p.decide(obs(0.5), {"prefill": 1, "decode": 4}, 105.5).target["decode"] == 3


def test_a_queue_or_a_full_kv_cache_grows_the_decode_pool_whatever_the_arithmetic():
    p = policy()
    d = p.decide(obs(0.5, decode_waiting=3.0), {"prefill": 1, "decode": 1}, 0.0)
    assert d.needed["decode"] == 2 and "one more" in d.reasons[-2]
    assert policy().decide(obs(0.5, decode_kv_usage=0.95), {"prefill": 1, "decode": 1}, 0.0).target["decode"] == 2


def test_corrections_scale_the_profile_by_what_the_router_measured():
    p = policy(correct=True)
    # the profile says a 2-sequence step takes 80 ms; the router measured 160 ms: x2, smoothed halfway (1.5)
    d = p.decide(obs(1.0, itl_mean_s=0.16, decode_running=2.0), {"prefill": 1, "decode": 1}, 0.0)
    assert d.corrections["decode"] == pytest.approx(1.5)
    # with steps 1.5x as long only 1 sequence fits 100 ms: 24 tok/s over 1/0.09 = 11 a worker: three
    assert d.needed["decode"] == 3
    assert policy(correct=False).decide(obs(1.0, itl_mean_s=0.16, decode_running=2.0), {"prefill": 1, "decode": 1},
                                        0.0).needed["decode"] == 1
    for _ in range(10):  # an absurd ratio is held at the range's end
        d = p.decide(obs(1.0, itl_mean_s=100.0, decode_running=2.0), {"prefill": 1, "decode": 1}, 0.0)
    assert d.corrections["decode"] == 8.0


def test_the_config_refuses_bounds_and_predictors_that_cannot_work():
    for bad in ({"min_decode": 0}, {"min_decode": 3, "max_decode": 2}, {"min_prefill": -1}, {"predictor": "arima"},
                {"interval_s": 0}, {"slo": Slo(0.0, 0.1)}):
        with pytest.raises(ValueError):
            PlannerConfig(**{"slo": Slo(1.0, 0.1), **bad})


class ListScaler:
    def __init__(self, fail: bool = False):
        self.sizes, self.calls, self.fail = {"prefill": 1, "decode": 1}, [], fail

    def replicas(self):
        return dict(self.sizes)

    def scale(self, pool, n):
        self.calls.append((pool, n))
        if self.fail:
            raise RuntimeError("forbidden")
        self.sizes[pool] = n


class MetricsServer:
    """A real /metrics endpoint on 127.0.0.1 whose text the test sets."""

    def __init__(self):
        self.text = router_text(0, 0, 0, 0, [], [])
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = outer.text.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_the_loop_scales_from_scraped_metrics_and_skips_what_it_cannot_read(tmp_path):
    router = MetricsServer()
    try:
        scaler = ListScaler()
        targets = {"router": [router.address], "prefill": [], "decode": ["127.0.0.1:1"]}  # a worker not up yet
        planner = SlaPlanner(policy(), scaler, lambda: targets, tmp_path / "log.jsonl", say=lambda line: None)
        assert planner.tick(0.0) == {"skipped": "first scrape (the baseline)", "time": 0.0}
        assert planner.tick(0.5) is None  # not due
        router.text = router_text(10, 240, 10, 240, [0.1] * 10, [0.01] * 230)
        record = planner.tick(1.0)  # 10 req/s of 24 tokens: 240 tok/s, four decode workers at most
        assert record["target"] == {"prefill": 1, "decode": 4} and scaler.calls == [("decode", 4)]
        assert record["unscraped"] == ["127.0.0.1:1"]
        targets["router"] = ["127.0.0.1:1"]  # the router's metrics gone: no decision on a guess
        assert "skipped" in planner.tick(2.0) and scaler.calls == [("decode", 4)]
        lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
        assert [("skipped" in r) for r in lines] == [True, False, True]
    finally:
        router.close()


def test_a_failed_scale_call_is_logged_and_a_broken_planner_stops_leaving_the_pools(tmp_path):
    router = MetricsServer()
    try:
        scaler = ListScaler(fail=True)
        planner = SlaPlanner(policy(), scaler, lambda: {"router": [router.address]}, say=lambda line: None)
        planner.tick(0.0)
        router.text = router_text(10, 240, 10, 240, [0.1] * 10, [0.01] * 230)
        record = planner.tick(1.0)
        assert record["scale_errors"] == ["decode -> 4: RuntimeError: forbidden"] and planner.stopped is None
        planner.policy.decide = lambda *a: 1 / 0  # a bug in the planner itself
        record = planner.tick(2.0)
        assert planner.stopped == "ZeroDivisionError: division by zero" and "stopped" in record
        assert planner.tick(10.0) is None and scaler.sizes == {"prefill": 1, "decode": 1}
    finally:
        router.close()


def test_a_ramp_is_a_poisson_process_of_its_piecewise_rate():
    ramp = Ramp.parse("10:1,20:4,10:0,10:1")
    assert ramp.num_requests == 100
    offsets = ramp.offsets(seed=1)
    assert len(offsets) == 100 and offsets == sorted(offsets) and offsets == ramp.offsets(seed=1)
    assert offsets[-1] == pytest.approx(50.0)  # the last arrives at the ramp's end
    counts = [sum(ramp.phase_of(t) == i for t in offsets) for i in range(4)]
    assert counts[2] == 0 and counts[1] > 60 and sum(counts) == 100
    for bad in ("10", "10:-1", "0:1", "10:0", "x:1", "10:inf"):
        with pytest.raises(ValueError):
            Ramp.parse(bad)


class ScaleApi(BaseHTTPRequestHandler):
    """The Deployment ``scale`` subresource, as the API server serves it."""
    replicas = {"prefill": 1, "decode": 2}
    patches: list = []

    def _scale(self, name):
        return {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": name, "namespace": "kervan"},
                "spec": {"replicas": self.replicas[name]}, "status": {"replicas": self.replicas[name]}}

    def _reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._reply(self._scale(self.path.split("/")[-2]))

    def do_PATCH(self):
        name = self.path.split("/")[-2]
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ScaleApi.patches.append((self.path, self.headers["Content-Type"], body))
        self.replicas[name] = body["spec"]["replicas"]
        self._reply(self._scale(name))

    def log_message(self, *args):
        pass


def test_the_kubernetes_scaler_reads_and_patches_the_deployments_scale_subresource():
    from kubernetes import client
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScaleApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = client.Configuration()
        cfg.host = f"http://127.0.0.1:{server.server_address[1]}"
        scaler = KubernetesScaler("kervan", {"prefill": "prefill", "decode": "decode"},
                                  api=client.AppsV1Api(client.ApiClient(cfg)))
        assert scaler.replicas() == {"prefill": 1, "decode": 2}
        scaler.scale("decode", 3)
        path, content_type, body = ScaleApi.patches[-1]
        assert path == "/apis/apps/v1/namespaces/kervan/deployments/decode/scale" and body == {"spec": {"replicas": 3}}
        assert content_type.endswith("patch+json")
        assert scaler.replicas() == {"prefill": 1, "decode": 3}
    finally:
        server.shutdown()
        server.server_close()
