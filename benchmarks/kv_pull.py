"""Pulling a prefix from the worker that holds it against computing it again, on a mesh.

A ``kervan up``-style cluster of two aggregated workers with the scheduler alternating
between them (``--policy round_robin``: a revisit always lands on the worker that did not
see the document), fresh per round and setting: ``recompute`` (pulls off: the revisit is
prefilled from scratch where it lands) and ``pull`` (``--pull-block-cost``: the holder
prefills it, computing only the question, and pushes the KV over the KV transfer: shared
memory here). Each round sends ``--documents`` fresh documents of ``--doc-len`` tokens,
each followed at once by a revisit (the same document, another 8-token question), one
request at a time, ``--output-len`` greedy tokens. Reported: the revisits' TTFT (median
per round), its ratio recompute/pull per round, the first visits' TTFT for reference.
The two settings alternate per round (medians over rounds, with their range).

    python -m benchmarks.kv_pull --model smollm2-135m --json-out benchmarks/results/kv_pull-amx-smollm2.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
from pathlib import Path

from benchmarks.machine import machine, write_report
from benchmarks.stats import spread
from control_plane.bench.backends import KervanBackend
from control_plane.bench.workload import BenchRequest
from control_plane.cli.launcher import Cluster, ClusterSpec
from control_plane.tools.pull import resolve_model
from kervan.engine_args import EngineArgs
from services.router.__main__ import model_limits
from worker.default_model import ensure_default_model

SETTINGS = {"recompute": (), "pull": ("--pull-block-cost", "0.1")}


async def visits(cluster: Cluster, args, seed: int) -> dict:
    rng = random.Random(seed)
    first, revisit, cached = [], [], []
    async with KervanBackend(cluster.router_address) as client:
        for _ in range(args.documents):
            doc = [rng.randrange(3, args.vocab) for _ in range(args.doc_len)]
            for into in (first, revisit):
                timed = await client.send(BenchRequest(doc + [rng.randrange(3, args.vocab) for _ in range(8)],
                                                       args.output_len))
                if timed.error:
                    raise RuntimeError(timed.error)
                into.append(timed.ttft * 1e3)
            cached.append(timed.cached_prompt_tokens)
    return {"first_ttft_ms": statistics.median(first), "revisit_ttft_ms": statistics.median(revisit),
            "revisit_cached_tokens": statistics.median(cached)}


def run(model_dir: Path, setting: str, args, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as logs:
        cluster = Cluster(ClusterSpec(model_dir, num_prefill=0, num_decode=0, num_both=2,
                                      engine=EngineArgs(dtype=args.dtype),
                                      scheduler_args=("--policy", "round_robin", *SETTINGS[setting])), Path(logs))
        try:
            cluster.start(timeout=300)
            return asyncio.run(visits(cluster, args, seed))
        finally:
            cluster.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a catalog name or model directory (default: the embedded model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("--doc-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    model_dir = Path(resolve_model(args.model)) if args.model else ensure_default_model()
    args.vocab = min(model_limits(model_dir).vocab_size, 30000)
    results: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        for setting in (list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))):
            out = run(model_dir, setting, args, seed=r)
            results[setting].append(out)
            print(f"round {r} {setting}: " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()), flush=True)
    summary = {s: {k: spread([o[k] for o in outs]) for k in outs[0]} for s, outs in results.items()}
    summary["revisit_ttft_recompute_over_pull"] = spread([
        rc["revisit_ttft_ms"] / p["revisit_ttft_ms"] for rc, p in zip(results["recompute"], results["pull"])])
    report = {"benchmark": "kv_pull", "model": args.model or "embedded", "machine": machine(args.dtype),
              "arguments": vars(args), "summary": summary, "rounds": results}
    write_report(report, args.json_out)


if __name__ == "__main__":
    main()
