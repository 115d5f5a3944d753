"""The one checker every chaos test uses, and the client that feeds it.

A request's stream is recorded as (attempt, index, token ids) deltas plus how it
ended. ``check`` asserts what Kervan promises under failure: every request ends
exactly once (finished, or failed with an intended status); delivered indices are
contiguous from 0 with no repeats; a finished greedy request equals its fault-free
tokens. Each test also proves its fault happened (``process_gone``) and that KV
blocks and Redis keys came back to baseline (``wait_baseline``)."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from control_plane.cli.client import build_request
from control_plane.cli.redis_server import redis_argv, wait_listening
from services.common.security import PLAINTEXT, MeshSecurity
from services.proto import router_pb2_grpc, runtime_pb2, runtime_pb2_grpc, worker_pb2, worker_pb2_grpc

# one report per run, emptied at its start (tests/conftest.py's pytest_configure)
REPORT = Path(os.environ.get("KERVAN_CHAOS_REPORT", "chaos-report.json"))


@dataclass
class Outcome:
    deltas: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (attempt, index, token ids)
    finished: int = 0  # Finished messages seen
    status: grpc.StatusCode | None = None  # set when the call failed
    details: str = ""
    first_token_after: dict[int, float] = field(default_factory=dict)  # attempt -> monotonic time of its first token
    seconds: float = 0.0  # from the call to its end

    @property
    def tokens(self) -> list[int]:
        return [t for _, _, ids in self.deltas for t in ids]


async def stream(address: str, prompt: list[int], max_tokens: int, on_delta=None, timeout: float = 120,
                 security: MeshSecurity = PLAINTEXT, **sampling) -> Outcome:
    out = Outcome()
    t0 = time.monotonic()
    async with security.channel(address) as channel:
        call = router_pb2_grpc.RouterServiceStub(channel).Generate(build_request(
            token_ids=prompt, max_tokens=max_tokens, temperature=sampling.pop("temperature", 0.0), ignore_eos=True,
            **sampling), timeout=timeout)
        try:
            async for msg in call:
                if msg.WhichOneof("kind") == "delta":
                    d = msg.delta
                    out.first_token_after.setdefault(d.attempt, time.monotonic())
                    out.deltas.append((d.attempt, d.index, list(d.token_ids)))
                    if on_delta is not None:
                        await on_delta(out)
                else:
                    out.finished += 1
        except grpc.aio.AioRpcError as err:
            out.status, out.details = err.code(), err.details() or ""
    out.seconds = time.monotonic() - t0
    return out


def check(outcomes: list[Outcome], expected: list[list[int]] | None = None,
          allowed: tuple[grpc.StatusCode, ...] = ()) -> dict:
    """Asserts the promises; returns counts for the report."""
    counts = {"sent": len(outcomes), "completed": 0, "migrated": 0, "failed_as_intended": 0, "lost": 0,
              "duplicate_tokens": 0}
    for k, out in enumerate(outcomes):
        indices = [i for _, start, ids in out.deltas for i in range(start, start + len(ids))]
        counts["duplicate_tokens"] += len(indices) - len(set(indices))
        assert indices == list(range(len(indices))), f"request {k}: deltas {out.deltas[:30]}... not contiguous"
        if out.status is None:
            assert out.finished == 1, f"request {k} ended {out.finished} times"
            counts["completed"] += 1
            counts["migrated"] += any(a > 0 for a, _, _ in out.deltas)
            if expected is not None:
                assert out.tokens == expected[k], f"request {k}: output differs from the fault-free run"
        elif out.status in allowed:
            assert out.details, f"request {k}: {out.status.name} without a message"
            counts["failed_as_intended"] += 1
        else:
            counts["lost"] += 1
    failures = [(o.status, o.details) for o in outcomes if o.status]
    assert counts["lost"] == 0 and counts["duplicate_tokens"] == 0, (counts, failures)
    return counts


def process_gone(proc, timeout: float = 10.0) -> None:
    proc.wait(timeout=timeout)
    assert proc.poll() is not None and not Path(f"/proc/{proc.pid}").exists()


async def streams_decoding_on(router: str, worker: str, prompts: list[list[int]], max_tokens: int,
                              timeout: float, security: MeshSecurity = PLAINTEXT) -> list[asyncio.Task]:
    """Start one stream per prompt and return once every client holds a token and
    ``worker`` (HOST:PORT, asked directly) runs a stream past its prefill: the moment a
    fault on that worker hits streams that already delivered tokens."""
    tasks, _ = await streams_decoding_on_one_of(router, [worker], prompts, max_tokens, timeout, security=security)
    return tasks


async def streams_decoding_on_one_of(router: str, workers: list[str], prompts: list[list[int]], max_tokens: int,
                                     timeout: float, tries: int = 3, security: MeshSecurity = PLAINTEXT
                                     ) -> tuple[list[asyncio.Task], str]:
    """As ``streams_decoding_on``, for whichever of ``workers`` is first seen running a stream
    past its prefill (all asked at once, so neither the placement nor a fast decode of the
    streams one worker got decides whether the test can go on); returns the tasks and that worker.
    When none is (placement gave them few enough streams to finish before the last client held
    its token), those streams run to their end and new ones are started, ``tries`` times in all."""
    for _ in range(tries):
        tasks, worker = await _streams_and_one_running(router, workers, prompts, max_tokens, timeout, security)
        if worker is not None:
            return tasks, worker
        await asyncio.gather(*tasks)
    raise AssertionError(f"no stream was placed on {' or '.join(workers)} ({tries} tries)")


async def _streams_and_one_running(router: str, workers: list[str], prompts: list[list[int]], max_tokens: int,
                                   timeout: float, security: MeshSecurity) -> tuple[list[asyncio.Task], str | None]:
    started = [asyncio.Event() for _ in prompts]

    def first_token(k):
        async def on_delta(out):
            started[k].set()
        return on_delta
    tasks = [asyncio.create_task(stream(router, p, max_tokens, on_delta=first_token(k), timeout=timeout,
                                        security=security)) for k, p in enumerate(prompts)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    channels = [security.channel(w, role="worker") for w in workers]
    try:
        stubs = [worker_pb2_grpc.WorkerServiceStub(ch) for ch in channels]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(t.done() for t in tasks):
            replies = await asyncio.gather(*(s.GetLoad(worker_pb2.GetLoadRequest()) for s in stubs))
            running = [(reply.load.num_waiting, worker) for worker, reply in zip(workers, replies)
                       if reply.load.num_running and not reply.load.num_prefill_tokens]
            if running:  # the one with streams queued behind its running one, if any: more to hit
                return tasks, max(running)[1]
            await asyncio.sleep(0.01)
    finally:
        await asyncio.gather(*(ch.close() for ch in channels))
    return tasks, None


def restart_redis(cluster) -> None:
    """Kill the cluster's private Redis and start an empty one on the same port; it keeps its
    place among the cluster's processes (Redis is stopped last)."""
    cluster.procs["redis"].kill()
    cluster.procs["redis"].wait()
    port = int(cluster.addresses["redis"].rsplit(":", 1)[1])
    with open(cluster.log_dir / "redis-restarted.log", "ab") as log:
        cluster.procs["redis"] = subprocess.Popen(redis_argv(port, cluster.log_dir, cluster.redis_password), stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True)
    wait_listening(port, cluster.procs["redis"])


async def wait_baseline(cluster, workers: list[str], redis_url: str | None = None, timeout: float = 20.0) -> None:
    """Every listed worker idle with all blocks free; exactly these workers registered,
    nothing in Redis that is not theirs: no lease, ownership hash, event sequence,
    slot, block bit or unknown mark of a dead worker (``redis_leftovers``); and no KV
    segment in /dev/shm from any process the cluster started (``shm_leftovers``)."""
    import redis.asyncio as redis

    from services.proto import kv_registry_pb2, kv_registry_pb2_grpc
    redis_url = redis_url or cluster.redis_url
    deadline = time.monotonic() + timeout
    while True:
        loads = []
        for w in workers:
            async with cluster.client_security.channel(cluster.addresses[w], role="worker") as ch:
                loads.append((await worker_pb2_grpc.WorkerServiceStub(ch).GetLoad(worker_pb2.GetLoadRequest())).load)
        async with cluster.client_security.channel(cluster.addresses["kv-registry"], role="kv-registry") as ch:
            registry = kv_registry_pb2_grpc.KvRegistryServiceStub(ch)
            # what the lease watch does every second, for the moments a test has it dead or starved
            await registry.PurgeExpired(kv_registry_pb2.PurgeExpiredRequest())
            listed = await registry.ListWorkers(kv_registry_pb2.ListWorkersRequest())
        leftovers = []
        if redis_url:
            r = redis.Redis.from_url(redis_url)
            leftovers = await redis_leftovers(r, {w.info.worker_id for w in listed.workers})
            await r.aclose()
        leftovers += shm_leftovers(cluster)
        idle = all(x.num_running == x.num_waiting == 0 and x.num_free_blocks == x.num_blocks for x in loads)
        if idle and not leftovers and len(listed.workers) == len(workers):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not back to baseline: loads {loads}, listed "
                                 f"{[w.info.address for w in listed.workers]}, leftovers {leftovers[:10]}")
        await asyncio.sleep(0.1)


def shm_leftovers(cluster) -> list[str]:
    """KV segments (named ``kervan-kv-<creator pid>-...``) made by any process the cluster
    started, dead ones included (their pids are remembered in ``cluster.pids``)."""
    from services.worker.kv_transfer import SHM_DIR, SHM_PREFIX
    pids = {str(p) for p in cluster.pids}
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return [f"{SHM_DIR}/{n}" for n in names
            if n.startswith(SHM_PREFIX) and n.removeprefix(SHM_PREFIX).split("-", 1)[0] in pids]


KNOWN_KEYS = ("kervan:workers", "kervan:slots", "kervan:slotsv", "kervan:unknown", "kervan:generation",
              "kervan:fence", "kervan:tiered")


async def redis_leftovers(r, live: set[str]) -> list[str]:
    """Redis state that belongs to no live worker (``services/kv_registry/index.py`` names
    every key); empty when the registry has purged every dead worker completely."""
    out = []
    registered = {m.decode() for m in await r.smembers("kervan:workers")}
    if registered != live:
        out.append(f"kervan:workers {sorted(registered)} != live {sorted(live)}")
    slots = {k.decode(): int(v) for k, v in (await r.hgetall("kervan:slots")).items()}
    out += [f"slot of {w}" for w in slots if w not in live]
    out += [f"unknown mark of {w.decode()}" for w in await r.smembers("kervan:unknown") if w.decode() not in live]
    out += [f"tiered mark of {w.decode()}" for w in await r.smembers("kervan:tiered") if w.decode() not in live]
    live_bits = {slots[w] for w in live if w in slots}
    for key in await r.keys("kervan:*"):
        key = key.decode()
        kind, _, owner = key[len("kervan:"):].partition(":")
        if key in KNOWN_KEYS:
            continue
        if kind in ("w", "own", "seq"):
            if owner not in live:
                out.append(key)
        elif kind == "cert":  # TLS meshes: the worker id a certificate registered at an address
            if (await r.get(key) or b"").decode() not in live:
                out.append(key)
        elif kind == "blk":
            raw = await r.get(key) or b""  # SETBIT offset 0 is the first byte's highest bit
            owners = {i for i in range(8 * len(raw)) if raw[i // 8] >> (7 - i % 8) & 1}
            if not owners or owners - live_bits:
                out.append(f"{key} bits {sorted(owners)}")
        else:
            out.append(key)
    return out


async def runtime(cluster, names) -> dict[str, runtime_pb2.GetRuntimeStatsResponse]:
    """Each named service's live counts (RSS, fds, threads, asyncio tasks)."""
    out = {}
    for name in names:
        async with grpc.aio.insecure_channel(cluster.addresses[name]) as ch:
            out[name] = await runtime_pb2_grpc.RuntimeServiceStub(ch).GetRuntimeStats(
                runtime_pb2.GetRuntimeStatsRequest())
    return out


def open_fds(pid: int) -> list[str]:
    """What a process holds open: files by path, TCP sockets as local->remote port
    (the evidence to read when a file-descriptor count grows)."""
    tcp = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            tcp[cols[9]] = f"tcp {int(cols[1].rsplit(':', 1)[1], 16)}->{int(cols[2].rsplit(':', 1)[1], 16)}"
    out = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        inode = target[len("socket:["):-1] if target.startswith("socket:[") else None
        out.append(tcp.get(inode, target) if inode else target)
    return sorted(out)


def record(test: str, fault: str, counts: dict, fault_to_first_token_s: float | None = None) -> None:
    """Add one scenario to the chaos report (a JSON file; CI keeps the last run's). Test
    processes running side by side (pytest-xdist) take turns under a lock."""
    with open(REPORT.with_name(REPORT.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        report = json.loads(REPORT.read_text()) if REPORT.exists() else {"scenarios": {}}
        report["scenarios"][test] = {"fault": fault, **counts,
                                     "fault_to_first_token_on_new_worker_s": fault_to_first_token_s}
        totals = {k: sum(s[k] for s in report["scenarios"].values())
                  for k in ("sent", "completed", "migrated", "failed_as_intended", "lost", "duplicate_tokens")}
        report["totals"] = totals
        REPORT.write_text(json.dumps(report, indent=2))
