"""The fleet's background traffic for ``benchmarks.fleet``: every simulated worker's heartbeat
once a second and KV events at a given rate, sent to a kv-registry.

It runs as its own process (``python -m benchmarks.fleet_traffic``), at a lower CPU priority
(``nice``) than the control plane: the workers it stands for run on their own machines, so
their side of the traffic (building the calls, reading the answers) must not share the
measuring client's event loop, nor outrank the registry, Redis and the scheduler for this
machine's cores. The registry and Redis still serve every call, at their normal priority.
The process sends until SIGTERM (or ``--seconds``), then prints what it sent as one JSON line.

    python -m benchmarks.fleet_traffic --registry HOST:PORT --workers FILE --event-rate 1850
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import time
from pathlib import Path

import grpc

from kervan.kv_events import BlockRemoved, BlockStored
from services.common.convert import event_to_proto, load_to_proto
from services.common.load import Load
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc

NICE = 10  # the traffic process's niceness: below the control plane it loads


def fleet_load(rng: random.Random) -> Load:
    return Load(num_running=rng.randint(0, 8), num_free_blocks=rng.randint(0, 4096), num_blocks=4096,
                num_requests=rng.randint(0, 8), max_requests=64)


class Publisher:
    """Simulated workers' KV events: 16 fresh blocks stored, then removed, per call."""

    def __init__(self, stub, workers: list[tuple[str, str]], rng: random.Random):
        self.stub, self.workers, self.rng = stub, workers, rng
        self.seqs = {wid: 1 for wid, _ in workers}
        self.events = 0

    async def publish(self, k: int) -> None:
        wid, token = self.workers[k % len(self.workers)]
        blocks = [self.rng.randbytes(32) for _ in range(16)]
        seq = self.seqs[wid]
        self.seqs[wid] = seq + 2
        events = [BlockStored(seq + 1, blocks, None, [], 16), BlockRemoved(seq + 2, blocks)]
        await self.stub.PublishEvents(kv_registry_pb2.PublishEventsRequest(
            worker_id=wid, incarnation=token, events=[event_to_proto(e) for e in events]), timeout=30)
        self.events += 2


async def open_loop(call, rate: float, stop: asyncio.Event, max_in_flight: int = 256) -> dict:
    """``call(k)`` at ``rate`` per second until ``stop``, none waiting for another, at most
    ``max_in_flight`` at once (an arrival finding them all busy is counted as missed, not
    queued: the load stays what was asked, never a backlog). Counts the calls that
    completed, failed (by status) and were missed."""
    counts: dict[str, int] = {"completed": 0, "missed": 0}
    tasks: set[asyncio.Task] = set()

    async def one(k: int) -> None:
        try:
            await call(k)
            counts["completed"] += 1
        except grpc.aio.AioRpcError as err:
            counts[err.code().name] = counts.get(err.code().name, 0) + 1
    start = time.monotonic()
    for k in range(10_000_000):  # bounded; ends at ``stop``
        if stop.is_set():
            break
        delay = start + k / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(tasks) >= max_in_flight:
            counts["missed"] += 1
            continue
        task = asyncio.create_task(one(k))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    return counts


async def traffic(registry_stub, workers, rng, event_rate: float, stop: asyncio.Event) -> dict:
    """Every worker's heartbeat once a second, and KV events at ``event_rate`` per second."""
    loads = [load_to_proto(fleet_load(rng)) for _ in range(64)]

    async def heartbeat(k: int) -> None:
        wid, token = workers[k % len(workers)]
        await registry_stub.Heartbeat(kv_registry_pb2.HeartbeatRequest(worker_id=wid, incarnation=token,
                                                                       load=loads[k % len(loads)]), timeout=30)
    publisher = Publisher(registry_stub, workers, rng)
    t0 = time.monotonic()
    beats, calls = await asyncio.gather(open_loop(heartbeat, len(workers), stop),
                                        open_loop(publisher.publish, event_rate / 2, stop))
    wall = time.monotonic() - t0
    return {"heartbeats_per_s": round(beats["completed"] / wall, 1), "events_per_s": round(publisher.events / wall, 1),
            "heartbeats": beats, "event_calls": calls}


async def serve_traffic(args) -> dict:
    workers = [tuple(w) for w in json.loads(Path(args.workers).read_text())]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.seconds:
        loop.call_later(args.seconds, stop.set)
    async with grpc.aio.insecure_channel(args.registry) as channel:
        stub = kv_registry_pb2_grpc.KvRegistryServiceStub(channel)
        return await traffic(stub, workers, random.Random(args.seed), args.event_rate, stop)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--registry", required=True, help="the kv-registry's HOST:PORT")
    ap.add_argument("--workers", required=True, help="a JSON file: [[worker_id, incarnation], ...]")
    ap.add_argument("--event-rate", type=float, required=True, help="KV events per second")
    ap.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: at SIGTERM)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import uvloop
    print(json.dumps(uvloop.run(serve_traffic(args))), flush=True)


if __name__ == "__main__":
    main()
