"""Chaos with KV tiers on: a worker whose pool, host tier and disk tier are all busy
(a pool of 32 blocks, a host tier of a few, a disk tier behind) is SIGKILLed mid-stream,
its streams migrate, and the launcher restarts it on the same disk directory. What the
killed process left on disk is indexed again and announced; revisits served from it give
the fault-free tokens (deterministic mode, the machine's own dtype), no block is refused
as corrupt, and the mesh returns to its baseline (nothing in Redis or /dev/shm of the dead
incarnation, its tier marks included)."""

from __future__ import annotations

import asyncio
import time

import grpc

from control_plane.cli.launcher import Cluster, ClusterSpec
from kervan.engine_args import EngineArgs
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc
from tests.chaos.checker import check, process_gone, record, stream, wait_baseline
from tests.chaos.test_worker_faults import after_a_few_tokens
from tests.conftest import EXACT_MESH, EXACT_REFERENCE, greedy_tokens, make_prompts
from tests.test_cluster import sample, scrape

MAX_TOKENS = 300


def test_a_worker_with_tiers_killed_mid_stream_comes_back_with_what_its_disk_holds(llama, tmp_path):
    cluster = Cluster(ClusterSpec(llama[1], num_prefill=0, num_decode=0, num_both=2,
                                  engine=EngineArgs(**EXACT_MESH, num_kv_blocks=32, kv_host_bytes=64 << 10,
                                                    kv_disk_dir=str(tmp_path / "disk"), kv_disk_bytes=8 << 20),
                                  metrics=True, router_args=("--stall-timeout-s", "3"), registry_args=("--ttl", "2")),
                      tmp_path)
    cluster.start(timeout=240)
    try:
        prompts = make_prompts([100, 101, 102, 103, 104, 105], seed=80)
        expected = greedy_tokens(llama[1], prompts, MAX_TOKENS, **EXACT_REFERENCE)

        async def fill():  # one at a time: each prompt's blocks pushed on down the tiers by the next
            return [await stream(cluster.router_address, p, MAX_TOKENS) for p in prompts]
        check(asyncio.run(fill()), expected)

        async def kill(proc):
            proc.kill()
        on_delta, faults = after_a_few_tokens(cluster, kill)

        async def revisit(first_with_fault: bool):
            tasks = [stream(cluster.router_address, p, MAX_TOKENS, on_delta=on_delta if first_with_fault and not k
                            else None) for k, p in enumerate(prompts[:4])]
            return await asyncio.gather(*tasks)
        outs = asyncio.run(revisit(True))
        killed = faults["worker"]
        process_gone(cluster.procs[killed])
        counts = check(outs, expected[:4])
        assert counts["completed"] == 4 and counts["migrated"] >= 1

        cluster.restart_crashed()  # schedules its restart after the back-off; a clock past it restarts it now
        assert cluster.restart_crashed(now=time.monotonic() + 3600) == [killed]  # on the same disk directory

        async def registered() -> None:
            log = cluster.log_dir / f"{killed}.log"
            async with grpc.aio.insecure_channel(cluster.addresses["kv-registry"]) as ch:
                stub = kv_registry_pb2_grpc.KvRegistryServiceStub(ch)
                for _ in range(600):  # the new process registers once the dead one's lease (2 s) ran out
                    # its log after the launcher's mark says it is ready (registered and serving)
                    ready = "worker ready on" in log.read_text().rpartition("--- exited with")[2]
                    listed = await stub.ListWorkers(kv_registry_pb2.ListWorkersRequest())
                    if ready and len(listed.workers) == 2:
                        return
                    await asyncio.sleep(0.1)
            raise AssertionError("the restarted worker never registered")
        asyncio.run(registered())
        found = sample(scrape(cluster.addresses[f"{killed}-metrics"]), "kervan_kv_disk_blocks")
        assert found > 0  # the dead process's disk, indexed again (and announced: the baseline below holds)

        async def again():
            return [await stream(cluster.router_address, p, MAX_TOKENS) for p in prompts]
        after = asyncio.run(again())
        check(after, expected)
        metrics = scrape(cluster.addresses[f"{killed}-metrics"])
        assert sample(metrics, "kervan_kv_disk_corrupt_blocks_total") == 0
        asyncio.run(wait_baseline(cluster, ["both-0", "both-1"]))
        record("tiers_worker_SIGKILL", f"SIGKILL to a worker streaming with host and disk tiers busy, restarted on "
                                       f"its disk ({found:.0f} blocks found there)", counts)
    finally:
        cluster.stop()
