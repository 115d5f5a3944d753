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
  chunk sharing a step with the decodes of that worker;
- ``sarathi_<B>``: the same with Sarathi-Serve's settings: a small budget (32-128 tokens,
  the range where a step of the embedded model fits the TPOT targets below on these
  cores), running streams' next tokens before any prompt admitted after them (the
  engine's order), and a per-request prefill cap of B / 2
  (``--long-prefill-token-threshold``), so a new stream's prompt is admitted beside a
  long prompt's chunk instead of after it.

Goodput: requests per second that met their class's latency targets (streams: TTFT
and TPOT; long prompts: TTFT), divided by the two worker cores, at every TPOT target
of ``--tpot-targets-ms`` (a range fixed in this file before any result, so no
target is picked after seeing where the shapes fall). All shapes stay up while the
rounds alternate them; reported are medians over rounds with the spread (min-max),
and the per-round ratio of each shape's goodput to disaggregated's at each target.

    python -m benchmarks.interference --json-out benchmarks/results/interference-avx2.json
    python -m benchmarks.interference --budgets 2048 --sarathi-budgets 64 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from benchmarks.machine import add_dtype_argument, machine, write_report
from benchmarks.stats import spread
from control_plane.bench import workload
from control_plane.bench.backends import KervanBackend
from control_plane.bench.command import one_line
from control_plane.bench.load import run_open_loop
from control_plane.bench.report import meets, summarize
from control_plane.cli.launcher import Cluster, ClusterSpec, new_log_dir
from kervan.engine_args import EngineArgs
from worker.default_model import ensure_default_model
from worker.platform import usable_cores

WORKER_CORES = 2


# TPOT targets (ms) at which goodput is reported: fixed before the results, wide enough that
# every shape passes at the top and fails at the bottom
TPOT_TARGETS_MS = "10,15,20,30,40,60,80,100,150,200,300"


def shapes(budgets: list[int], sarathi_budgets: list[int]) -> dict[str, dict]:
    out = {"disaggregated": dict(num_prefill=1, num_decode=1,
                                 scheduler_args=("--max-prefill-queue-tokens", "0",
                                                 "--min-remote-prefill-blocks", "8"))}
    for b in budgets:
        out[f"aggregated_{b}"] = dict(num_prefill=0, num_decode=0, num_both=2,
                                      worker_args=("--max-num-batched-tokens", str(b)))
    for b in sarathi_budgets:
        out[f"sarathi_{b}"] = dict(num_prefill=0, num_decode=0, num_both=2,
                                   worker_args=("--max-num-batched-tokens", str(b),
                                                "--long-prefill-token-threshold", str(max(1, b // 2))))
    return out


def goodput_per_core(run: dict, tpot_ms: float, args) -> float:
    """Requests on target per second per worker core, with the streams held to ``tpot_ms``."""
    good = sum(1 for r in run["stream_requests"] if r is not None and r[0] <= args.stream_ttft_ms and r[1] <= tpot_ms)
    good += sum(1 for ttft in run["long_ttfts"] if ttft is not None and ttft <= args.long_ttft_ms)
    return round(good / run["wall_s"] / WORKER_CORES, 4)


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
            "good_share": round(good / (len(s_res) + len(l_res)), 4), "wall_s": round(wall, 3),
            # every request's own numbers (ms), so goodput can be read at any target: a failed one (None) meets none
            "stream_requests": [(round(r.ttft * 1000, 2), round((r.tpot or 0.0) * 1000, 2)) if r.error is None
                                else None for r in s_res],
            "long_ttfts": [round(r.ttft * 1000, 2) if r.error is None else None for r in l_res],
            "itls_ms": [x * 1000 for r in s_res if r.error is None for x in r.itls]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--budgets", default="2048", help="aggregated shapes' step token budgets (no prefill cap)")
    ap.add_argument("--sarathi-budgets", default="128,64,32",
                    help="Sarathi-Serve shapes' step token budgets (prefill cap: half the budget)")
    ap.add_argument("--tpot-targets-ms", default=TPOT_TARGETS_MS, help="the TPOT targets goodput is reported at")
    ap.add_argument("--json-out", default=None, help="also write the report here (benchmarks/results/*.json)")
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
    all_shapes = shapes([int(b) for b in args.budgets.split(",") if b],
                        [int(b) for b in args.sarathi_budgets.split(",") if b])
    targets = [float(t) for t in args.tpot_targets_ms.split(",")]
    clusters = {}
    try:
        for name, options in all_shapes.items():
            spec = ClusterSpec(model_dir, threads_per_worker=1, pin_cores=True, engine=EngineArgs(dtype=args.dtype),
                               **options)
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
              "tpot_targets_ms": targets, "shape_settings": all_shapes,
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
            "goodput_per_core_at_tpot": {f"{t:g}": spread([goodput_per_core(x, t, args) for x in rounds])
                                         for t in targets},
            "per_round": [{k: v for k, v in x.items() if k != "itls_ms"} for x in rounds],
        }
    for name, shape in report["shapes"].items():
        if name == "disaggregated":
            continue
        shape["itl_p99_vs_disaggregated"] = spread(
            [a["streams"]["p99_itl_ms"] / d["streams"]["p99_itl_ms"]
             for a, d in zip(runs[name], runs["disaggregated"])])
        # per round, this shape's goodput over disaggregated's in the same round (None: disaggregated had none)
        shape["goodput_vs_disaggregated_at_tpot"] = {
            f"{t:g}": spread([_ratio(goodput_per_core(a, t, args), goodput_per_core(d, t, args))
                              for a, d in zip(runs[name], runs["disaggregated"])]) for t in targets}
    write_report(report, args.json_out, args)


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


if __name__ == "__main__":
    main()
