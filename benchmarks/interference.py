"""Why disaggregation exists: streaming decodes while long prompts keep arriving,
on two aggregated workers and on one prefill plus one decode worker.

Both runs use the same two worker processes' worth of CPU: each worker is pinned
to its own core (one thread each); router, scheduler, registry, Redis and this
client share the machine alike in both. The workload is two closed loops at once:

- streams: 8 concurrent requests of 64-token prompts generating 96 tokens each
  (a bounded list), whose inter-token latency is what users feel;
- long prompts: 4 concurrent requests of 2,048-token prompts generating 8 tokens,
  issued until the streams are done.

Aggregated, a long prompt's prefill shares a step with the streams' decodes on
whichever worker it lands, and their next tokens wait for it. Disaggregated, the
prefill worker takes every prompt (conditional disaggregation's queue overflow is
off: ``--max-prefill-queue-tokens 0``) and the decode worker only imports KV and
decodes. Reported: inter-token latency p50/p99 of the streams, time to first
token of both classes, output throughput.

    python -m benchmarks.interference               # ~2 min: embedded default model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import grpc

from benchmarks import plots
from benchmarks.load import Timed, pct_ms, timed_request
from benchmarks.machine import add_dtype_argument, machine
from control_plane.launcher import Cluster, ClusterSpec, new_log_dir
from services.proto import router_pb2_grpc
from worker.default_model import ensure_default_model
from worker.platform import usable_cores

SHAPES = {"aggregated": dict(num_prefill=0, num_decode=0, num_both=2),
          "disaggregated": dict(num_prefill=1, num_decode=1)}


async def two_loops(address: str, streams: list[list[int]], stream_len: int, stream_conc: int,
                    longs: list[list[int]], long_len: int, long_conc: int) -> tuple[list[Timed], list[Timed], float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        await timed_request(stub, [5] * 8, 2)
        done = asyncio.Event()
        stream_out: list[Timed] = []
        long_out: list[Timed] = []

        async def stream_client(k):
            for prompt in streams[k::stream_conc]:
                stream_out.append(await timed_request(stub, prompt, stream_len))

        async def long_client(k):
            for prompt in longs[k::long_conc]:  # bounded, and stops once the streams are done
                if done.is_set():
                    return
                long_out.append(await timed_request(stub, prompt, long_len))

        t0 = time.perf_counter()
        longs_task = asyncio.gather(*(long_client(k) for k in range(long_conc)))
        await asyncio.gather(*(stream_client(k) for k in range(stream_conc)))
        seconds = time.perf_counter() - t0
        done.set()
        await longs_task
        return stream_out, long_out, seconds


def run_shape(model_dir: Path, shape: str, args, streams, longs) -> tuple[dict, list[float]]:
    spec = ClusterSpec(model_dir, **SHAPES[shape], threads_per_worker=1, pin_cores=True, dtype=args.dtype,
                       scheduler_args=("--max-prefill-queue-tokens", "0", "--min-remote-prefill-blocks", "8"))
    cluster = Cluster(spec, new_log_dir())
    cluster.start()
    try:
        s, long_, seconds = asyncio.run(two_loops(cluster.router_address, streams, args.stream_output,
                                                  args.stream_concurrency, longs, args.long_output,
                                                  args.long_concurrency))
    finally:
        cluster.stop()
    itls = [x for r in s for x in r.itls]
    return {"stream_itl_ms": {"p50": pct_ms(itls, 50), "p99": pct_ms(itls, 99), "max": pct_ms(itls, 100)},
            "stream_ttft_ms": {"p50": pct_ms([r.ttft for r in s], 50), "p99": pct_ms([r.ttft for r in s], 99)},
            "long_prompt_ttft_ms": {"p50": pct_ms([r.ttft for r in long_], 50),
                                    "p99": pct_ms([r.ttft for r in long_], 99)},
            "long_prompts_served": len(long_), "streams_served": len(s),
            "output_tokens_per_s": round((sum(r.tokens for r in s) + sum(r.tokens for r in long_)) / seconds, 1),
            "seconds": round(seconds, 1)}, [x * 1000 for x in itls]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, default=48, help="streaming requests in all")
    ap.add_argument("--stream-concurrency", type=int, default=8)
    ap.add_argument("--stream-prompt", type=int, default=64)
    ap.add_argument("--stream-output", type=int, default=96)
    ap.add_argument("--long-concurrency", type=int, default=4)
    ap.add_argument("--long-prompt", type=int, default=2048)
    ap.add_argument("--long-output", type=int, default=8)
    ap.add_argument("--max-long-prompts", type=int, default=200, help="bound on the long-prompt loop")
    ap.add_argument("--seed", type=int, default=0)
    add_dtype_argument(ap)
    args = ap.parse_args()
    if len(usable_cores()) < 2:
        raise SystemExit("needs two cores: one per worker")
    model_dir = Path(args.model) if args.model else ensure_default_model()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    streams = [[rng.randrange(3, vocab) for _ in range(args.stream_prompt)] for _ in range(args.streams)]
    longs = [[rng.randrange(3, vocab) for _ in range(args.long_prompt)] for _ in range(args.max_long_prompts)]
    report = {"benchmark": "interference", "model": str(model_dir), "machine": machine(args.dtype),
              "workload": {"streams": args.streams, "stream_concurrency": args.stream_concurrency,
                           "stream_prompt": args.stream_prompt, "stream_output": args.stream_output,
                           "long_concurrency": args.long_concurrency, "long_prompt": args.long_prompt,
                           "long_output": args.long_output},
              "pinning": "one core per worker, one thread each"}
    itls = {}
    for shape in SHAPES:
        report[shape], itls[shape] = run_shape(model_dir, shape, args, streams, longs)
    report["stream_itl_p99_aggregated_vs_disaggregated"] = round(
        report["aggregated"]["stream_itl_ms"]["p99"] / report["disaggregated"]["stream_itl_ms"]["p99"], 2)
    plots.latency_cdfs("interference", "Inter-token latency of streams while long prompts arrive", itls)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
