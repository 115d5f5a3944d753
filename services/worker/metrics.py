"""A worker's Prometheus metrics: its engine's load, read when scraped (``EngineCollector``),
prefix-cache queries and hits, and the KV it moves."""

from __future__ import annotations

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.metrics import LATENCY_BUCKETS

PREFIX_CACHE_QUERIES = Counter("kervan_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
PREFIX_CACHE_HITS = Counter("kervan_prefix_cache_hits", "Prompt tokens found in the prefix cache")
QUEUE_TIME = Histogram("kervan_request_queue_time_seconds", "From a request's arrival at the engine to its first "
                       "step", buckets=LATENCY_BUCKETS)
KV_TRANSFER_BYTES = Counter("kervan_kv_transfer_bytes", "Bytes of KV handed between workers, pushed or received",
                            ["direction"])
KV_SHM_FALLBACKS = Counter("kervan_kv_shm_fallbacks", "KV pushes that went by the gRPC stream because shared "
                           "memory had no room for them")
KV_TRANSFER_TIME = Histogram("kervan_kv_transfer_seconds", "Time to push one request's KV to a decode worker",
                             buckets=LATENCY_BUCKETS)


class EngineCollector(Collector):
    """The engine's load, as of its last step, at each scrape (no work per step)."""

    def __init__(self, async_engine):
        self.engine = async_engine

    def collect(self):
        stats = self.engine.stats()
        load = self.engine.load()
        yield GaugeMetricFamily("kervan_num_requests_running", "Sequences the engine is running",
                                value=load.num_running)
        yield GaugeMetricFamily("kervan_num_requests_waiting", "Sequences waiting for the engine",
                                value=load.num_waiting)
        yield GaugeMetricFamily("kervan_prefill_queue_tokens", "Prompt tokens admitted and not yet prefilled",
                                value=load.num_prefill_tokens)
        used = 1.0 - load.num_free_blocks / load.num_blocks if load.num_blocks else 0.0
        yield GaugeMetricFamily("kervan_kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", value=used)
        yield CounterMetricFamily("kervan_num_preemptions", "Sequences preempted (their KV dropped)",
                                  value=stats.num_preemptions)
        yield CounterMetricFamily("kervan_requests_aborted", "Requests the worker aborted", value=load.num_aborted)
        yield GaugeMetricFamily("kervan_kv_host_blocks", "KV blocks held in the host tier behind the pool",
                                value=stats.num_host_blocks)
        yield CounterMetricFamily("kervan_kv_host_demoted_blocks", "KV blocks copied into the host tier as the "
                                  "pool reused them", value=stats.num_host_demoted)
        yield CounterMetricFamily("kervan_kv_host_promoted_blocks", "KV blocks copied back from the host tier "
                                  "instead of computed", value=stats.num_host_promoted)
        yield GaugeMetricFamily("kervan_kv_disk_blocks", "KV blocks held in the disk tier behind the host tier",
                                value=stats.num_disk_blocks)
        yield CounterMetricFamily("kervan_kv_disk_stored_blocks", "KV blocks written to the disk tier",
                                  value=stats.num_disk_stored)
        yield CounterMetricFamily("kervan_kv_disk_loaded_blocks", "KV blocks read back from the disk tier "
                                  "instead of computed", value=stats.num_disk_loaded)
        yield CounterMetricFamily("kervan_kv_disk_corrupt_blocks", "KV blocks on disk refused by their checksum",
                                  value=stats.num_disk_corrupt)
        yield CounterMetricFamily("kervan_kv_disk_write_dropped_blocks", "KV blocks not written to disk because "
                                  "its writes lagged (the bound that keeps a slow disk from stalling steps)",
                                  value=stats.num_disk_write_dropped)


def count_admission(prompt_tokens: int, cached_tokens: int, queue_time_s: float | None) -> None:
    """A request's first output: its prefix-cache lookup and how long it queued."""
    PREFIX_CACHE_QUERIES.inc(prompt_tokens)
    PREFIX_CACHE_HITS.inc(cached_tokens)
    if queue_time_s is not None:
        QUEUE_TIME.observe(queue_time_s)
