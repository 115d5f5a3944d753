"""Workers joining and leaving a running mesh of real processes while traffic flows."""

from __future__ import annotations

import asyncio

from control_plane.cli.launcher import Cluster, ClusterSpec
from kervan.engine_args import EngineArgs
from tests.cluster_helpers import complete, scheduler_dry_run, scheduler_stats
from tests.conftest import make_prompts


def test_workers_join_and_leave_while_requests_flow(llama, tmp_path):
    cluster = Cluster(ClusterSpec(llama[1], num_prefill=0, num_decode=0, num_both=1,
                                  engine=EngineArgs(dtype="float32", num_kv_blocks=256)), tmp_path)
    cluster.start(timeout=240)
    try:
        # enough that the clients never run out before the newcomer has served 8 alone (300 ran out
        # once on a loaded machine while the first worker drained: the last wait could never end)
        prompts = make_prompts([20 + i % 13 for i in range(2000)], seed=50)

        async def traffic():
            outs, done = [], asyncio.Event()

            async def client(k):  # closed loop, bounded by the prompt list
                for prompt in prompts[k::4]:
                    if done.is_set():
                        return
                    outs.append(await complete(cluster, 120, token_ids=prompt, max_tokens=6, temperature=0.0,
                                               ignore_eos=True))

            async def until(predicate):
                for _ in range(1200):
                    ok = predicate()
                    if ok if not asyncio.iscoroutine(ok) else await ok:
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError("condition not reached")

            clients = [asyncio.create_task(client(k)) for k in range(4)]
            await until(lambda: len(outs) >= 4)
            name = await asyncio.to_thread(cluster.add_worker, "both")  # joins mid-traffic
            joined = f"both@{cluster.addresses[name]}"  # worker ids are role@address

            async def chosen():
                return (await scheduler_stats(cluster)).by_worker.get(joined, 0) > 0
            await until(chosen)
            code = await asyncio.to_thread(cluster.stop_process, "both-0")  # drains mid-traffic
            settled = len(outs)
            await until(lambda: len(outs) >= settled + 8)  # served by the newcomer alone
            done.set()
            await asyncio.gather(*clients)
            return outs, code

        outs, code = asyncio.run(traffic())
        assert code == 0  # drained cleanly
        assert [len(o.token_ids) for o in outs] == [6] * len(outs)
        assert all(o.finish_reason == "length" for o in outs)
        s = asyncio.run(scheduler_stats(cluster))
        assert s.placements >= len(outs) and set(s.by_worker) == {
            f"both@{cluster.addresses['both-0']}", f"both@{cluster.addresses['both-1']}"}

        async def dry_run():  # answers without counting; only the remaining worker is a candidate
            return await scheduler_dry_run(cluster, prompts[0]), await scheduler_stats(cluster)

        placed, after = asyncio.run(dry_run())
        assert placed.decode_address == cluster.addresses["both-1"] and placed.prefill_reason == "aggregated"
        assert list(placed.scores) == [f"both@{cluster.addresses['both-1']}"]
        assert after.placements == s.placements
    finally:
        cluster.stop()


def test_a_block_size_other_than_16_reaches_every_process(llama, tmp_path):
    """The registry checks and the workers cache blocks of the launcher's ``block_size``, and
    the router, given none, hashes with the size the registry answers (through the scheduler)."""
    cluster = Cluster(ClusterSpec(llama[1], num_prefill=0, num_decode=0, num_both=1,
                                  engine=EngineArgs(dtype="float32", num_kv_blocks=256, block_size=8)), tmp_path)
    cluster.start(timeout=240)
    try:
        prompt = make_prompts([30], seed=51)[0]

        async def twice():
            first = await complete(cluster, token_ids=prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
            for _ in range(100):  # its 3 full blocks of 8 reach the registry
                if (await scheduler_dry_run(cluster, prompt, 8)).cached_blocks == 3:
                    break
                await asyncio.sleep(0.05)
            second = await complete(cluster, token_ids=prompt[:27] + [5], max_tokens=4, temperature=0.0,
                                    ignore_eos=True)
            return first, second

        first, second = asyncio.run(twice())
        assert first.finish_reason == "length" and second.usage["cached_prompt_tokens"] == 24  # 3 blocks of 8
    finally:
        cluster.stop()
