"""The control plane at fleet scale, simulated: Redis, the kv-registry and the scheduler
(real processes on loopback, started as ``kervan up`` starts them) against 1,000 simulated
workers and 10M registered KV blocks.

Each simulated worker is registered through the registry's own write path (``PrefixIndex``:
its Lua scripts) with a load report and 10,000 blocks: random depths of 32 shared 128-block
"system prompt" chains, the rest its own. Then, in order:

1. **Redis memory**: ``used_memory`` before and after the blocks, per registered block (a
   block's owner bitmap, ``blk:{hash}``, and its entry in its worker's ownership hash), and
   the load rate.
2. **Events one registry sustains**: ``--publishers`` simulated workers each publish KV
   events through ``PublishEvents`` as fast as they are answered (16 blocks stored, then the
   same 16 removed, per call) for ``--seconds``; events and blocks per second, and the CPU
   the registry and Redis used meanwhile (from /proc).
3. **Place at fleet scale**: 1,000 placements of a chain's 128 hashes, one at a time and 16
   in flight, first with nothing else running, then while the fleet's background traffic
   runs: every worker's heartbeat once a second (1,000/s) and KV events at ``--event-share``
   of the rate step 2 measured (the registry then shares its core with them), sent by
   ``benchmarks.fleet_traffic`` in its own process at a lower priority (the workers it stands
   for run elsewhere: their side must not share the measuring client's event loop, nor
   outrank the control plane for the cores; the registry and Redis serve it all). The whole
   ``Place`` as a router sees it (p50, p99), and the scheduler's own decision from its
   ``kervan_placement_decision_seconds`` histogram (the share under 1 ms; p50 and p99 read
   within their buckets); the scheduler as it runs (``watch``: its live set kept from the
   registry's ``WatchWorkers`` stream, the shortlist), restarted ``--no-watch`` (listing the
   live set, as before the stream) and ``--no-shortlist`` (pricing every worker, as before
   the shortlist), in alternating passes.
4. **The block index on a Redis Cluster**, as far as it runs here: three shards on loopback
   (``redis-server --cluster-enabled``, joined by ``redis-cli --cluster create``) holding the
   chains' owner bitmaps, spread by hash slot, and a match's read of a prompt's 128 bitmaps
   split per shard by redis-py's cluster client (``mget_nonatomic``), against the same read
   from one Redis. Three shards on two cores measure what splitting costs a lookup, not
   what it gains in capacity.

    python -m benchmarks.fleet --json-out benchmarks/results/fleet-amx.json   # ~12 min, ~3 GB of Redis
    python -m benchmarks.fleet --workers 100 --blocks-per-worker 1000 --seconds 5   # a smoke run

``--hosts --link RATE`` lays it over simulated hosts (``control_plane/hosts/``): Redis, the
kv-registry and the scheduler on one, the fleet's traffic process on another, and this process
(the router's side: the populating, the events, the placements) outside both, so every call
crosses a link rather than loopback. Step 4 (loopback shards) is skipped then.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import redis.asyncio as redis

from benchmarks.fleet_traffic import NICE, Publisher, fleet_load
from benchmarks.machine import machine, write_report
from benchmarks.place_path import ROOT, start, stats
from control_plane.cli.redis_server import redis_argv, running_redis, wait_listening
from control_plane.hosts.link import Link
from control_plane.hosts.network import Host, HostNetwork
from control_plane.planner.metrics import Scrape, quantile
from kervan.block_hash import HASH_NAME
from kervan.kv_events import BlockStored
from kervan.sampling import RequestLimits
from kervan.worker_info import WorkerInfo, WorkerRole
from services.kv_registry.index import PrefixIndex
from services.proto import kv_registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

CHAINS, CHAIN_BLOCKS = 32, 128
# the scheduler as it runs (the live set from WatchWorkers, the shortlist), listing the live set
# instead (as before the watch), and pricing every worker (as before the shortlist)
VARIANTS = {"watch": [], "listing": ["--no-watch"], "price_all": ["--no-shortlist"]}
DECISION = "kervan_placement_decision_seconds"


@contextmanager
def redis_on(host: Host | None, data_dir: Path) -> Iterator[str]:
    """The benchmark's Redis: on loopback, or on a simulated host (its own port space)."""
    if host is None:
        with running_redis(data_dir) as url:
            yield url
        return
    proc = subprocess.Popen(host.enter(redis_argv(6379, data_dir, bind=host.address)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_listening(6379, proc, host=host.address)
        yield f"redis://{host.address}:6379/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def populate(index: PrefixIndex, rng: random.Random, num_workers: int, per_worker: int,
                   chains: list[list[bytes]]) -> tuple[list[tuple[str, str]], int]:
    workers, registered = [], 0
    for w in range(num_workers):
        wid = f"{'prefill' if w % 4 == 0 else 'decode'}@10.{w // 250}.{w % 250}.1:50051"
        token = await index.register(WorkerInfo(
            worker_id=wid, address=wid.split("@")[1], role=WorkerRole.PREFILL if w % 4 == 0 else WorkerRole.DECODE,
            model="", block_size=16, hash_name=HASH_NAME, limits=RequestLimits(max_model_len=4096, max_n=16),
            kv_capacity_blocks=2 * per_worker))
        held = [h for chain in rng.sample(chains, 8) for h in chain[:rng.randint(0, len(chain))]]
        held += [rng.randbytes(32) for _ in range(per_worker - len(held))]
        await index.apply(wid, token, [BlockStored(1, held, None, [], 16)])
        await index.heartbeat(wid, token, fleet_load(rng))
        workers.append((wid, token))
        registered += len(held)
    return workers, registered


async def closed_loop(call, lanes: int, seconds: float) -> int:
    done, deadline = 0, time.monotonic() + seconds

    async def lane(first: int):
        nonlocal done
        k = first
        while time.monotonic() < deadline:
            await call(k)
            k += lanes
            done += 1
    await asyncio.gather(*(lane(i) for i in range(lanes)))
    return done


async def sustained_events(stub, workers, rng, lanes: int, seconds: float, pids: dict[str, int]) -> dict:
    publisher = Publisher(stub, workers, rng)
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    t0 = time.monotonic()
    calls = await closed_loop(publisher.publish, lanes, seconds)
    wall = time.monotonic() - t0
    return {"publishers": lanes, "calls": calls, "events_per_s": round(publisher.events / wall, 1),
            "blocks_per_s": round(publisher.events / 2 * 16 * 2 / wall, 1),
            "cpu_share": {name: round((cpu_seconds(pid) - cpu0[name]) / wall, 2) for name, pid in pids.items()}}


def cluster_port(rng: random.Random) -> int:
    """A free port whose cluster bus port (10,000 above it) is free too."""
    import socket
    for _ in range(1000):
        port = rng.randrange(20000, 30000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a Redis Cluster shard")


async def cluster_lookup(single: redis.Redis, chains: list[list[bytes]], tmp: Path, lookups: int) -> dict:
    """A prompt's 128 owner bitmaps read from a 3-shard Redis Cluster and from one Redis."""
    from redis.asyncio.cluster import RedisCluster

    from control_plane.cli.redis_server import redis_server_binary, wait_listening
    rng = random.Random()
    ports, procs = [], []
    while len(ports) < 3:
        port = cluster_port(rng)
        ports += [port] if port not in ports else []
    try:
        for port in ports:
            d = tmp / f"shard-{port}"
            d.mkdir()
            procs.append(subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                                           "--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"),
                                           "--save", "", "--appendonly", "no", "--dir", str(d)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            wait_listening(port, procs[-1])
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas",
                        "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        cluster = RedisCluster(host="127.0.0.1", port=ports[0])
        for _ in range(100):  # the shards agree on the slots
            try:
                if (await cluster.cluster_info())["cluster_state"] == "ok":
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            await asyncio.sleep(0.1)
        keys = [[f"kervan:blk:{h.hex()}" for h in chain] for chain in chains]
        for chain in keys:
            values = await single.mget(chain)
            await cluster.mset_nonatomic({k: v or b"\0" for k, v in zip(chain, values)})
        samples: dict[str, list[float]] = {"one_redis": [], "three_shards": []}
        for i in range(lookups):
            chain = keys[i % len(keys)]
            for name, read in (("one_redis", single.mget), ("three_shards", cluster.mget_nonatomic)):
                t0 = time.perf_counter()
                got = await read(chain)
                samples[name].append((time.perf_counter() - t0) * 1000)
                assert len(got) == len(chain)
        await cluster.aclose()
        return {name: stats(v) for name, v in samples.items()}
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)


def decision_histogram(address: str) -> dict[float, float]:
    scrape = Scrape()
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        scrape.add_text(resp.read().decode())
    return scrape.buckets.get(DECISION, {})


async def placements(scheduler_addr: str, metrics_addr: str, queries, concurrency: int) -> dict:
    async with grpc.aio.insecure_channel(scheduler_addr) as ch:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        samples: list[float] = []
        todo = iter(range(len(queries)))

        async def lane():
            for i in todo:
                t0 = time.perf_counter()
                reply = await stub.Place(scheduler_pb2.PlaceRequest(
                    request_id=f"r{i}", block_hashes=queries[i], num_prompt_tokens=2048, max_tokens=16, n=1),
                    timeout=30)
                samples.append((time.perf_counter() - t0) * 1000)
                assert reply.decode_address
        before = decision_histogram(metrics_addr)
        t0 = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        after = decision_histogram(metrics_addr)
    buckets = {le: n - before.get(le, 0.0) for le, n in after.items()}
    total = max(buckets.values(), default=0.0)
    under_1ms = sum(n for le, n in buckets.items() if le == 0.001)
    return {"place_ms": stats(samples), "placements_per_s": round(len(queries) / wall, 1),
            "decision_ms": {"p50": round((quantile(buckets, 0.5) or 0) * 1e3, 3),
                            "p99": round((quantile(buckets, 0.99) or 0) * 1e3, 3),
                            "share_under_1ms": round(under_1ms / total, 4) if total else None}}


async def serial_and_concurrent(scheduler_addr: str, metrics_addr: str, queries, serial: int) -> dict:
    """The first ``serial`` queries placed one at a time, then all of them 16 in flight."""
    return {"serial": await placements(scheduler_addr, metrics_addr, queries[:serial], 1),
            "concurrent": await placements(scheduler_addr, metrics_addr, queries, 16)}


class Traffic:
    """The fleet's background traffic (``benchmarks.fleet_traffic``) in its own process, at
    niceness ``NICE``: every worker's heartbeat once a second and KV events at ``event_rate``.
    ``async with`` starts it and waits 1 s for it to be going; leaving ends it (an error
    inside too: no sender outlives the run). ``sent`` is then what it sent and the share of
    a core it used."""

    def __init__(self, registry_addr: str, workers_file: Path, event_rate: float, seed: int,
                 host: Host | None = None):
        self.args = [*(host.enter([]) if host else []), "nice", "-n", str(NICE), sys.executable, "-m",
                     "benchmarks.fleet_traffic",
                     "--registry", registry_addr, "--workers", str(workers_file), "--event-rate", str(event_rate),
                     "--seed", str(seed)]
        self.sent: dict = {}

    async def __aenter__(self) -> Traffic:
        self.proc = await asyncio.create_subprocess_exec(*self.args, stdout=asyncio.subprocess.PIPE, cwd=ROOT,
                                                         env={**os.environ, "OMP_NUM_THREADS": "1",
                                                              "PYTHONPATH": str(ROOT)})
        self.started = time.monotonic()
        await asyncio.sleep(1.0)  # the traffic going before anything is measured
        return self

    async def __aexit__(self, *exc) -> None:
        cpu = cpu_seconds(self.proc.pid)
        wall = time.monotonic() - self.started
        self.proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(self.proc.communicate(), 60)
        if exc[0] is None:
            if self.proc.returncode:
                raise RuntimeError(f"the traffic process failed ({self.proc.returncode})")
            self.sent = {**json.loads(out), "niceness": NICE, "cpu_share": round(cpu / wall, 2)}


async def main_async(args) -> dict:
    if not args.hosts:
        return await fleet(args, None, None)
    with HostNetwork.create(2, Link.parse(args.link)) as net:
        return await fleet(args, *net.hosts)


async def fleet(args, control: Host | None, traffic_host: Host | None) -> dict:
    rng = random.Random(args.seed)
    chains = [[rng.randbytes(32) for _ in range(CHAIN_BLOCKS)] for _ in range(CHAINS)]
    report: dict = {"benchmark": "fleet", "machine": machine(), "workers": args.workers,
                    "blocks_per_worker": args.blocks_per_worker, "prompt_blocks": CHAIN_BLOCKS}
    if control is not None:
        report["hosts"] = {"link": args.link, "control": control.address, "traffic": traffic_host.address}
    with tempfile.TemporaryDirectory() as tmp, redis_on(control, Path(tmp)) as url:
        r = redis.Redis.from_url(url)
        redis_pid = int((await r.info("server"))["process_id"])
        index = PrefixIndex(r, ttl_s=3600, max_blocks_per_worker=4 * args.blocks_per_worker)
        empty = (await r.info("memory"))["used_memory"]
        t0 = time.perf_counter()
        workers, registered = await populate(index, rng, args.workers, args.blocks_per_worker, chains)
        load_s = time.perf_counter() - t0
        used = (await r.info("memory"))["used_memory"]
        sample = [f"kervan:blk:{h.hex()}" for h in rng.sample(chains[0], 8)]
        report["redis"] = {"blocks_registered": registered, "distinct_blocks": await r.dbsize(),
                           "used_memory_mb": round(used / 2**20), "bytes_per_block": round((used - empty) / registered),
                           "load_s": round(load_s, 1), "blocks_per_s_loading": round(registered / load_s),
                           "bitmap_key_bytes_sampled": [await r.memory_usage(k) for k in sample]}
        print(f"loaded {registered:,} blocks in {load_s:.0f}s: {report['redis']}", file=sys.stderr, flush=True)
        gc.collect()
        gc.freeze()  # the hashes built above are not garbage
        workers_file = Path(tmp) / "workers.json"
        workers_file.write_text(json.dumps(workers))
        registry, registry_addr, _ = start("services.kv_registry", "--redis", url, "--ttl", "3600", host=control)
        procs = [registry]
        try:
            async with grpc.aio.insecure_channel(registry_addr) as reg:
                registry_stub = kv_registry_pb2_grpc.KvRegistryServiceStub(reg)
                report["events"] = [await sustained_events(registry_stub, workers, rng, lanes, args.seconds,
                                                           {"registry": registry.pid, "redis": redis_pid})
                                    for lanes in (8, 32)]
                print(f"events: {report['events']}", file=sys.stderr, flush=True)
                ceiling = max(e["events_per_s"] for e in report["events"])
                event_rate = args.event_share * ceiling
                queries = [rng.choice(chains) for _ in range(args.placements)]
                runs: dict[str, list] = {}
                for p in range(args.passes):
                    for variant, flags in VARIANTS.items():
                        scheduler, sched_addr, metrics_addr = start("services.scheduler", "--registry", registry_addr,
                                                                    "--metrics-port", "0", *flags, host=control)
                        procs.append(scheduler)
                        try:
                            await placements(sched_addr, metrics_addr, queries[:50], 4)  # warm-up
                            run: dict = {"pass": p}
                            run["quiet"] = await serial_and_concurrent(sched_addr, metrics_addr, queries,
                                                                       args.placements // 2)
                            async with Traffic(registry_addr, workers_file, event_rate, p, traffic_host) as traffic:
                                run["with_traffic"] = await serial_and_concurrent(sched_addr, metrics_addr, queries,
                                                                                  args.placements // 2)
                            run["with_traffic"]["background"] = traffic.sent
                        finally:
                            scheduler.terminate()
                            scheduler.wait(timeout=30)
                            procs.remove(scheduler)
                        runs.setdefault(variant, []).append(run)
                        print(f"{variant} pass {p}: {runs[variant][-1]}", file=sys.stderr, flush=True)
                report["placement"] = {"event_rate_asked": round(event_rate, 1), "runs": runs}
            report["cluster_lookup_ms"] = await cluster_lookup(r, chains, Path(tmp), args.lookups) \
                if control is None else None
            print(f"cluster: {report['cluster_lookup_ms']}", file=sys.stderr, flush=True)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=30)
            await r.aclose()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--blocks-per-worker", type=int, default=10_000)
    ap.add_argument("--seconds", type=float, default=15.0, help="each sustained-events run")
    ap.add_argument("--event-share", type=float, default=0.25,
                    help="background KV events during placement, as a share of the sustained rate measured")
    ap.add_argument("--placements", type=int, default=1000, help="per condition per pass")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--lookups", type=int, default=1000, help="bitmap reads per layout (step 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hosts", action="store_true", help="the control services on one simulated host, the traffic "
                    "on another, this process outside both (root)")
    ap.add_argument("--link", default="unshaped", help="with --hosts: every host's link, RATE (1gbit, 10gbit)")
    ap.add_argument("--json-out", default=None, help="also write the report here (with the commit)")
    args = ap.parse_args()
    import uvloop
    write_report(uvloop.run(main_async(args)), args.json_out, args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
