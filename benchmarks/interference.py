"""Why disaggregation exists, and what chunked prefill gets back: streaming decodes
while long prompts keep arriving, on one prefill plus one decode worker, and on two
aggregated workers at a sweep of step token budgets (Sarathi-Serve's argument).

Every shape gets the same two open-loop Poisson arrival streams (``kervan bench``'s
load generator, the same seeded schedule for every shape in a round), so every
shape does the same work whatever its speed:

- streams: short prompts (64 tokens) generating 64 tokens each, whose time per
  output token (TPOT) and inter-token latency (ITL) are what users feel;
- long prompts: 2,048-token prompts generating 8 tokens, whose TTFT is what their
  users feel.

Shapes, each pinned one worker per core with one thread (two worker cores for every
shape; router, scheduler, registry, Redis and the client share the machine alike):

- ``disaggregated``: one prefill and one decode worker; prompts under 8 blocks (the
  streams') prefill on the decode worker, every long prompt on the prefill worker
  (``--max-prefill-queue-tokens 0``: no overflow to the decode worker);
- ``aggregated_<B>``: two aggregated workers whose steps hold at most B tokens
  (``--max-num-batched-tokens B``): a long prompt prefills in chunks of B tokens, each
  chunk sharing a step with the decodes of that worker.

Goodput: requests per second that met their class's latency targets (streams: TTFT
and TPOT; long prompts: TTFT), and that divided by the two worker cores. All shapes
stay up while the rounds alternate them; reported are medians over rounds with the
spread (min-max).

    python -m benchmarks.interference                     # ~12 min: embedded model, 3 rounds
    python -m benchmarks.interference --budgets 2048,256 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from benchmarks import plots
from benchmarks.machine import add_dtype_argument, machine
from benchmarks.stats import spread
from control_plane.bench import workload
from control_plane.bench.backends import KervanBackend
from control_plane.bench.command import one_line
from control_plane.bench.load import run_open_loop
from control_plane.bench.report import meets, summarize
from control_plane.launcher import Cluster, ClusterSpec, new_log_dir
from worker.default_model import ensure_default_model
from worker.platform import usable_cores

WORKER_CORES = 2


def shapes(budgets: list[int]) -> dict[str, dict]:
    out = {"disaggregated": dict(num_prefill=1, num_decode=1,
                                 scheduler_args=("--max-prefill-queue-tokens", "0",
                                                 "--min-remote-prefill-blocks", "8"))}
    for b in budgets:
        out[f"aggregated_{b}"] = dict(num_prefill=0, num_decode=0, num_both=2,
                                      worker_args=("--max-num-batched-tokens", str(b)))
    return out


async def one_round(address: str, streams, longs, args, seed: int) -> dict:
    async with KervanBackend(address) as backend:
        await backend.send(workload.BenchRequest([5] * 8, 2))  # connections, first-call costs
        (s_res, s_wall), (l_res, _) = await asyncio.gather(
            run_open_loop(backend, streams, args.stream_rate, seed, progress=False),
            run_open_loop(backend, longs, args.long_rate, seed + 7919, progress=False))
    stream_slo = {"ttft": args.stream_ttft_ms, "tpot": args.stream_tpot_ms}
    long_slo = {"ttft": args.long_ttft_ms}
    wall = max(r.ended for r in s_res + l_res) - min(r.started for r in s_res + l_res)
    good = sum(meets(r, stream_slo) for r in s_res if r.error is None) + \
        sum(meets(r, long_slo) for r in l_res if r.error is None)
    return {"streams": summarize(s_res, s_wall, (50, 99, 100), stream_slo),
            "long_prompts": summarize(l_res, wall, (50, 99), long_slo),
            "goodput": round(good / wall, 4), "goodput_per_core": round(good / wall / WORKER_CORES, 4),
            "good_share": round(good / (len(s_res) + len(l_res)), 4),
            "itls_ms": [x * 1000 for r in s_res if r.error is None for x in r.itls]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--budgets", default="2048,512,256", help="aggregated shapes' step token budgets")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=60, help="streaming requests per round")
    ap.add_argument("--stream-rate", type=float, default=1.5, help="streams per second (Poisson)")
    ap.add_argument("--stream-prompt", type=int, default=64)
    ap.add_argument("--stream-output", type=int, default=64)
    ap.add_argument("--long-rate", type=float, default=0.2, help="long prompts per second (Poisson)")
    ap.add_argument("--long-prompt", type=int, default=2048)
    ap.add_argument("--long-output", type=int, default=8)
    ap.add_argument("--stream-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--stream-tpot-ms", type=float, default=60.0)
    ap.add_argument("--long-ttft-ms", type=float, default=5000.0)
    ap.add_argument("--seed", type=int, default=0)
    add_dtype_argument(ap)
    args = ap.parse_args()
    if len(usable_cores()) < WORKER_CORES:
        raise SystemExit("needs two cores: one per worker")
    model_dir = Path(args.model) if args.model else ensure_default_model()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    # as many long prompts as arrive while the streams do
    num_longs = max(1, round(args.streams / args.stream_rate * args.long_rate))
    all_shapes = shapes([int(b) for b in args.budgets.split(",")])
    clusters = {}
    try:
        for name, options in all_shapes.items():
            spec = ClusterSpec(model_dir, threads_per_worker=1, pin_cores=True, dtype=args.dtype, **options)
            clusters[name] = Cluster(spec, new_log_dir())
            clusters[name].start()
        runs: dict[str, list[dict]] = {name: [] for name in all_shapes}
        for r in range(args.rounds):
            seed = args.seed * 1000 + r
            streams = workload.build(args.streams, workload.Lengths("fixed", args.stream_prompt),
                                     workload.Lengths("fixed", args.stream_output), seed, (3, vocab))
            longs = workload.build(num_longs, workload.Lengths("fixed", args.long_prompt),
                                   workload.Lengths("fixed", args.long_output), seed + 500, (3, vocab))
            order = list(all_shapes) if r % 2 == 0 else list(reversed(all_shapes))
            for name in order:
                run = asyncio.run(one_round(clusters[name].router_address, streams, longs, args, seed))
                runs[name].append(run)
                print(f"round {r} {name}: streams {one_line('', run['streams'])}; long prompts "
                      f"{one_line('', run['long_prompts'])}", file=sys.stderr, flush=True)
    finally:
        for cluster in clusters.values():
            cluster.stop()

    report = {"benchmark": "interference", "model": str(model_dir), "machine": machine(args.dtype),
              "rounds": args.rounds, "pinning": "one core per worker, one thread each, two worker cores per shape",
              "workload": {"streams": args.streams, "stream_rate": args.stream_rate,
                           "stream_prompt": args.stream_prompt, "stream_output": args.stream_output,
                           "long_prompts": num_longs, "long_rate": args.long_rate, "long_prompt": args.long_prompt,
                           "long_output": args.long_output},
              "slo_ms": {"stream_ttft": args.stream_ttft_ms, "stream_tpot": args.stream_tpot_ms,
                         "long_ttft": args.long_ttft_ms},
              "shapes": {}}
    for name, rounds in runs.items():
        report["shapes"][name] = {
            "stream_itl_p99_ms": spread([x["streams"]["p99_itl_ms"] for x in rounds]),
            "stream_itl_p50_ms": spread([x["streams"]["p50_itl_ms"] for x in rounds]),
            "stream_tpot_p99_ms": spread([x["streams"]["p99_tpot_ms"] for x in rounds]),
            "stream_ttft_p50_ms": spread([x["streams"]["p50_ttft_ms"] for x in rounds]),
            "long_ttft_p50_ms": spread([x["long_prompts"]["p50_ttft_ms"] for x in rounds]),
            "long_ttft_p99_ms": spread([x["long_prompts"]["p99_ttft_ms"] for x in rounds]),
            "goodput_per_core": spread([x["goodput_per_core"] for x in rounds]),
            "good_share": spread([x["good_share"] for x in rounds]),
            "failed": sum(x["streams"]["failed"] + x["long_prompts"]["failed"] for x in rounds),
        }
    base = report["shapes"]["disaggregated"]
    for name, shape in report["shapes"].items():
        if name != "disaggregated":
            shape["itl_p99_vs_disaggregated"] = spread(
                [a["streams"]["p99_itl_ms"] / d["streams"]["p99_itl_ms"]
                 for a, d in zip(runs[name], runs["disaggregated"])])
    best_aggregated = max((s["goodput_per_core"]["median"] or 0.0 for n, s in report["shapes"].items()
                           if n != "disaggregated"), default=0.0)
    report["best_aggregated_goodput_vs_disaggregated"] = round(
        best_aggregated / base["goodput_per_core"]["median"], 3) if base["goodput_per_core"]["median"] else None
    plots.latency_cdfs("interference", "Inter-token latency of streams while long prompts arrive (all rounds)",
                       {name: [x for r in rounds for x in r["itls_ms"]] for name, rounds in runs.items()})
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
