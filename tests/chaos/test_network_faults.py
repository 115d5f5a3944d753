"""Chaos: the connection between router and a worker reset or blackholed by a fault
proxy (the worker advertises the proxy's address), while streams run on it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from control_plane.cli.launcher import Cluster, ClusterSpec, free_port
from kervan.engine_args import EngineArgs
from tests.chaos.checker import check, record, streams_decoding_on, wait_baseline
from tests.chaos.fault_proxy import FaultProxy
from tests.conftest import EXACT_MESH, EXACT_REFERENCE, greedy_tokens, make_prompts


class ProxyThread:
    """The proxy on an event loop of its own, so it outlives each asyncio.run here."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro_or_fn):
        if asyncio.iscoroutine(coro_or_fn):
            return asyncio.run_coroutine_threadsafe(coro_or_fn, self.loop).result(10)
        return self.loop.call_soon_threadsafe(coro_or_fn)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


MAX_TOKENS = 400  # long enough that every stream still runs when the fault comes


# a reset is seen at once; a blackhole only by HTTP/2 keepalive pings going unanswered
# (about 4 s): the stall watchdog is set far beyond the clients' 30 s deadline, so a
# keepalive that is off or slow (gRPC's default ping timeout is 60 s) leaves the streams
# hanging until they fail DEADLINE_EXCEEDED
@pytest.mark.parametrize("fault", ["reset", "blackhole"])
def test_a_worker_cut_off_by_the_network_is_migrated_away_from(llama, tmp_path, fault):
    cluster = Cluster(ClusterSpec(llama[1], num_prefill=0, num_decode=0, num_both=1,
                                  engine=EngineArgs(**EXACT_MESH, num_kv_blocks=256),
                                  router_args=("--stall-timeout-s", "600")), tmp_path)
    cluster.start(timeout=240)
    proxies = ProxyThread()
    try:
        port = free_port()
        proxy = proxies.call(FaultProxy(port).start())
        # both-1 listens on `port` and is reached only through the proxy
        cluster._start("both-1", "services.worker", "--role", "both", "--model", str(llama[1]), "--registry",
                       cluster.addresses["kv-registry"], "--dtype", "auto", "--deterministic", "--num-kv-blocks", "256",
                       "--advertise-address", f"127.0.0.1:{proxy.port}", port=port)
        cluster._wait_serving(["both-1"], 240)
        prompts = make_prompts([20, 21, 22, 23], seed=100)
        expected = greedy_tokens(llama[1], prompts, MAX_TOKENS, **EXACT_REFERENCE)

        async def run():
            # checked right before the fault, after every client has tokens: a stream finished early
            # (a slow first token elsewhere) cannot leave both-1 idle
            tasks = await streams_decoding_on(cluster.router_address, f"127.0.0.1:{port}", prompts, MAX_TOKENS, 30)
            at = time.monotonic()
            if fault == "reset":
                proxies.call(proxy.reset)
            else:
                proxy.mode = "blackhole"
            return await asyncio.gather(*tasks), at

        outs, at = asyncio.run(run())
        counts = check(outs, expected)
        assert counts["completed"] == 4 and counts["migrated"] >= 1, counts
        asyncio.run(wait_baseline(cluster, ["both-0", "both-1"], timeout=60))
        moved = [o.first_token_after[1] for o in outs if 1 in o.first_token_after]
        record(f"network_{fault}", f"router-to-worker connections {fault} by a proxy mid-stream", counts,
               round(min(moved) - at, 3))
    finally:
        cluster.stop()
        proxies.call(proxy.stop()) if "proxy" in locals() else None
        proxies.close()
