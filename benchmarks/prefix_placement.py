"""KV-aware placement against round-robin and random, on a shared-prefix workload
over 4 replicas.

Eight long "system prompts" (1,024 tokens each), each shared by many users with a
unique question appended (32-96 tokens), 24 requests each, arrive in a seeded
random order at 8 concurrent requests to a mesh of 4 aggregated workers (each
decodes and prefills: a replica). Each worker's KV cache holds four system
prompts (256 blocks of 16 tokens, running requests included), so the cluster can
keep all eight cached only if each prompt keeps going to the same replica.

For each policy (a fresh cluster each, caches cold): prefix-cache hit rate (cached
prompt tokens / prompt tokens, from each request's usage), time to first token
(p50, p99) and throughput. The oracle hit rate is the best any placement can do
here: every request hits its whole system prompt except the first of each (the
cluster's caches have room for all eight).

    python -m benchmarks.prefix_placement           # ~3 min: embedded default model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path

from benchmarks import plots
from benchmarks.load import pct_ms, run_closed_loop
from benchmarks.machine import add_dtype_argument, machine
from control_plane.launcher import Cluster, ClusterSpec, new_log_dir
from worker.default_model import ensure_default_model

POLICIES = ("kv", "round_robin", "random")


def shared_prefix_workload(num_prefixes: int, prefix_len: int, per_prefix: int, suffix_range: tuple[int, int],
                           output_len: int, vocab: int, seed: int) -> tuple[list[tuple[list[int], int]], list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    which = [k for k in range(num_prefixes) for _ in range(per_prefix)]
    rng.shuffle(which)
    work = [(prefixes[k] + [rng.randrange(3, vocab) for _ in range(rng.randint(*suffix_range))], output_len)
            for k in which]
    return work, which


def oracle_hit_rate(work, which, prefix_len: int, block_size: int) -> float:
    cacheable = prefix_len // block_size * block_size
    seen, hits = set(), 0
    for k in which:
        hits += cacheable if k in seen else 0
        seen.add(k)
    return hits / sum(len(p) for p, _ in work)


def run_policy(model_dir: Path, policy: str, work, args) -> dict:
    spec = ClusterSpec(model_dir, num_prefill=0, num_decode=0, num_both=args.replicas, dtype=args.dtype,
                       num_kv_blocks=args.kv_blocks_per_worker,
                       scheduler_args=("--policy", policy, "--seed", "0", *args.scheduler_args.split()))
    cluster = Cluster(spec, new_log_dir())
    cluster.start()
    try:
        results, seconds = asyncio.run(run_closed_loop(cluster.router_address, work, args.concurrency))
    finally:
        cluster.stop()
    ttfts = [r.ttft for r in results]
    return {"hit_rate": round(sum(r.cached_prompt_tokens for r in results) / sum(r.prompt_tokens for r in results), 3),
            "ttft_ms": {"p50": pct_ms(ttfts, 50), "p99": pct_ms(ttfts, 99)},
            "output_tokens_per_s": round(sum(r.tokens for r in results) / seconds, 1), "seconds": round(seconds, 1),
            "_ttfts_ms": [t * 1000 for t in ttfts]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--per-prefix", type=int, default=24, help="requests sharing each system prompt")
    ap.add_argument("--suffix-len", default="32:96")
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-blocks-per-worker", type=int, default=256, help="four system prompts of 64 blocks")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--scheduler-args", default="", help="more scheduler flags, e.g. '--overlap-weight 2'")
    ap.add_argument("--seed", type=int, default=0)
    add_dtype_argument(ap)
    args = ap.parse_args()
    model_dir = Path(args.model) if args.model else ensure_default_model()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    work, which = shared_prefix_workload(args.prefixes, args.prefix_len, args.per_prefix,
                                         tuple(int(x) for x in args.suffix_len.split(":")), args.output_len, vocab,
                                         args.seed)
    oracle = oracle_hit_rate(work, which, args.prefix_len, 16)
    report = {"benchmark": "prefix_placement", "model": str(model_dir), "machine": machine(args.dtype),
              "replicas": args.replicas,
              "workload": {"requests": len(work), "system_prompts": args.prefixes,
                           "system_prompt_tokens": args.prefix_len, "suffix_tokens": args.suffix_len,
                           "output_tokens": args.output_len, "concurrency": args.concurrency,
                           "kv_blocks_per_worker": args.kv_blocks_per_worker},
              "oracle_hit_rate": round(oracle, 3), "policies": {}}
    ttfts = {}
    for policy in args.policies.split(","):
        result = run_policy(model_dir, policy, work, args)
        ttfts[policy] = result.pop("_ttfts_ms")
        result["hit_rate_vs_oracle"] = round(result["hit_rate"] / oracle, 3)
        report["policies"][policy] = result
    by = report["policies"]
    if "kv" in by and "round_robin" in by:
        report["kv_ttft_p50_speedup_vs_round_robin"] = round(by["round_robin"]["ttft_ms"]["p50"]
                                                             / by["kv"]["ttft_ms"]["p50"], 2)
    plots.grouped_bars("prefix_placement", f"Shared prefixes over {args.replicas} replicas",
                       ["prefix-cache hit rate", "TTFT p50", "TTFT p99"],
                       {p: [r["hit_rate"], r["ttft_ms"]["p50"], r["ttft_ms"]["p99"]] for p, r in by.items()},
                       ["cached / prompt tokens", "ms", "ms"])
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
