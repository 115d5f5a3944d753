"""``kervan bench``: a load generator for a Kervan router, or any OpenAI-compatible
server, in the manner of ``vllm bench serve`` and genai-perf.

- ``workload``: what is sent (prompt and output length distributions, a file of real
  prompts, shared prefixes with Zipf popularity), seeded;
- ``backends``: how one request is sent and timed (Kervan's gRPC ``Generate``, or an
  OpenAI ``/v1/completions`` stream);
- ``load``: when requests are sent (open-loop Poisson at a rate, or a closed loop of
  N in flight), with a progress bar;
- ``report``: throughput, TTFT, ITL, TPOT and end-to-end percentiles, goodput under
  latency targets, errors; a PNG of the latency-throughput curve of a sweep;
- ``command``: the ``kervan bench`` command line.

Nothing here imports torch."""
