"""``kervan plan`` against measurement: what the plan predicts for a load, and what the
cluster it recommends does under that load through ``kervan bench``'s open loop.

Per model, on this machine with each core a device (``--hardware this-core``: a worker
pinned to one core with one thread, as the cluster pins them):

1. ``kervan profile --served`` (``--profile served``, the default): ITL per batch and TTFT
   per prompt length through a cluster of one prefill and one decode worker, on the cores
   the serving stack shares (``control_plane/plan/served.py``); or (``--profile engine``)
   ``kervan profile`` in a process pinned to one core with one thread, the engine alone. The
   plan reads these step times instead of the roofline;
2. the highest request rate at which the plan recommends one prefill and one decode worker
   (the most this 2-core machine can run), found by bisection; then the plan at
   ``--loads`` fractions of it (0.2, 0.5 and 0.8 by default);
3. at each of those rates, ``--rounds`` times (3), a fresh cluster of one prefill and one
   decode worker (every prompt prefilled on the prefill worker, as the plan assumes), as many
   requests as arrive in ``--seconds`` at that rate (30 to ``--requests``), Poisson, each round
   its own seed, after ``--warmup-s`` (10 s) of the same load not measured (as ``vllm bench
   serve``'s warm-up requests); measured (the rounds' median, with their range): output throughput,
   mean TTFT (the plan's queue is M/G/1's mean wait), median ITL (a decode step), and the
   decode worker's mean engine step from its ``kervan_engine_step_seconds`` (the part of ITL
   the profile measures: the rest is the serving loop around the engine);
4. per point, measured over predicted;
5. the capacity knee (unless ``--no-knee``): the rate at which the plan's mean TTFT on one
   prefill worker reaches ``--ttft-ms``, and the rate at which the cluster's does, from one
   fresh cluster at each of ``plan_score.KNEE_STEPS`` times the predicted knee (stopping at the
   first probe over the target), linear between the two probes around the crossing.

Scoring (``benchmarks/plan_score.py``, fixed before a run): TTFT, ITL and the knee, within 20%;
a point whose rounds spread wider than that is undecided; throughput, which the load fixes,
is reported and not scored.

    python -m benchmarks.plan_check --json-out benchmarks/results/plan_check-amx.json   # ~35 min
    python -m benchmarks.plan_check --models embedded --loads 0.5 --requests 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.machine import add_dtype_argument, machine, write_report
from benchmarks.models import ensure_random_model
from benchmarks.plan_score import KNEE_STEPS, SCORED, TOLERANCE, knee_from, point_verdicts, score
from benchmarks.stats import spread
from control_plane.bench import workload
from control_plane.bench.backends import KervanBackend
from control_plane.bench.load import run_open_loop
from control_plane.bench.report import summarize
from control_plane.cli.launcher import Cluster, ClusterSpec, new_log_dir
from control_plane.plan.choice import Plan, plan
from control_plane.plan.hardware import measure_this
from control_plane.plan.model_dir import model_shape
from control_plane.plan.pools import prefill_ttft_s
from control_plane.plan.profile import Profile
from control_plane.plan.served import ALL_PROMPTS_REMOTE, measure_served
from control_plane.plan.sizing import Layout, Load, Sizer, Slo
from control_plane.tools.pull import resolve_model
from kervan.engine_args import EngineArgs
from worker.default_model import ensure_default_model


def model_dir(name: str) -> Path:
    if name == "embedded":
        return ensure_default_model()
    if name == "moe":
        return ensure_random_model(32000, "moe")
    return resolve_model(name)


def profile_on_one_core(path: Path, dtype: str, core: int) -> Profile:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        subprocess.run(["taskset", "-c", str(core), sys.executable, "-m", "control_plane.cli", "profile", "--model",
                        str(path), "--dtype", dtype, "--batches", "1,4,16,32", "--contexts", "128,512",
                        "--prefill-tokens", "64,256,1024", "--out", str(out)],
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, capture_output=True, timeout=900)
        return Profile.load(out)


def profile_served(path: Path, dtype: str) -> Profile:
    return measure_served(path, dtype, say=lambda line: print(line, file=sys.stderr, flush=True))


def load_at(rate: float, args) -> Load:
    ins, outs = workload.Lengths.parse(args.input_len), workload.Lengths.parse(args.output_len)
    return Load(rate, ins.mean, outs.mean, ins.upper, outs.upper, ins.cv2)


def planned(shape, weights, dtype, hw, profile, rate, args) -> Plan:
    return plan(shape, weights, dtype, hw, load_at(rate, args), Slo(args.ttft_ms / 1e3, args.itl_ms / 1e3),
                chunk=args.chunk, profile=profile)


def predicted_knee(shape, weights, dtype, hw, profile, args) -> float:
    """The rate (to 2%) at which the plan's mean TTFT on one prefill worker reaches the target."""
    sizer = Sizer(shape, weights, dtype, hw, args.chunk, profile)
    lo, hi = 0.01, 1000.0
    while hi / lo > 1.02:
        mid = (lo * hi) ** 0.5
        beside = planned(shape, weights, dtype, hw, profile, mid, args).decode["operating_batch"]
        ttft = prefill_ttft_s(sizer, Layout(1, 1), load_at(mid, args), 1, beside)["ttft_s"]
        lo, hi = (mid, hi) if ttft <= args.ttft_ms / 1e3 else (lo, mid)
    return lo


def measure_knee(path: Path, predicted: float, args) -> dict:
    """One fresh cluster per probe, from below the predicted knee up, until TTFT passes the target."""
    probes = []
    for step in KNEE_STEPS:
        rate = round(predicted * step, 3)
        got = measure_round(path, rate, args, seed=9000 + int(step * 100))
        probes.append({"step": step, "rate": rate, **got["measured"]})
        print(json.dumps({"knee_probe": probes[-1]}), file=sys.stderr, flush=True)
        if got["measured"]["ttft_ms"] > args.ttft_ms:
            break
    return {"predicted_rate": predicted, "measured_rate": knee_from(probes, args.ttft_ms), "probes": probes}


def split_meets(p: Plan, args) -> bool:
    """Whether the prefill and decode pools (not the aggregated alternative) meet the targets."""
    return p.decode["itl_s"] <= args.itl_ms / 1e3 and p.prefill["ttft_s"] <= args.ttft_ms / 1e3


def one_to_one_rate(shape, weights, dtype, hw, profile, args) -> float:
    """The highest rate (to 2%) at which the plan still asks for one worker of each kind."""
    lo, hi = 0.01, 1000.0
    while hi / lo > 1.02:
        mid = (lo * hi) ** 0.5
        p = planned(shape, weights, dtype, hw, profile, mid, args)
        lo, hi = (mid, hi) if (p.pools["prefill"], p.pools["decode"]) == (1, 1) and split_meets(p, args) else (lo, mid)
    return lo


def step_totals(metrics_address: str) -> tuple[float, float]:
    """(steps, seconds) the worker's engine has run: its ``kervan_engine_step_seconds``."""
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
              if s.name.startswith("kervan_engine_step_seconds_")}
    return values.get("kervan_engine_step_seconds_count", 0.0), values.get("kervan_engine_step_seconds_sum", 0.0)


async def measure_load(address: str, rate: float, args, seed: int) -> dict:
    """The open loop at ``rate`` after ``--warmup-s`` of it (its own seed, not measured: a
    fresh cluster's first requests pay first-call costs a served one has long paid)."""
    lengths = workload.Lengths.parse(args.input_len), workload.Lengths.parse(args.output_len)
    count = max(30, min(args.requests, round(rate * args.seconds)))
    requests = workload.build(count, *lengths, seed, (3, args.vocab))
    async with KervanBackend(address) as backend:
        await backend.send(workload.BenchRequest([5] * 8, 2))  # connections, first-call costs
        warmup = round(rate * args.warmup_s)
        if warmup:
            await run_open_loop(backend, workload.build(warmup, *lengths, seed + 7919, (3, args.vocab)), rate,
                                seed + 7919, progress=False)
        results, wall = await run_open_loop(backend, requests, rate, seed, progress=False)
    return summarize(results, wall, (50, 90, 99))


def measure_round(path: Path, rate: float, args, seed: int) -> dict:
    """One round at ``rate``: a fresh cluster of one prefill and one decode worker under the
    open loop; the measured values, the decode worker's mean engine step, the bench summary."""
    spec = ClusterSpec(path, num_prefill=1, num_decode=1, engine=EngineArgs(dtype=args.dtype), pin_cores=True,
                       scheduler_args=ALL_PROMPTS_REMOTE, metrics=True)
    cluster = Cluster(spec, new_log_dir())
    try:
        cluster.start()
        before = step_totals(cluster.addresses["decode-0-metrics"])
        got = asyncio.run(measure_load(cluster.router_address, rate, args, seed))
        after = step_totals(cluster.addresses["decode-0-metrics"])
    finally:
        cluster.stop()
    steps = after[0] - before[0]
    return {"seed": seed, "measured": {"output_tokens_per_s": got["output_throughput"], "ttft_ms": got["mean_ttft_ms"],
                                       "itl_ms": got["median_itl_ms"]},
            # the decode worker's engine steps in the cluster: the part of ITL the profile measures
            "decode_engine_step_ms_mean": round((after[1] - before[1]) / steps * 1e3, 3) if steps else None,
            "decode_steps": steps, "bench": got}


def check_model(name: str, args) -> dict:
    path = model_dir(name)
    shape, held, _ = model_shape(str(path))
    args.vocab = shape.vocab_size
    profile = profile_served(path, args.dtype) if args.profile == "served" else \
        profile_on_one_core(path, args.dtype, core=max(os.sched_getaffinity(0)))
    hw = measure_this(per_core=True)
    weights = held if held.startswith("gguf") else profile.dtype  # float weights are served in the dtype
    capacity = one_to_one_rate(shape, weights, profile.dtype, hw, profile, args)
    points = []
    for share in args.loads:
        rate = round(capacity * share, 3)
        p = planned(shape, weights, profile.dtype, hw, profile, rate, args)
        predicted = {"output_tokens_per_s": rate * p.load["output_len"], "ttft_ms": p.prefill["ttft_s"] * 1e3,
                     "itl_ms": p.decode["itl_s"] * 1e3}  # the split pools', which the cluster runs
        rounds = [measure_round(path, rate, args, seed=int(share * 100) + 1000 * r) for r in range(args.rounds)]
        ranges = {k: spread([r["measured"][k] for r in rounds]) for k in predicted}
        measured = {k: ranges[k]["median"] for k in predicted}
        engine_step = spread([r["decode_engine_step_ms_mean"] for r in rounds])["median"]
        points.append({"load_share": share, "rate": rate, "plan_pools": p.pools, "meets_slo": split_meets(p, args),
                       "scored": list(SCORED), "tolerance": TOLERANCE,
                       "predicted": predicted, "measured": measured, "measured_range": ranges,
                       "measured_over_predicted": {k: round(measured[k] / predicted[k], 3) for k in predicted
                                                   if measured[k] is not None and predicted[k]},
                       "decode_engine_step_ms_mean": engine_step,
                       "rounds": rounds, "reasons": p.reasons})
        points[-1]["verdicts"] = point_verdicts(points[-1])
        print(json.dumps({"model": name, **{k: v for k, v in points[-1].items() if k not in ("rounds", "reasons")}}),
              file=sys.stderr, flush=True)
    knee = None if args.no_knee else measure_knee(
        path, predicted_knee(shape, weights, profile.dtype, hw, profile, args), args)
    return {"model": str(path), "weights": weights, "dtype": profile.dtype, "profile_kind": args.profile,
            "one_to_one_rate": capacity, "knee": knee,
            "profile": json.loads(profile.to_json()), "points": points}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="embedded,moe,smollm2-135m",
                    help="embedded (the default model), moe (a random Mixtral), or pulled catalog names")
    ap.add_argument("--loads", default="0.2,0.5,0.8", type=lambda s: [float(x) for x in s.split(",")],
                    help="fractions of the highest rate the plan serves with one worker of each kind")
    ap.add_argument("--requests", type=int, default=150, help="at most this many requests per load")
    ap.add_argument("--seconds", type=float, default=40.0, help="requests per load: what arrives in this time")
    ap.add_argument("--rounds", type=int, default=3,
                    help="fresh clusters per load, each its own seed; the measured values are their medians")
    ap.add_argument("--warmup-s", type=float, default=10.0,
                    help="before each round's measured requests, this long of the same load, not measured")
    ap.add_argument("--input-len", default="uniform:128:512")
    ap.add_argument("--output-len", default="fixed:64")
    ap.add_argument("--ttft-ms", type=float, default=2000.0)
    ap.add_argument("--itl-ms", type=float, default=100.0)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--profile", choices=("served", "engine"), default="served",
                    help="the plan's step times: `kervan profile --served` (through a 1P+1D cluster on this "
                         "machine) or the engine alone on one core")
    ap.add_argument("--no-knee", action="store_true", help="leave the capacity knee out")
    ap.add_argument("--json-out", default=None, help="also write the report here (with the commit)")
    add_dtype_argument(ap)
    args = ap.parse_args()
    report = {"benchmark": "plan_check", "machine": machine(args.dtype), "hardware": "this-core",
              "models": {name: check_model(name, args) for name in args.models.split(",")}}
    report["score"] = {"tolerance": TOLERANCE, "scored": [*SCORED, "knee"], **score(report)}
    write_report(report, args.json_out, args)


if __name__ == "__main__":
    main()
