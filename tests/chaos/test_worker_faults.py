"""Chaos: decode workers killed or stopped while they stream (real processes)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from control_plane.cli.launcher import Cluster, ClusterSpec
from kervan.block_hash import hash_blocks
from kervan.engine_args import EngineArgs
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.chaos.checker import check, process_gone, record, stream, wait_baseline
from tests.conftest import EXACT_MESH, EXACT_REFERENCE, greedy_tokens, make_prompts, other_dtype

MAX_TOKENS = 400  # long enough to still run while the test finds its worker


def start(llama, tmp_path, *router_args, dtype: str = "auto") -> Cluster:
    cluster = Cluster(ClusterSpec(llama[1], num_prefill=0, num_decode=0, num_both=2,
                                  engine=EngineArgs(**dict(EXACT_MESH, dtype=dtype), num_kv_blocks=256),
                                  router_args=router_args, registry_args=("--ttl", "2")), tmp_path)
    cluster.start(timeout=240)
    for name in ("both-0", "both-1"):  # ClusterSpec(deterministic=True) reached every engine
        assert ", deterministic" in (cluster.log_dir / f"{name}.log").read_text()
    return cluster


async def busy_worker(cluster) -> str | None:
    """The worker running the request: both asked at once, as the stream goes on meanwhile
    (on a loaded machine, asking one after the other let a short request end first). Of two
    running streams, the one with more queued behind it: a fault there always finds work not
    yet done (a running stream alone may end between this answer and the fault). None when
    neither runs one: the request ended before the client read its first tokens."""
    async def load(name: str):
        async with grpc.aio.insecure_channel(cluster.addresses[name]) as ch:
            return (await worker_pb2_grpc.WorkerServiceStub(ch).GetLoad(worker_pb2.GetLoadRequest())).load
    names = ("both-0", "both-1")
    loads = dict(zip(names, await asyncio.gather(*(load(n) for n in names))))
    running = [n for n in names if loads[n].num_running]
    return max(running, key=lambda n: loads[n].num_waiting) if running else None


def after_a_few_tokens(cluster, fault, n: int = 5):
    """An on_delta callback that, once ``n`` tokens arrived, applies ``fault(proc)`` (once)
    to the worker streaming; the returned dict then holds its name and the time, or
    ``missed`` when no worker was running the request any more."""
    done: dict = {}

    async def on_delta(out):
        if len(out.tokens) >= n and not done:
            name = await busy_worker(cluster)
            if name is None:
                done["missed"] = True
                return
            done.update(worker=name, at=time.monotonic())
            await fault(cluster.procs[name])
    return on_delta, done


def stream_with_fault(cluster, prompt, fault, tries: int = 3):
    """``stream`` with ``fault`` applied to the worker streaming after a few tokens: (outcome,
    what ``after_a_few_tokens`` recorded). A client starved of the CPU may read its fifth token
    only after the worker made all of them; nothing was left to fault, so the prompt is sent
    again, at most ``tries`` times in all."""
    for _ in range(tries):
        on_delta, done = after_a_few_tokens(cluster, fault)
        out = asyncio.run(stream(cluster.router_address, prompt, MAX_TOKENS, on_delta=on_delta))
        if not done.get("missed"):
            return out, done
    raise AssertionError(f"the request ended before the client read 5 tokens, {tries} times: nothing to fault")


async def registry_match(cluster, prompt) -> kv_registry_pb2.MatchResponse:
    async with grpc.aio.insecure_channel(cluster.addresses["kv-registry"]) as ch:
        return await kv_registry_pb2_grpc.KvRegistryServiceStub(ch).Match(
            kv_registry_pb2.MatchRequest(block_hashes=hash_blocks(prompt, 16)))


def fault_free(llama, prompt, max_tokens=MAX_TOKENS, dtype: str = "auto") -> list[int]:
    return greedy_tokens(llama[1], [prompt], max_tokens, **dict(EXACT_REFERENCE, dtype=dtype))[0]


@pytest.mark.parametrize("dtype", ["auto", other_dtype()])
def test_a_decode_worker_killed_mid_stream_is_migrated(llama, tmp_path, dtype):
    """In the dtype ``auto`` picks and in the other one: the migrated stream's greedy tokens
    are the fault-free engine's, bit for bit, in either."""
    cluster = start(llama, tmp_path, "--stall-timeout-s", "3", dtype=dtype)
    try:
        prompt = make_prompts([20], seed=70)[0]

        async def kill(proc):
            proc.kill()
        out, faults = stream_with_fault(cluster, prompt, kill)
        process_gone(cluster.procs.pop(faults["worker"]))
        counts = check([out], [fault_free(llama, prompt, dtype=dtype)])
        assert counts["migrated"] == 1 and max(a for a, _, _ in out.deltas) == 1
        survivor = "both-1" if faults["worker"] == "both-0" else "both-0"
        asyncio.run(wait_baseline(cluster, [survivor]))
        record(f"decode_worker_SIGKILL_{dtype}", f"SIGKILL to the worker streaming, after 5 tokens ({dtype})", counts,
               round(out.first_token_after[1] - faults["at"], 3))
    finally:
        cluster.stop()


def test_a_decode_worker_told_to_stop_mid_stream_drains_it_where_it_is(llama, tmp_path):
    """SIGTERM: the worker leaves the mesh (health NOT_SERVING, deregistered) and finishes
    the request it streams; nothing is migrated; it exits 0."""
    cluster = start(llama, tmp_path, "--stall-timeout-s", "3")
    try:
        prompt = make_prompts([20], seed=70)[0]
        seen = {}

        async def terminate(proc):
            name = [n for n, p in cluster.procs.items() if p is proc][0]
            async with grpc.aio.insecure_channel(cluster.addresses[name]) as ch:
                watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                proc.terminate()
                # draining: the health service says so while the stream goes on
                seen["not_serving"] = (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
                watch.cancel()
        out, faults = stream_with_fault(cluster, prompt, terminate)
        proc = cluster.procs.pop(faults["worker"])
        assert proc.wait(timeout=30) == 0 and seen == {"not_serving": True}
        counts = check([out], [fault_free(llama, prompt)])
        assert counts["migrated"] == 0 and {a for a, _, _ in out.deltas} == {0}
        survivor = "both-1" if faults["worker"] == "both-0" else "both-0"
        asyncio.run(wait_baseline(cluster, [survivor]))
        record("decode_worker_SIGTERM", "SIGTERM to the worker streaming, after 5 tokens: drained", counts)
    finally:
        cluster.stop()


def test_without_migration_a_lost_worker_ends_the_stream_unavailable(llama, tmp_path):
    cluster = start(llama, tmp_path, "--max-migrations", "0")
    try:
        prompt = make_prompts([20], seed=71)[0]

        async def kill(proc):
            proc.kill()
        out, killed = stream_with_fault(cluster, prompt, kill)
        process_gone(cluster.procs.pop(killed["worker"]))
        # a clear error, never a hang (that would end DEADLINE_EXCEEDED, at the client's 120 s)
        assert out.status == grpc.StatusCode.UNAVAILABLE and "migration limit (0)" in out.details
        counts = check([out], allowed=(grpc.StatusCode.UNAVAILABLE,))
        assert counts["failed_as_intended"] == 1
        record("decode_worker_SIGKILL_no_migration", "SIGKILL with --max-migrations 0", counts)
    finally:
        cluster.stop()


def test_a_stopped_decode_worker_is_left_behind_and_its_late_tokens_never_arrive(llama, tmp_path):
    cluster = start(llama, tmp_path, "--stall-timeout-s", "2")
    try:
        prompt = make_prompts([20], seed=72)[0]

        async def stop(proc):
            os.kill(proc.pid, signal.SIGSTOP)
            for _ in range(100):  # the fault happened: the process is stopped (delivery is asynchronous)
                if open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T":
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the worker did not stop")
            waker = threading.Timer(4.0, os.kill, (proc.pid, signal.SIGCONT))  # past its 2 s lease
            waker.start()
            wakers.append(waker)
        wakers: list[threading.Timer] = []
        out, stopped = stream_with_fault(cluster, prompt, stop)
        counts = check([out], [fault_free(llama, prompt)])
        assert counts["migrated"] == 1
        wakers[0].join()  # the zombie is awake again
        # it rejoins as a fresh registration; its old stream was cancelled by the router, and
        # its KV for it is freed: both workers idle, both registered
        asyncio.run(wait_baseline(cluster, ["both-0", "both-1"]))
        zombie = f"both@{cluster.addresses[stopped['worker']]}"

        async def rejoined():  # its lease expired: declared dead, registered again, its blocks sent again
            for _ in range(100):
                match = await registry_match(cluster, prompt)
                worker_log = (cluster.log_dir / f"{stopped['worker']}.log").read_text()
                if match.matched_blocks.get(zombie, 0) >= 1 and zombie not in match.unknown_workers \
                        and "registering again" in worker_log and "sent a full dump" in worker_log:
                    return
                await asyncio.sleep(0.1)
            raise AssertionError(f"{zombie} did not rejoin with its blocks: {match}, {worker_log[-2000:]}")
        assert f"worker {zombie} declared dead" in (cluster.log_dir / "control-plane.log").read_text()
        asyncio.run(rejoined())
        record("decode_worker_SIGSTOP", "SIGSTOP past the lease, SIGCONT 4 s later", counts,
               round(out.first_token_after[1] - stopped["at"], 3))
    finally:
        cluster.stop()


def test_a_prefill_worker_killed_during_the_handoff_is_replaced_by_local_prefill(llama, tmp_path):
    cluster = Cluster(ClusterSpec(llama[1], num_prefill=1, num_decode=1,
                                  engine=EngineArgs(**EXACT_MESH, num_kv_blocks=256),
                                  registry_args=("--ttl", "2")), tmp_path)
    cluster.start(timeout=240)
    try:
        prompt = make_prompts([480], seed=73)[0]  # 30 blocks: prefilled remotely, KV pushed

        async def run():
            async def kill_when_it_has_the_request():
                async with grpc.aio.insecure_channel(cluster.addresses["prefill-0"]) as ch:
                    stub = worker_pb2_grpc.WorkerServiceStub(ch)
                    for _ in range(20000):  # bounded: the request reaches it within seconds
                        load = (await stub.GetLoad(worker_pb2.GetLoadRequest())).load
                        if load.num_requests or load.num_free_blocks < load.num_blocks:
                            cluster.procs["prefill-0"].kill()
                            return time.monotonic()
                        await asyncio.sleep(0.001)
                    raise AssertionError("the request never reached the prefill worker")

            killer = asyncio.create_task(kill_when_it_has_the_request())
            out = await stream(cluster.router_address, prompt, 16)
            return out, await killer

        out, killed_at = asyncio.run(run())
        process_gone(cluster.procs.pop("prefill-0"))
        counts = check([out], [fault_free(llama, prompt, 16)])
        asyncio.run(wait_baseline(cluster, ["decode-0"]))
        record("prefill_worker_SIGKILL_in_handoff", "SIGKILL to the prefill worker holding the request", counts,
               round(out.first_token_after[0] - killed_at, 3))
    finally:
        cluster.stop()
