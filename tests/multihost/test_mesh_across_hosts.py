"""The short form of the mesh across hosts: a control host, a prefill host and a decode host,
their links shaped to 1 Gbit/s, mutual TLS between every service; greedy requests through both
worker hosts equal the engine alone, the KV crossing by the gRPC stream, never shared memory."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from control_plane.cli.launcher import Cluster, ClusterSpec
from control_plane.hosts.link import Link
from control_plane.hosts.network import HostNetwork
from kervan.engine_args import EngineArgs
from tests.chaos.checker import check, stream
from tests.conftest import EXACT_MESH, EXACT_REFERENCE, greedy_tokens, make_prompts
from tests.multihost.hosts import scrape

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def three_hosts(llama, tmp_path_factory):
    cluster = Cluster(ClusterSpec(llama[1], num_prefill=1, num_decode=1, hosts=3, link=Link.parse("1gbit"),
                                  tls=True, metrics=True, engine=EngineArgs(**EXACT_MESH, num_kv_blocks=256)),
                      tmp_path_factory.mktemp("three-hosts"))
    cluster.start(timeout=240)
    yield cluster
    cluster.stop()


def test_greedy_requests_through_a_prefill_host_and_a_decode_host_equal_the_engine_alone(three_hosts, llama):
    hosts = {name: address.rsplit(":", 1)[0] for name, address in three_hosts.addresses.items()}
    assert len({hosts["router"], hosts["prefill-0"], hosts["decode-0"]}) == 3, hosts
    assert hosts["redis"] == hosts["kv-registry"] == hosts["scheduler"] == hosts["router"]
    prompts = make_prompts([48, 64, 80, 96], seed=53)
    expected = greedy_tokens(llama[1], prompts, MAX_TOKENS, **EXACT_REFERENCE)

    async def run():
        return await asyncio.gather(*[stream(three_hosts.router_address, p, MAX_TOKENS, timeout=60,
                                             security=three_hosts.client_security) for p in prompts])

    counts = check(asyncio.run(run()), expected)
    assert counts["completed"] == len(prompts)
    pushed = scrape(three_hosts.addresses["prefill-0-metrics"])
    assert pushed[("kervan_kv_pushes_total", (("path", "stream"),))] >= 1  # prefilled remotely, moved over the link
    assert pushed.get(("kervan_kv_pushes_total", (("path", "shared_memory"),)), 0) == 0
    received = scrape(three_hosts.addresses["decode-0-metrics"])
    assert received[("kervan_kv_transfer_bytes_total", (("direction", "received"),))] > 0


def test_a_host_cannot_open_another_hosts_shared_memory():
    # Left behind on purpose: the resource tracker would unlink it after the creator exits, racing the listing.
    code = ("from multiprocessing import resource_tracker as t, shared_memory as s; "
            "m = s.SharedMemory('kervan-kv-probe', create=True, size=64); t.unregister(m._name, 'shared_memory')")
    with HostNetwork.create(2) as net:
        a, b = net.hosts
        subprocess.run(a.enter([sys.executable, "-c", code + "; m.close()"]), check=True, timeout=30)
        seen = subprocess.run(b.enter(["ls", "/dev/shm"]), capture_output=True, text=True, timeout=30).stdout
        mine = subprocess.run(a.enter(["ls", "/dev/shm"]), capture_output=True, text=True, timeout=30).stdout
    assert "kervan-kv-probe" in mine and "kervan-kv-probe" not in seen
    assert not Path("/dev/shm/kervan-kv-probe").exists()


def test_sigkill_of_the_launcher_leaves_no_host_behind(llama, tmp_path):
    model = tmp_path / "model"  # a path only this cluster's processes name
    model.symlink_to(llama[1])
    launcher = subprocess.Popen([sys.executable, "-m", "control_plane.cli", "up", "--hosts", "3", "--link", "100mbit",
                                 "--model", str(model), "--port", "0"], stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in launcher.stderr:
            lines.append(line)
            if line.startswith("Ctrl-C stops the cluster"):
                break
        else:
            pytest.fail("kervan up --hosts 3 did not start:\n" + "".join(lines))
        router = next(line for line in lines if "router on " in line).split("router on ")[1].split(":")[0]
        subnet = router.rsplit(".", 1)[0] + "."  # this cluster's hosts' /24 (other tests may run their own)
        assert subnet in _addresses_here()  # the launcher's own end of the switch
        services = [pid for pid in _processes_naming(str(model)) if pid != launcher.pid]
        spaces = {os.readlink(f"/proc/{pid}/ns/net") for pid in services}
        assert len(spaces) == 3 and os.readlink("/proc/self/ns/net") not in spaces  # control, prefill, decode hosts
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (_processes_naming(str(model)) or _processes_in(spaces)):
            time.sleep(0.2)
        assert not _processes_naming(str(model)) and not _processes_in(spaces)
        assert subnet not in _addresses_here()
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)
            launcher.wait(30)


def _addresses_here() -> str:
    return subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout


def _processes_naming(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _processes_in(spaces: set[str]) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "ns" / "net") in spaces:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_link_delay_needs_netem_and_a_kernel_without_it_says_so():
    from control_plane.hosts.link import LinkError
    try:
        with HostNetwork.create(1, Link.parse("1gbit,2ms")) as net:
            shaped = subprocess.run(net.hosts[0].enter(["tc", "qdisc", "show", "dev", "eth0"]), capture_output=True,
                                    text=True).stdout
            assert "netem" in shaped and "delay 2ms" in shaped
    except LinkError as exc:
        assert "netem" in str(exc) and "rate only" in str(exc)
