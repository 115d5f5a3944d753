"""Registry lookups: longest-prefix match of a 128-block prompt with one million
blocks registered across 16 workers, on a loopback Redis.

Workers share 32 long "system prompt" chains of 128 blocks, each worker holding a
different depth of each (so matches stop at many different places), and fill the
rest of their ~62,500 blocks with blocks of their own. Each lookup asks for one
chain's 128 hashes and gets, per worker, how many leading blocks it holds.

- ``bitmaps``: Kervan's match (``block_owners.py``: one round trip, an MGET of
  the prompt's 128 slot bitmaps, AND-ed on the client);
- ``owner_sets``: the baseline, the layout the registry used before: a Redis set
  of worker ids per block (loaded side by side here), one pipelined round trip of
  128 SMEMBERS, intersected in Python;
- ``grpc_match``: the bitmaps behind the kv-registry's Match RPC, as the scheduler
  sees it (an in-process server on loopback).

    python -m benchmarks.registry_lookup --json-out benchmarks/results/registry_lookup-amx.json   # ~1 min
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import tempfile
import time
from pathlib import Path

import grpc
import redis.asyncio as redis
import uvloop

from benchmarks.machine import machine, write_report
from control_plane.cli.redis_server import running_redis
from kervan.block_hash import HASH_NAME
from kervan.kv_events import BlockStored
from kervan.sampling import RequestLimits
from kervan.worker_info import WorkerInfo, WorkerRole
from services.common.server import Service, start_server
from services.kv_registry.__main__ import SERVICE_NAME
from services.kv_registry.index import PrefixIndex
from services.kv_registry.servicer import KvRegistryServicer
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc

SETS = "baseline:blk:"


async def populate(index: PrefixIndex, rng: random.Random, num_workers: int, total_blocks: int,
                   chains: list[list[bytes]]) -> int:
    per_worker = total_blocks // num_workers
    registered = 0
    for w in range(num_workers):
        wid = f"decode@10.0.0.{w}:50051"
        token = await index.register(WorkerInfo(
            worker_id=wid, address=wid.split("@")[1], role=WorkerRole.DECODE, model="m", block_size=16,
            hash_name=HASH_NAME, limits=RequestLimits(max_model_len=4096, max_n=16)))
        held = [h for chain in chains for h in chain[:rng.randint(0, len(chain))]]
        held += [rng.randbytes(32) for _ in range(per_worker - len(held))]
        seq = 0
        for i in range(0, len(held), 20_000):
            seq += 1
            await index.apply(wid, token, [BlockStored(seq, held[i:i + 20_000], None, [], 16)])
            async with index.r.pipeline(transaction=False) as pipe:  # the baseline's layout
                for h in held[i:i + 20_000]:
                    pipe.sadd(f"{SETS}{h.hex()}", wid)
                await pipe.execute()
        registered += len(held)
    return registered


async def owner_sets_match(r: redis.Redis, block_hashes: list[bytes]) -> dict[str, int]:
    async with r.pipeline(transaction=False) as pipe:
        for h in block_hashes:
            pipe.smembers(f"{SETS}{h.hex()}")
        owners = await pipe.execute()
    counts: dict[str, int] = {}
    alive = set(owners[0])
    for i, members in enumerate(owners):
        alive &= members
        if not alive:
            break
        for w in alive:
            counts[w.decode()] = i + 1
    return counts


async def timed(methods: dict, queries: list[list[bytes]], passes: int = 2
                ) -> tuple[dict[str, list[float]], dict[str, list]]:
    """Each method runs a block of queries on its own (interleaving them per query
    lets the heavy baseline's garbage and cache misses land on the others), and the
    blocks alternate over ``passes`` so that drift hits all alike."""
    samples = {name: [] for name in methods}
    answers = {name: [] for name in methods}
    share = len(queries) // passes
    for p in range(passes):
        for name, fn in methods.items():
            for q in queries[p * share:(p + 1) * share]:
                t0 = time.perf_counter()
                answers[name].append(await fn(q))
                samples[name].append((time.perf_counter() - t0) * 1000)
    return samples, answers


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q / 100 * len(values)))], 3)


async def main_async(args) -> dict:
    rng = random.Random(args.seed)
    chains = [[rng.randbytes(32) for _ in range(args.prompt_blocks)] for _ in range(32)]
    with tempfile.TemporaryDirectory() as tmp, running_redis(Path(tmp)) as url:
        r = redis.Redis.from_url(url)
        index = PrefixIndex(r, ttl_s=3600)
        t0 = time.perf_counter()
        registered = await populate(index, rng, args.workers, args.blocks, chains)
        load_s = time.perf_counter() - t0
        memory = (await r.info("memory"))["used_memory"]  # both layouts
        servicer = KvRegistryServicer(index, 16, HASH_NAME)
        server = await start_server([Service(SERVICE_NAME, lambda s: (
            kv_registry_pb2_grpc.add_KvRegistryServiceServicer_to_server(servicer, s)))])
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        stub = kv_registry_pb2_grpc.KvRegistryServiceStub(channel)

        async def via_grpc(q):
            return dict((await stub.Match(kv_registry_pb2.MatchRequest(block_hashes=q))).matched_blocks)

        async def via_bitmaps(q):
            return (await index.match(q))[0]

        queries = [rng.choice(chains) for _ in range(args.lookups)]
        methods = {"bitmaps": via_bitmaps, "owner_sets": lambda q: owner_sets_match(r, q), "grpc_match": via_grpc}
        await timed(methods, queries[:50])  # warm-up: connections, script cache
        gc.collect()
        gc.freeze()  # the million hashes built above are not garbage: keep the collector off them
        samples, answers = await timed(methods, queries)
        assert answers["bitmaps"] == answers["owner_sets"] == answers["grpc_match"]
        depth = [max(a.values(), default=0) for a in answers["bitmaps"]]
        await channel.close()
        await server.stop(0)
        await r.aclose()
    report = {"benchmark": "registry_lookup", "machine": machine(), "workers": args.workers,
              "blocks_registered": registered, "prompt_blocks": args.prompt_blocks, "lookups": args.lookups,
              "load_seconds": round(load_s, 1), "redis_used_memory_mb": round(memory / 2**20),
              "mean_longest_match_blocks": round(sum(depth) / len(depth), 1),
              "latency_ms": {name: {"p50": pct(v, 50), "p99": pct(v, 99), "max": round(max(v), 3)}
                             for name, v in samples.items()}}
    report["owner_sets_vs_bitmaps_p99"] = round(report["latency_ms"]["owner_sets"]["p99"]
                                                / report["latency_ms"]["bitmaps"]["p99"], 1)
    half = len(samples["bitmaps"]) // 2  # timed's two passes, in order
    report["latency_ms_per_pass"] = {name: [{"p50": pct(part, 50), "p99": pct(part, 99)}
                                            for part in (v[:half], v[half:])] for name, v in samples.items()}
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--prompt-blocks", type=int, default=128)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None, help="also write the report here (with the commit)")
    args = ap.parse_args()
    write_report(uvloop.run(main_async(args)), args.json_out, args)  # the services' event loop


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
