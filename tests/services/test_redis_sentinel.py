"""Redis behind Sentinel, for real: a master, its replica and a Sentinel (the same
redis-server binary in sentinel mode). The registry's client finds the master through the
Sentinel, and after the master is SIGKILLed it writes to the promoted replica: Redis is
no single point of failure either."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from control_plane.cli.launcher import free_port
from control_plane.cli.redis_server import redis_server_binary, wait_listening
from kervan.sampling import RequestLimits
from kervan.worker_info import WorkerInfo, WorkerRole
from services.common import redis_url
from services.kv_registry.index import PrefixIndex


@pytest.fixture
def sentinel_set(tmp_path):
    """(sentinel URL, master process); every process stopped after."""
    master, replica, sentinel = free_port(), free_port(), free_port()
    # Redis 7 waits 5 s (repl-diskless-sync-delay) for more replicas before the first full sync
    common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--requirepass", "pw", "--masterauth", "pw",
              "--repl-diskless-sync-delay", "0"]
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"port {sentinel}\nbind 127.0.0.1\nsentinel monitor kervan 127.0.0.1 {master} 1\n"
                    f"sentinel auth-pass kervan pw\nsentinel down-after-milliseconds kervan 500\n"
                    f"sentinel failover-timeout kervan 5000\n")
    procs = []
    try:
        for argv, port in (([redis_server_binary(), "--port", str(master), *common, "--dir", str(tmp_path)], master),
                           ([redis_server_binary(), "--port", str(replica), *common, "--dir", str(tmp_path),
                             "--replicaof", "127.0.0.1", str(master)], replica),
                           ([redis_server_binary(), str(conf), "--sentinel"], sentinel)):
            procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            wait_listening(port, procs[-1])
        yield f"redis+sentinel://:pw@127.0.0.1:{sentinel}/kervan/0", procs[0], replica
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


async def test_the_registry_follows_the_master_sentinel_names_through_a_failover(sentinel_set):
    url, master, replica_port = sentinel_set
    client = redis_url.connect(url, timeout_s=2.0)
    index = PrefixIndex(client, ttl_s=120)  # no heartbeats here: the lease must outlast the failover
    record = WorkerInfo(worker_id="w", address="127.0.0.1:1", role=WorkerRole.DECODE, model="m", block_size=16,
                        hash_name="sha256", limits=RequestLimits(max_model_len=64, max_n=1))
    assert await index.register(record)
    replica = redis_url.connect(f"redis://:pw@127.0.0.1:{replica_port}/0")
    for _ in range(400):  # the replica has caught up
        if await replica.exists("kervan:workers"):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the replica never received the registration")
    master.kill()
    master.wait()
    for _ in range(300):  # Sentinel sees the master down (0.5 s) and promotes the replica
        try:
            await client.set("probe", "1")
            break
        except Exception:  # noqa: BLE001 (connection errors, read-only replica: not promoted yet)
            await asyncio.sleep(0.1)
    else:
        raise AssertionError("Sentinel never promoted the replica")
    assert [r.worker_id for r, _ in await index.live_workers()] == ["w"]  # the state survived the failover
    await replica.aclose()  # its connections were closed when it was promoted
    replica = redis_url.connect(f"redis://:pw@127.0.0.1:{replica_port}/0")
    assert (await replica.info("replication"))["role"] == "master"
    await client.aclose()
    await replica.aclose()


async def test_a_persistent_private_redis_keeps_its_state_across_a_restart(tmp_path):
    """``kervan up --redis-persistent``: an append-only file, so a Redis restart does not
    start a new generation (every worker re-registering and re-sending its blocks)."""
    from control_plane.cli.redis_server import redis_argv
    port = free_port()
    for attempt in range(2):
        proc = subprocess.Popen(redis_argv(port, tmp_path, "pw", persistent=True), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            wait_listening(port, proc)
            client = redis_url.connect(f"redis://:pw@127.0.0.1:{port}/0")
            if attempt == 0:
                await client.set("kervan:generation", "g1")
            else:
                assert await client.get("kervan:generation") == b"g1"
            await client.aclose()
        finally:
            proc.terminate()
            proc.wait()
