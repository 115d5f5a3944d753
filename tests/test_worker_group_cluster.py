"""Worker groups in a real cluster (`kervan up --tensor-parallel 2`, and two pipeline
stages): what cannot work is refused before anything starts; a group registers as
one worker and serves exactly what one process does, aggregated or as the prefill
and decode pools (KV handed from one group to another); when its rank 1 is killed
mid-stream the whole group leaves the mesh at once and its requests move to the
other worker."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from control_plane.cli.launcher import Cluster, ClusterSpec
from kervan.engine_args import EngineArgs
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc
from tests.chaos.checker import check, streams_decoding_on
from tests.cluster_helpers import complete, scheduler_stats
from tests.conftest import greedy_tokens, make_prompts

MAX_TOKENS = 300


def peers(pid: int) -> list[int]:
    """The worker group ranks a worker process started."""
    kids = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [k for k in kids if b"worker.parallel.peer" in Path(f"/proc/{k}/cmdline").read_bytes()]


def test_groups_that_cannot_work_are_refused_before_anything_starts(llama):
    with pytest.raises(ValueError, match="expert_parallel_size 2 needs a mixture-of-experts model"):
        ClusterSpec(llama[1], num_prefill=1, num_decode=1, engine=EngineArgs(expert_parallel_size=2))
    out = subprocess.run([sys.executable, "-m", "services.worker", "--model", str(llama[1]),
                          "--pipeline-parallel", "3"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "pipeline" in out.stderr and "exceeds" in out.stderr, out.stderr[-500:]


def test_prefill_and_decode_pools_of_groups_hand_kv_between_them(llama, tmp_path):
    cluster = Cluster(ClusterSpec(llama[1], num_prefill=1, num_decode=1,
                                  engine=EngineArgs(tensor_parallel_size=2, dtype="float32", num_kv_blocks=256),
                                  scheduler_args=("--min-remote-prefill-blocks", "1")),
                      tmp_path)
    cluster.start(timeout=240)
    try:
        prompts = make_prompts([40, 45, 50], seed=102)
        expected = greedy_tokens(llama[1], prompts, 12)

        async def run():
            before = await scheduler_stats(cluster)
            outs = [await complete(cluster, token_ids=p, max_tokens=12, temperature=0.0, ignore_eos=True)
                    for p in prompts]
            after = await scheduler_stats(cluster)
            return outs, after.by_prefill_reason["remote"] - before.by_prefill_reason["remote"]

        outs, remote = asyncio.run(run())
        assert remote == len(prompts)  # each prompt prefilled on the prefill group, its KV sent to the decode group
        assert [o.token_ids for o in outs] == expected
    finally:
        cluster.stop()


@pytest.mark.parametrize("layout", ["tensor", "pipeline"])
def test_a_group_is_one_worker_and_a_killed_rank_moves_its_requests(llama, tmp_path, layout):
    sizes = {f"{layout}_parallel_size": 2}
    cluster = Cluster(ClusterSpec(llama[1], num_prefill=0, num_decode=0, num_both=1,
                                  engine=EngineArgs(**sizes, dtype="float32", num_kv_blocks=256)), tmp_path)
    cluster.start(timeout=240)
    try:
        cluster.add_worker("both", f"--{layout}-parallel", "1", timeout=240)  # a worker of one process
        group = cluster.procs["both-0"]
        [peer] = peers(group.pid)
        prompts = make_prompts([20, 21, 22, 23], seed=101)
        expected = greedy_tokens(llama[1], prompts, MAX_TOKENS)

        async def run():
            async with grpc.aio.insecure_channel(cluster.addresses["kv-registry"]) as ch:
                listed = await kv_registry_pb2_grpc.KvRegistryServiceStub(ch).ListWorkers(
                    kv_registry_pb2.ListWorkersRequest())
            assert sorted(w.info.address for w in listed.workers) == sorted(
                cluster.addresses[n] for n in ("both-0", "both-1"))  # the group registered once
            tasks = await streams_decoding_on(cluster.router_address, cluster.addresses["both-0"], prompts,
                                              MAX_TOKENS, 60)
            subprocess.run(["kill", "-9", str(peer)], check=True)
            return await asyncio.gather(*tasks)

        outs = asyncio.run(run())
        counts = check(outs, expected)  # every stream completes with one process's greedy tokens
        assert counts["completed"] == 4 and counts["migrated"] >= 1, counts
        assert group.wait(timeout=30) == 70  # rank 0 left at once with its group
    finally:
        cluster.stop()
