"""What the planner reads: the Prometheus text every Kervan service serves, scraped from
the router(s) and the prefill and decode workers, and the difference between two scrapes
(one interval) turned into the load and latencies the planner acts on.

A target is ``host:port``; a host that resolves to several addresses (a Kubernetes
headless Service) is every one of them, so a pool is scraped whole however it scaled."""

from __future__ import annotations

import math
import socket
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kervan.worker_info import WorkerRole

PROMPT_TOKENS = "kervan_request_prompt_tokens"  # a histogram per admitted request: its count is the arrivals
GENERATION_TOKENS = "kervan_request_generation_tokens"  # a histogram per sample that ended
TTFT = "kervan_time_to_first_token_seconds"
ITL = "kervan_inter_token_latency_seconds"
RUNNING = "kervan_num_requests_running"
WAITING = "kervan_num_requests_waiting"
KV_USAGE = "kervan_kv_cache_usage_perc"
POOLS = ("router", WorkerRole.PREFILL, WorkerRole.DECODE)


@dataclass
class Scrape:
    """One pool's metrics, summed over its targets (counters, histogram buckets) or listed
    per target (gauges)."""
    counters: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # histogram -> le -> cumulative count
    gauges: dict[str, list[float]] = field(default_factory=dict)
    num_targets: int = 0
    missing: list[str] = field(default_factory=list)  # targets that did not answer

    def add_text(self, text: str) -> None:
        self.num_targets += 1
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    by_le = self.buckets.setdefault(s.name.removesuffix("_bucket"), {})
                    le = float(s.labels["le"])
                    by_le[le] = by_le.get(le, 0.0) + s.value
                elif family.type == "gauge":
                    self.gauges.setdefault(s.name, []).append(s.value)
                elif family.type in ("counter", "histogram") and not s.name.endswith("_created"):
                    self.counters[s.name] = self.counters.get(s.name, 0.0) + s.value


def resolve(target: str) -> list[str]:
    """``host:port`` -> every ``address:port`` the host resolves to (IPv4), sorted."""
    host, _, port = target.rpartition(":")
    infos = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
    return sorted({f"{info[4][0]}:{port}" for info in infos})


def scrape(targets: list[str], required: bool = True, timeout_s: float = 2.0) -> Scrape:
    """Every target's /metrics, merged. A target that cannot be read raises OSError when
    ``required`` (the router's: the planner skips the interval rather than guess the load),
    else is listed in ``missing`` (a worker still starting: its gauges are left out)."""
    out = Scrape()
    for target in targets:
        try:
            for address in resolve(target):
                with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as resp:
                    out.add_text(resp.read().decode())
        except OSError:
            if required:
                raise
            out.missing.append(target)
    return out


Targets = Callable[[], dict[str, list[str]]]  # pool -> its metrics targets, asked at each scrape


@dataclass(frozen=True)
class Observation:
    """One interval: the load that arrived and how the mesh served it."""
    seconds: float
    rate: float  # requests admitted per second
    input_len: float  # mean prompt tokens of those requests (0: none)
    output_len: float  # mean output tokens of the samples that ended in it, whole (0: none)
    ttft_mean_s: float | None  # None: no first token in the interval
    ttft_p99_s: float | None
    itl_mean_s: float | None
    itl_p99_s: float | None
    decode_running: float  # mean sequences a decode worker runs (at the scrape)
    decode_waiting: float  # summed over the decode pool
    decode_kv_usage: float  # the fullest decode worker's KV cache (1 = full)
    prefill_waiting: float
    num_workers: dict[str, int]  # pool -> targets scraped

    def to_json(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def observe(before: dict[str, Scrape], after: dict[str, Scrape], seconds: float) -> Observation:
    """The interval between two scrapes of every pool."""
    router_a, router_b = before["router"], after["router"]

    def delta(name: str) -> float:  # a counter can go back (a router restarted): count from zero then
        d = router_b.counters.get(name, 0.0) - router_a.counters.get(name, 0.0)
        return d if d >= 0 else router_b.counters.get(name, 0.0)

    admitted, finished = delta(PROMPT_TOKENS + "_count"), delta(GENERATION_TOKENS + "_count")
    decode, prefill = after[WorkerRole.DECODE], after[WorkerRole.PREFILL]
    running = decode.gauges.get(RUNNING, [])
    return Observation(
        seconds=seconds, rate=admitted / seconds if seconds > 0 else 0.0,
        input_len=delta(PROMPT_TOKENS + "_sum") / admitted if admitted else 0.0,
        output_len=delta(GENERATION_TOKENS + "_sum") / finished if finished else 0.0,
        ttft_mean_s=_mean(delta(TTFT + "_sum"), delta(TTFT + "_count")),
        ttft_p99_s=quantile(_bucket_delta(router_a, router_b, TTFT), 0.99),
        itl_mean_s=_mean(delta(ITL + "_sum"), delta(ITL + "_count")),
        itl_p99_s=quantile(_bucket_delta(router_a, router_b, ITL), 0.99),
        decode_running=sum(running) / len(running) if running else 0.0,
        decode_waiting=sum(decode.gauges.get(WAITING, [])),
        decode_kv_usage=max(decode.gauges.get(KV_USAGE, [0.0])),
        prefill_waiting=sum(prefill.gauges.get(WAITING, [])),
        num_workers={pool: after[pool].num_targets for pool in (WorkerRole.PREFILL, WorkerRole.DECODE)})


def _mean(total: float, count: float) -> float | None:
    return total / count if count > 0 else None


def _bucket_delta(a: Scrape, b: Scrape, name: str) -> dict[float, float]:
    before = a.buckets.get(name, {})
    return {le: n - before.get(le, 0.0) for le, n in b.buckets.get(name, {}).items()}


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """``histogram_quantile``'s estimate from cumulative buckets: linear within the bucket
    the rank falls in; the last finite bound when it falls in +Inf; None when empty."""
    points = sorted(buckets.items())
    total = points[-1][1] if points else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le, count in points:
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below) if count > below else le
        lower, below = le, count
    return lower
