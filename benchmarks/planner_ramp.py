"""The SLA planner against fixed pools under a load ramp, through ``kervan bench``'s ramp.

One ramp (low, high, low, in requests per second: ``--rates``) is sent, round after round,
to three clusters of the same model, pinned as ``kervan up --pin-cores`` pins them (on two
cores: the prefill worker and a second decode worker share one). The workload is decode-heavy
(short prompts, 128 tokens out), so that a second decode worker adds capacity on a machine
whose two cores the smallest cluster already uses: the prefill worker leaves most of its core
idle. The default rates are for SmolLM2-135M on a 2-core Xeon, where ``kervan plan`` (from a
``kervan profile`` on one core) gives one decode worker about 76 tokens/s of this workload
within the 100 ms ITL target (0.59 requests/s): the low phase (0.25/s, 32 tokens/s) needs one
and the high phase (1.0/s, 128 tokens/s) two. The plan's rate is reported beside them.

- ``smallest``: 1 prefill + 1 decode worker, fixed;
- ``largest``: ``--max-prefill`` prefill + ``--max-decode`` decode workers, fixed;
- ``planner``: starts at 1 + 1; the SLA planner (the profile, corrections on, the constant
  predictor) grows and drains each pool between 1 and its maximum.

Measured per round: SLO attainment (the share of requests whose TTFT and TPOT both met the
targets: ``kervan bench``'s goodput share), per phase too; requests failed; worker-seconds
(prefill and decode workers alive, integrated over the ramp, a drained worker counted until
it exited); and the planner's decisions. The three configurations run in turn within each
round, their order rotated each round.

    python -m benchmarks.planner_ramp --json-out benchmarks/results/planner_ramp-amx-smollm2.json   # ~35 min
    python -m benchmarks.planner_ramp --model embedded --rounds 1 --phases 10,20,10 --rates 2,10,2    # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

from benchmarks.machine import add_dtype_argument, machine, write_report
from benchmarks.plan_check import model_dir, one_to_one_rate, profile_on_one_core
from control_plane.bench import workload
from control_plane.bench.backends import KervanBackend
from control_plane.bench.command import sweep
from control_plane.bench.load import Ramp
from control_plane.cli.launcher import Cluster, ClusterSpec, new_log_dir
from control_plane.plan.hardware import measure_this
from control_plane.plan.model_dir import model_shape
from control_plane.plan.served import ALL_PROMPTS_REMOTE
from control_plane.plan.sizing import Sizer, Slo
from control_plane.planner.policy import PlannerConfig, Policy
from control_plane.planner.scaler import LauncherScaler
from control_plane.planner.sla_planner import PlannerThread, SlaPlanner
from kervan.engine_args import EngineArgs

CONFIGS = ("smallest", "largest", "planner")


def worker_seconds(sizes: list[tuple[float, dict[str, int]]], start: float, end: float) -> float:
    """The integral of the pools' sizes over [start, end] (sizes sampled as a step function)."""
    total = 0.0
    for (t0, s0), (t1, _) in zip(sizes, sizes[1:] + [(end, {})]):
        lo, hi = max(t0, start), min(t1, end)
        if hi > lo:
            total += (hi - lo) * sum(s0.values())
    return total


def run_config(name: str, path, policy_for, ramp: Ramp, args, seed: int) -> dict:
    largest = name == "largest"
    spec = ClusterSpec(path, num_prefill=args.max_prefill if largest else 1,
                       num_decode=args.max_decode if largest else 1, engine=EngineArgs(dtype=args.dtype),
                       pin_cores=True, metrics=True,
                       scheduler_args=ALL_PROMPTS_REMOTE, worker_args=("--drain-grace", "20"))
    cluster = Cluster(spec, new_log_dir())
    cluster.start()
    scaler = LauncherScaler(cluster, drain_grace_s=30)
    planner = SlaPlanner(policy_for(), scaler, scaler.metrics_targets, cluster.log_dir / "planner.jsonl",
                         say=lambda line: print(line, file=sys.stderr, flush=True)) if name == "planner" else None

    def alive() -> dict[str, int]:  # drained workers still running count: they hold their cores
        sizes = scaler.replicas()
        for drained in cluster.draining:
            sizes[drained.rsplit("-", 1)[0]] += 1
        return sizes

    sizes: list[tuple[float, dict[str, int]]] = []
    thread = PlannerThread(planner, cluster.reap_drained) if planner else None
    try:
        shape = dict(input_len=workload.Lengths.parse(args.input_len),
                     output_len=workload.Lengths.parse(args.output_len), token_range=(3, args.vocab))

        def requests_for(i: int):
            return workload.build(ramp.num_requests if i >= 0 else 2, seed=seed * 1000 + i + 1, **shape)
        slo = {"ttft": args.ttft_ms, "tpot": args.itl_ms}
        sampler_stop = [False]

        async def sample() -> None:
            while not sampler_stop[0]:
                if thread is None:
                    cluster.reap_drained()
                sizes.append((time.monotonic(), alive()))
                await asyncio.sleep(0.2)

        async def load() -> list[dict]:
            sampler = asyncio.create_task(sample())
            try:
                return await sweep(KervanBackend(cluster.router_address), requests_for, [("ramp", ramp)], seed=seed,
                                   slo=slo, warmup=2, progress=False)
            finally:
                sampler_stop[0] = True
                await sampler

        if thread is not None:
            thread.start()
        start = time.monotonic()
        [run] = asyncio.run(load())
        end = time.monotonic()
    finally:
        if thread is not None:
            thread.stop()
        cluster.stop()
    summary = run["summary"]
    out = {"config": name, "slo_attainment": summary["goodput_share"], "failed": summary["failed"],
           "errors": summary["errors"], "completed": summary["completed"],
           "worker_seconds": round(worker_seconds(sizes, start, end), 1), "seconds": round(end - start, 1),
           "peak_workers": max(sum(s.values()) for _, s in sizes) if sizes else None,
           "phases": [{"request_rate": p["request_rate"], "slo_attainment": p["summary"]["goodput_share"],
                       "mean_ttft_ms": p["summary"]["mean_ttft_ms"], "mean_tpot_ms": p["summary"]["mean_tpot_ms"],
                       "completed": p["summary"]["completed"]} for p in run["phases"]],
           "bench": run}
    if planner is not None:
        out["planner"] = [{k: r[k] for k in ("time", "current", "target", "needed", "predicted", "corrections")
                           if k in r} | ({"observed_rate": r["observed"]["rate"]} if "observed" in r else {})
                          for r in planner.records]
        out["decode_pool"] = [[round(t - start, 1), s["decode"]] for t, s in sizes[::5]]
    print(json.dumps({k: v for k, v in out.items() if k not in ("bench", "planner", "decode_pool")}), file=sys.stderr,
          flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="embedded, moe, or a pulled catalog name")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--phases", default="40,60,40", help="seconds of the low, high and low phases")
    ap.add_argument("--rates", default="0.25,1.0,0.25", help="each phase's requests per second")
    ap.add_argument("--max-prefill", type=int, default=1)
    ap.add_argument("--max-decode", type=int, default=2)
    ap.add_argument("--input-len", default="uniform:32:96")
    ap.add_argument("--output-len", default="fixed:128")
    ap.add_argument("--ttft-ms", type=float, default=2000.0)
    ap.add_argument("--itl-ms", type=float, default=100.0)
    ap.add_argument("--interval", type=float, default=5.0, help="the planner's interval")
    ap.add_argument("--cooldown", type=float, default=15.0, help="the planner's scale-down cool-down")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--json-out", default=None)
    add_dtype_argument(ap)
    args = ap.parse_args()

    path = model_dir(args.model)
    shape, held, _ = model_shape(str(path))
    args.vocab = shape.vocab_size
    profile = profile_on_one_core(path, args.dtype, core=max(os.sched_getaffinity(0)))
    hw = measure_this(per_core=True)
    weights = held if held.startswith("gguf") else profile.dtype
    capacity = one_to_one_rate(shape, weights, profile.dtype, hw, profile, args)
    phases = tuple((float(s), float(r)) for s, r in zip(args.phases.split(","), args.rates.split(",")))
    ramp = Ramp(phases)
    config = PlannerConfig(Slo(args.ttft_ms / 1e3, args.itl_ms / 1e3), min_prefill=1, max_prefill=args.max_prefill,
                           min_decode=1,
                           max_decode=args.max_decode, interval_s=args.interval, scale_up_cooldown_s=args.interval,
                           scale_down_cooldown_s=args.cooldown)

    def policy_for() -> Policy:
        return Policy(Sizer(shape, weights, profile.dtype, hw, chunk=args.chunk, profile=profile), config)

    print(f"1P+1D serves {capacity:.3f} req/s by the plan; ramp {phases}", file=sys.stderr, flush=True)
    rounds = []
    for r in range(args.rounds):
        order = CONFIGS[r % 3:] + CONFIGS[:r % 3]
        rounds.append({name: run_config(name, path, policy_for, ramp, args, seed=r) for name in order})
    summary = {}
    for name in CONFIGS:
        att = [rd[name]["slo_attainment"] for rd in rounds]
        ws = [rd[name]["worker_seconds"] for rd in rounds]
        summary[name] = {"slo_attainment": [statistics.median(att), min(att), max(att)],
                         "worker_seconds": [statistics.median(ws), min(ws), max(ws)],
                         "failed": sum(rd[name]["failed"] for rd in rounds)}
    report = {"benchmark": "planner_ramp", "machine": machine(args.dtype), "model": str(path),
              "one_to_one_rate_by_plan": capacity, "ramp": [list(p) for p in phases],
              "workload": {"input_len": args.input_len, "output_len": args.output_len},
              "slo_ms": {"ttft": args.ttft_ms, "tpot": args.itl_ms},
              "planner": {"interval_s": args.interval, "scale_down_cooldown_s": args.cooldown,
                          "max_prefill": args.max_prefill, "max_decode": args.max_decode,
                          "predictor": config.predictor, "corrections": config.correct},
              "profile": json.loads(profile.to_json()), "summary": summary, "rounds": rounds}
    write_report(report, args.json_out, args)


if __name__ == "__main__":
    main()
