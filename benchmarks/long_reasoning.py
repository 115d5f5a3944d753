"""Long reasoning through the mesh: generations far longer than their prompts, more of them
at once than the worker's KV pool holds, with the host tier behind the pool (a preempted
sequence swaps out and back) against without it (its KV is recomputed), in the same run.

``kervan up``'s cluster (one aggregated worker, ``--pool-streams`` average streams' worth of
KV blocks), driven by ``kervan bench``'s own closed loop at ``--streams`` concurrent requests
(a comma list: 2x and 4x what the pool holds by default) of ``--input-len`` prompt and
``--output-len`` output tokens (``kervan bench`` length specs). The two settings alternate per
round. Reported: completed output tokens/s, TPOT and ITL p99, and the worker's preemptions and
blocks copied back (its Prometheus metrics).

    python -m benchmarks.long_reasoning --json-out benchmarks/results/long_reasoning-avx512.json
"""

from __future__ import annotations

import argparse
import asyncio
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.machine import add_dtype_argument, machine, write_report
from benchmarks.stats import spread
from control_plane.bench import workload
from control_plane.bench.backends import KervanBackend
from control_plane.bench.command import one_line, sweep
from control_plane.cli.launcher import Cluster, ClusterSpec, new_log_dir
from control_plane.tools.pull import resolve_model
from kervan.engine_args import EngineArgs
from worker.default_model import ensure_default_model


def worker_counters(cluster: Cluster) -> dict[str, float]:
    [address] = [a for name, a in cluster.addresses.items() if name.startswith("both") and name.endswith("-metrics")]
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    wanted = {"kervan_num_preemptions": "preemptions", "kervan_kv_host_promoted_blocks": "host_promoted_blocks"}
    return {wanted[m.name]: m.samples[0].value for m in text_string_to_metric_families(text) if m.name in wanted}


def one_run(model_dir: Path, args, streams: int, tier_on: bool, seed: int) -> dict:
    mean_len = args.input_len_mean + args.output_len_mean
    spec = ClusterSpec(model_dir, num_prefill=0, num_decode=0, num_both=1,
                       engine=EngineArgs(dtype=args.dtype, num_kv_blocks=int(args.pool_streams * mean_len // 16),
                                         kv_host_bytes=args.host_bytes if tier_on else 0), metrics=True)
    shape = dict(input_len=workload.Lengths.parse(args.input_len), output_len=workload.Lengths.parse(args.output_len),
                 token_range=(3, 600))
    cluster = Cluster(spec, new_log_dir())
    cluster.start()
    try:
        [run] = asyncio.run(sweep(KervanBackend(cluster.router_address),
                                  lambda i: workload.build(streams * args.requests_per_stream, seed=seed * 1000 + i + 1,
                                                           **shape),
                                  [("concurrency", streams)], seed=seed, percentiles=(50, 99), progress=False))
        counters = worker_counters(cluster)
    finally:
        cluster.stop()
    s = run["summary"]
    print(one_line(f"{streams} streams, tier {'on' if tier_on else 'off'}", s), flush=True)
    return {"output_tokens_per_s": s["output_throughput"], "completed": s["completed"], "failed": s["failed"],
            "tpot_p99_ms": s["p99_tpot_ms"], "itl_p99_ms": s["p99_itl_ms"], **counters}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a catalog name or model directory (default: the embedded model, "
                                                  "4,096 tokens of context)")
    add_dtype_argument(ap)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--input-len", default="uniform:1024:1536", help="prompt tokens (a kervan bench length spec)")
    ap.add_argument("--output-len", default="uniform:2048:2560", help="output tokens (a kervan bench length spec)")
    ap.add_argument("--pool-streams", type=float, default=2.0, help="average streams the worker's KV pool holds")
    ap.add_argument("--streams", default="4,8", help="concurrent requests, a comma list")
    ap.add_argument("--requests-per-stream", type=int, default=1)
    ap.add_argument("--host-bytes", type=int, default=1 << 30, help="the host tier when on")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    for name in ("input_len", "output_len"):
        lengths = workload.Lengths.parse(getattr(args, name))
        setattr(args, f"{name}_mean", (lengths.a + lengths.b) / 2 if lengths.kind == "uniform" else lengths.a)
    model_dir = resolve_model(args.model) if args.model else ensure_default_model()
    counts = [int(n) for n in args.streams.split(",")]
    results = {n: {"off": [], "on": []} for n in counts}
    for r in range(args.rounds):
        for n in counts:
            for tier in (("off", "on") if r % 2 == 0 else ("on", "off")):
                results[n][tier].append(one_run(model_dir, args, n, tier == "on", seed=r))
    summary = {}
    for n, by_tier in results.items():
        summary[f"streams-{n}"] = {t: {k: spread([o[k] for o in outs]) for k in outs[0]} for t, outs in by_tier.items()}
        summary[f"streams-{n}"]["throughput_on_over_off"] = spread(
            [on["output_tokens_per_s"] / off["output_tokens_per_s"] for off, on in zip(by_tier["off"], by_tier["on"])])
    report = {"benchmark": "long_reasoning", "model": args.model or "embedded", "machine": machine(args.dtype),
              "arguments": vars(args), "summary": summary, "rounds": {str(n): r for n, r in results.items()}}
    write_report(report, args.json_out)


if __name__ == "__main__":
    main()
