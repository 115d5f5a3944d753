"""The scheduler's whole ``Place`` path, as a router pays it, at 16, 100 and 1,000
registered workers.

Real processes on loopback: a private redis-server, the kv-registry and the scheduler
(``python -m services.kv_registry`` / ``services.scheduler``, as ``kervan up`` starts
them), and this client. Each worker is registered in Redis with a load report and
holds a random depth (0-128 blocks) of 8 of 32 shared 128-block chains. A ``Place``
asks for one chain: the scheduler calls the registry's ``ListWorkers`` (one SMEMBERS,
one HGETALL per worker) and ``Match`` (one MGET of 128 owner bitmaps) at once, builds a
candidate per worker and scores them.

Conditions per worker count, each 600 placements (medians of the alternating passes):

- ``serial``: one ``Place`` in flight: the floor;
- ``concurrent``: 16 in flight, as 16 routers' worth of requests would be;
- ``concurrent_with_events``: the same while 8 writers publish KV events through the
  registry's ``PublishEvents`` as workers do (16 blocks stored, then removed, per call).

Also, serially, the two registry calls alone (``list_workers``, ``match``), to show
where the time goes. Reported: p50, p99 and max latency in ms, placements per second,
and events per second written meanwhile.

    python -m benchmarks.place_path --json-out benchmarks/results/place_path-amx.json   # ~3 min
    python -m benchmarks.place_path --workers 16,100
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import redis.asyncio as redis

from benchmarks.machine import machine, write_report
from control_plane.cli.redis_server import running_redis
from control_plane.hosts.network import Host
from kervan.block_hash import HASH_NAME
from kervan.kv_events import BlockRemoved, BlockStored
from kervan.sampling import RequestLimits
from kervan.worker_info import WorkerInfo, WorkerRole
from services.common.convert import event_to_proto
from services.common.load import Load
from services.kv_registry.index import PrefixIndex
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

CONCURRENCY = 16
WRITERS = 8

ROOT = Path(__file__).resolve().parents[1]  # entering a host's mounts leaves the working directory


def start(module: str, *args: str, host: Host | None = None) -> tuple[subprocess.Popen, str, str | None]:
    """A service process on loopback, or on a simulated ``host`` (plaintext: the hosts' network
    is this benchmark's alone); (it, its gRPC address, its metrics address when it serves
    metrics, else None)."""
    argv = [sys.executable, "-m", module, "--port", "0", *args]
    if host is not None:
        argv = host.enter([*argv, "--host", host.address, "--allow-plaintext"])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    metrics = None
    for _ in range(10):  # "<service> metrics on http://HOST:PORT/metrics", then "<service> ready on HOST:PORT"
        line = proc.stdout.readline()
        if "metrics on http://" in line:
            metrics = line.split("http://", 1)[1].split("/", 1)[0]
        if "ready on" in line:
            return proc, line.rsplit(" ", 1)[1].strip(), metrics
    proc.kill()
    raise RuntimeError(f"{module} did not start")


async def populate(index: PrefixIndex, rng: random.Random, num_workers: int, chains: list[list[bytes]]
                   ) -> list[tuple[str, str]]:
    workers = []
    for w in range(num_workers):
        wid = f"decode@10.{w // 250}.{w % 250}.1:50051"
        token = await index.register(WorkerInfo(
            worker_id=wid, address=wid.split("@")[1], role=WorkerRole.DECODE, model="", block_size=16,
            hash_name=HASH_NAME, limits=RequestLimits(max_model_len=4096, max_n=16)))
        held = [h for chain in rng.sample(chains, 8) for h in chain[:rng.randint(0, len(chain))]]
        await index.apply(wid, token, [BlockStored(1, held, None, [], 16)])
        await index.heartbeat(wid, token, Load(num_running=rng.randint(0, 8), num_free_blocks=rng.randint(0, 4096),
                                               num_blocks=4096, num_requests=rng.randint(0, 8), max_requests=64))
        workers.append((wid, token))
    return workers


async def timed_calls(call, count: int, concurrency: int) -> tuple[list[float], float]:
    samples: list[float] = []
    todo = iter(range(count))

    async def lane():
        for i in todo:
            t0 = time.perf_counter()
            await call(i)
            samples.append((time.perf_counter() - t0) * 1000)

    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return samples, time.perf_counter() - t0


async def event_writers(stub, workers: list[tuple[str, str]], stop: asyncio.Event, rng: random.Random) -> int:
    seqs = {wid: 1 for wid, _ in workers}
    written = 0

    async def writer(k: int):
        nonlocal written
        mine = workers[k::WRITERS]
        for n in range(100_000):  # bounded; ends when the placements do
            if stop.is_set():
                return
            wid, token = mine[n % len(mine)]
            blocks = [rng.randbytes(32) for _ in range(16)]
            events = [BlockStored(seqs[wid] + 1, blocks, None, [], 16), BlockRemoved(seqs[wid] + 2, blocks)]
            seqs[wid] += 2
            await stub.PublishEvents(kv_registry_pb2.PublishEventsRequest(
                worker_id=wid, incarnation=token, events=[event_to_proto(e) for e in events]), timeout=10)
            written += len(events)

    await asyncio.gather(*(writer(k) for k in range(min(WRITERS, len(workers)))))
    return written


def stats(samples: list[float]) -> dict:
    a = np.asarray(samples)
    return {"p50": round(float(np.percentile(a, 50)), 3), "p99": round(float(np.percentile(a, 99)), 3),
            "max": round(float(a.max()), 3)}


async def one_size(url: str, num_workers: int, args, rng: random.Random) -> dict:
    chains = [[rng.randbytes(32) for _ in range(128)] for _ in range(32)]
    registry, registry_addr, _ = start("services.kv_registry", "--redis", url, "--ttl", "3600")
    scheduler = None
    r = redis.Redis.from_url(url)
    try:
        index = PrefixIndex(r, ttl_s=3600)
        t0 = time.perf_counter()
        workers = await populate(index, rng, num_workers, chains)
        load_s = time.perf_counter() - t0
        scheduler, scheduler_addr, _ = start("services.scheduler", "--registry", registry_addr)
        async with grpc.aio.insecure_channel(scheduler_addr) as sch, grpc.aio.insecure_channel(registry_addr) as reg:
            place_stub = scheduler_pb2_grpc.SchedulerServiceStub(sch)
            registry_stub = kv_registry_pb2_grpc.KvRegistryServiceStub(reg)
            queries = [rng.choice(chains) for _ in range(args.placements)]

            async def place(i):
                reply = await place_stub.Place(scheduler_pb2.PlaceRequest(
                    request_id=f"r{i}", block_hashes=queries[i], num_prompt_tokens=2048, max_tokens=16, n=1,
                    ), timeout=30)
                assert reply.decode_address

            async def list_workers(i):
                reply = await registry_stub.ListWorkers(kv_registry_pb2.ListWorkersRequest(), timeout=30)
                assert len(reply.workers) == num_workers

            async def match(i):
                await registry_stub.Match(kv_registry_pb2.MatchRequest(block_hashes=queries[i]), timeout=30)

            await timed_calls(place, 50, 4)  # warm-up: connections, scripts, caches
            runs: dict[str, list] = {"serial": [], "concurrent": [], "concurrent_with_events": [],
                                     "list_workers": [], "match": []}
            rates: dict[str, list[float]] = {"concurrent": [], "concurrent_with_events": [], "events_per_s": []}
            for _ in range(args.passes):
                runs["serial"] += (await timed_calls(place, args.placements // 2, 1))[0]
                samples, wall = await timed_calls(place, args.placements, CONCURRENCY)
                runs["concurrent"] += samples
                rates["concurrent"].append(args.placements / wall)
                stop = asyncio.Event()
                writing = asyncio.create_task(event_writers(registry_stub, workers, stop, rng))
                samples, wall = await timed_calls(place, args.placements, CONCURRENCY)
                stop.set()
                written = await writing
                runs["concurrent_with_events"] += samples
                rates["concurrent_with_events"].append(args.placements / wall)
                rates["events_per_s"].append(written / wall)
                runs["list_workers"] += (await timed_calls(list_workers, args.placements // 4, 1))[0]
                runs["match"] += (await timed_calls(match, args.placements // 4, 1))[0]
    finally:
        for proc in (scheduler, registry):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
        await r.flushall()
        await r.aclose()
    return {"workers": num_workers, "populate_s": round(load_s, 1),
            "latency_ms": {name: stats(v) for name, v in runs.items()},
            "placements_per_s": {k: round(float(np.median(v)), 1) for k, v in rates.items() if k != "events_per_s"},
            "events_per_s_during_placement": round(float(np.median(rates["events_per_s"])), 1),
            "per_pass": {k: [round(x, 1) for x in v] for k, v in rates.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="16,100,1000")
    ap.add_argument("--placements", type=int, default=600, help="per condition per pass")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None, help="also write the report here (with the commit)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    sizes = []
    with tempfile.TemporaryDirectory() as tmp, running_redis(Path(tmp)) as url:
        for n in (int(x) for x in args.workers.split(",")):
            sizes.append(asyncio.run(one_size(url, n, args, rng)))
    report = {"benchmark": "place_path", "machine": machine(), "concurrency": CONCURRENCY, "event_writers": WRITERS,
              "prompt_blocks": 128, "placements_per_condition": args.placements * args.passes}
    report["sizes"] = sizes
    write_report(report, args.json_out, args)


if __name__ == "__main__":
    main()
