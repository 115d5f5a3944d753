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
KV_TRANSFER_BYTES = Counter("kervan_kv_transfer_bytes", "Bytes of KV handed between workers: pushed or received "
                            "(a hand-off), fetched or served (the cluster KV tier)", ["direction"])
KV_PUSHES = Counter("kervan_kv_pushes", "KV pushes to decode workers, by path: shared_memory (same host) or stream "
                    "(the gRPC stream, any host)", ["path"])
KV_FETCHES = Counter("kervan_kv_fetches", "Cluster KV tier: prefixes this worker fetched from another (fetched, "
                     "empty: the holder had none, failed: computed instead) and sent to another (served)", ["outcome"])
KV_SHM_FALLBACKS = Counter("kervan_kv_shm_fallbacks", "KV pushes that went by the gRPC stream because shared "
                           "memory had no room for them")
ENGINE_STEP_TIME = Histogram("kervan_engine_step_seconds", "Wall time of one engine step (schedule, run the "
                             "model, sample), without the serving loop around it", buckets=LATENCY_BUCKETS)
KV_PUSH_RETRIES = Counter("kervan_kv_push_retries", "KV pushes sent again because the decode worker had its "
                          "limit of pushes in progress (RESOURCE_EXHAUSTED)")
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
        yield CounterMetricFamily("kervan_prompt_tokens_computed", "Prompt tokens the model computed (not those "
                                  "cached, copied back from a tier, handed off or fetched)",
                                  value=stats.num_prompt_tokens_computed)
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
        yield from _spec_decode_metrics(stats)


class KernelChoiceCollector(Collector):
    """Which kernel each quantized weight shape's decode-step matmuls take on this CPU, and
    why (``worker/quant/kernel_choice.py``): an info gauge, 1 per shape."""

    def __init__(self, choices):
        self.choices = choices

    def collect(self):
        family = GaugeMetricFamily("kervan_quant_kernel_info", "The kernel of a quantized weight shape's few-row "
                                   "matmuls (float or int8 activations) and why it was chosen",
                                   labels=["shape", "method", "kernel", "reason"])
        for c in self.choices:
            family.add_metric([f"{c.out_features}x{c.in_features}", c.method, c.kernel, c.reason], 1)
        yield family


def _spec_decode_metrics(stats):
    """Speculative decoding, under vLLM's names (``spec_decode_*``), and the two ratios its
    logger prints, since the start."""
    yield CounterMetricFamily("kervan_spec_decode_num_drafts", "Steps a sequence ran speculative guesses in",
                              value=stats.spec_num_drafts)
    yield CounterMetricFamily("kervan_spec_decode_num_draft_tokens", "Speculative guesses verified",
                              value=stats.spec_num_draft_tokens)
    yield CounterMetricFamily("kervan_spec_decode_num_accepted_tokens", "Speculative guesses the target kept",
                              value=stats.spec_num_accepted_tokens)
    per_position = CounterMetricFamily("kervan_spec_decode_num_accepted_tokens_per_pos", "Speculative guesses "
                                       "kept at each position of a draft", labels=["position"])
    for position, count in enumerate(stats.spec_accepted_per_position):
        per_position.add_metric([str(position)], count)
    yield per_position
    drafts, guesses = stats.spec_num_drafts, stats.spec_num_draft_tokens
    yield GaugeMetricFamily("kervan_spec_decode_draft_acceptance_rate", "Guesses kept over guesses verified, since "
                            "the start", value=stats.spec_num_accepted_tokens / guesses if guesses else 0.0)
    yield GaugeMetricFamily("kervan_spec_decode_mean_acceptance_length", "Tokens a draft's step emitted on average "
                            "(guesses kept, plus the target's own), since the start",
                            value=1 + stats.spec_num_accepted_tokens / drafts if drafts else 0.0)


def count_admission(prompt_tokens: int, cached_tokens: int, queue_time_s: float | None) -> None:
    """A request's first output: its prefix-cache lookup and how long it queued."""
    PREFIX_CACHE_QUERIES.inc(prompt_tokens)
    PREFIX_CACHE_HITS.inc(cached_tokens)
    if queue_time_s is not None:
        QUEUE_TIME.observe(queue_time_s)
