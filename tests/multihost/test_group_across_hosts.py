"""A worker group whose ranks sit on two hosts: rank 0 on one, rank 1 started on the next
(``SimulatedHosts.group_env``), their collectives (tensor parallel) or hand-overs (pipeline)
on gloo over a 1 Gbit/s link, never through shared memory. It serves what one process does."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from control_plane.cli.launcher import Cluster, ClusterSpec
from control_plane.hosts.link import Link
from kervan.engine_args import EngineArgs
from tests.chaos.checker import check, stream
from tests.conftest import greedy_tokens, make_prompts


def ranks(pid: int) -> list[int]:
    kids = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [k for k in kids if b"worker.parallel.peer" in Path(f"/proc/{k}/cmdline").read_bytes()]


@pytest.mark.parametrize("layout", ["tensor", "pipeline"])
def test_a_group_with_its_ranks_on_two_hosts_serves_what_one_process_does(llama, tmp_path, layout):
    engine = EngineArgs(dtype="float32", num_kv_blocks=256, **{f"{layout}_parallel_size": 2})
    cluster = Cluster(ClusterSpec(llama[1], num_prefill=0, num_decode=0, num_both=1, hosts=3,
                                  link=Link.parse("1gbit"), tls=True, engine=engine), tmp_path)
    cluster.start(timeout=240)
    try:
        rank0 = cluster.procs["both-0"].pid
        (rank1,) = ranks(rank0)
        spaces = {os.readlink(f"/proc/{pid}/ns/net") for pid in (rank0, rank1)}
        assert len(spaces) == 2  # two hosts
        prompts = make_prompts([30, 40], seed=105)
        expected = greedy_tokens(llama[1], prompts, 12)

        async def run():
            return await asyncio.gather(*[stream(cluster.router_address, p, 12, timeout=120,
                                                 security=cluster.client_security) for p in prompts])
        assert check(asyncio.run(run()), expected)["completed"] == len(prompts)
    finally:
        cluster.stop()
