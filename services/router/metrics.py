"""The router's Prometheus metrics: what clients experience (vLLM's names, ``kervan_``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.common.metrics import LATENCY_BUCKETS

TIME_TO_FIRST_TOKEN = Histogram("kervan_time_to_first_token_seconds",
                                "From the request's arrival at the router to a sample's first token",
                                buckets=LATENCY_BUCKETS)
INTER_TOKEN_LATENCY = Histogram("kervan_inter_token_latency_seconds",
                                "Between a sample's consecutive output tokens", buckets=LATENCY_BUCKETS)
TIME_PER_OUTPUT_TOKEN = Histogram("kervan_time_per_output_token_seconds",
                                  "A finished sample's mean time per output token after the first",
                                  buckets=LATENCY_BUCKETS)
E2E_LATENCY = Histogram("kervan_e2e_request_latency_seconds", "From the request's arrival to a sample's end",
                        buckets=LATENCY_BUCKETS)
# 1, 2, 5, 10, ... 100,000 tokens (vLLM's 1-2-5 series)
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5))[:-2]
REQUEST_PROMPT_TOKENS = Histogram("kervan_request_prompt_tokens", "Prompt tokens of each request the router admitted "
                                  "(its count: the arrivals)", buckets=TOKEN_BUCKETS)
REQUEST_GENERATION_TOKENS = Histogram("kervan_request_generation_tokens", "Output tokens of each sample that ended",
                                      buckets=TOKEN_BUCKETS)
PROMPT_TOKENS = Counter("kervan_prompt_tokens", "Prompt tokens of requests the router admitted")
GENERATION_TOKENS = Counter("kervan_generation_tokens", "Output tokens the router streamed")
REQUEST_SUCCESS = Counter("kervan_request_success", "Samples that ended, by finish reason", ["finished_reason"])
MIGRATIONS = Counter("kervan_migrations", "Requests moved to another worker after theirs was lost mid-stream")
IN_FLIGHT = Gauge("kervan_num_requests_in_flight", "Requests the router is running now")
