"""Simulated hosts on this machine, each with its own network stack and its own ``/dev/shm``.

    operator (this namespace, the launcher) --veth-- switch (a bridge in a namespace of its own)
                                                        |-- h0: control host, 10.x.y.1 (eth0)
                                                        |-- h1: worker host,  10.x.y.2
                                                        '-- ...

Every namespace is held by a process of its own (``unshare``, then ``cat`` on a pipe from
here): when this process dies, even by SIGKILL, the pipe closes, the holders exit, the
services in the hosts die by their lifeline, and the kernel removes each namespace with its
last process, the veth pairs in it with it. Nothing is named in ``/run/netns`` and nothing is
left in this namespace but the operator's veth end, which goes with its peer.

Each host's link to the switch is shaped at both ends (``link.py``): its own ``eth0`` (what
it sends) and its port on the bridge (what it receives). Faults are filters on those two
devices: a host ``cut`` off, a ``partition`` between hosts, a ``lossy`` link, one port
``blocked`` (Redis out of one host's reach); ``heal`` removes them all.

A host's processes are started as ``nsenter -t HOLDER -n -m -- argv``; a process in one host
cannot open another's shared-memory segments (each host has its own tmpfs on ``/dev/shm``)."""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field

from control_plane.hosts.link import Link, LinkError, drop_filter, loss_filter, shape_commands

SUBNETS = ipaddress.ip_network("10.208.0.0/12")  # a free /24 of these per network
PRIO_CUT, PRIO_PEER, PRIO_PORT, PRIO_LOSS = 1, 2, 3, 4


class HostNetworkError(RuntimeError):
    """Simulated hosts cannot be made here (not root, no ``ip``/``unshare``, ...)."""


def unavailable_reason() -> str | None:
    """Why hosts cannot be simulated on this machine, or None if they can."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, veth pairs, tc)"
    missing = [tool for tool in ("ip", "tc", "unshare", "nsenter", "mount") if shutil.which(tool) is None]
    if missing:
        return f"simulated hosts need {', '.join(missing)} on PATH"
    try:
        subprocess.run(["unshare", "--net", "--mount", "true"], check=True, capture_output=True, timeout=10)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return f"network namespaces cannot be made here: {exc}"
    return None


@dataclass
class Host:
    name: str
    address: str
    holder: subprocess.Popen[bytes]
    port: str  # its device on the switch

    def enter(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host (its network and mounts)."""
        return ["nsenter", "-t", str(self.holder.pid), "-n", "-m", "--", *argv]


@dataclass
class HostNetwork:
    link: Link
    hosts: list[Host] = field(default_factory=list)
    operator_address: str = ""
    _switch: subprocess.Popen[bytes] | None = None
    _operator_dev: str = ""

    @classmethod
    def create(cls, num_hosts: int, link: Link | None = None) -> HostNetwork:
        """``num_hosts`` hosts (h0, h1, ...) on one switch, every link shaped as ``link``."""
        if not 1 <= num_hosts <= 200:
            raise HostNetworkError(f"--hosts must be 1 to 200, got {num_hosts}")
        reason = unavailable_reason()
        if reason is not None:
            raise HostNetworkError(reason)
        net = cls(link or Link())
        try:
            net._build(num_hosts)
        except BaseException:
            net.close()
            raise
        return net

    def _build(self, num_hosts: int) -> None:
        self._switch = _holder(private_shm=False)
        self._run(self._switch, "ip", "link", "add", "br0", "type", "bridge")
        self._run(self._switch, "ip", "link", "set", "br0", "up")
        if self.link.delay_s:
            self._check_netem()
        subnet = _free_subnet()
        addresses = list(subnet.hosts())
        tag = os.urandom(3).hex()
        self._operator_dev = f"kvop{tag}"
        self._run(None, "ip", "link", "add", self._operator_dev, "type", "veth", "peer", "name", "op", "netns",
                  str(self._switch.pid))
        self._run(self._switch, "ip", "link", "set", "op", "master", "br0", "up")
        self.operator_address = str(addresses[-1])
        self._run(None, "ip", "addr", "add", f"{self.operator_address}/{subnet.prefixlen}", "dev", self._operator_dev)
        self._run(None, "ip", "link", "set", self._operator_dev, "up")
        for k in range(num_hosts):
            host = Host(f"h{k}", str(addresses[k]), _holder(private_shm=True), f"h{k}")
            self.hosts.append(host)
            self._run(self._switch, "ip", "link", "add", host.port, "type", "veth", "peer", "name", "eth0", "netns",
                      str(host.holder.pid))
            self._run(self._switch, "ip", "link", "set", host.port, "master", "br0", "up")
            self._run(host.holder, "ip", "addr", "add", f"{host.address}/{subnet.prefixlen}", "dev", "eth0")
            self._run(host.holder, "ip", "link", "set", "eth0", "up")
            self._run(host.holder, "ip", "link", "set", "lo", "up")
            for argv in shape_commands("eth0", self.link):
                self._run(host.holder, *argv)
            for argv in shape_commands(host.port, self.link):
                self._run(self._switch, *argv)

    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(f"no host {name!r} (hosts: {', '.join(h.name for h in self.hosts)})")

    # -- faults -----------------------------------------------------------------------

    def cut(self, host: Host) -> None:
        """Cut ``host`` off: nothing in or out (its processes live on, as on a host whose
        cable was pulled; its Redis lease stays valid until it expires)."""
        self._both_ends(host, lambda dev, inbound: drop_filter(dev, PRIO_CUT, protocol="all"))

    def partition(self, side_a: list[Host], side_b: list[Host]) -> None:
        """No packet between any host of ``side_a`` and any of ``side_b``; each side still
        reaches every other host."""
        for a in side_a:
            for b in side_b:
                self._both_ends(a, _peer_filter(b.address))

    def block_port(self, host: Host, peer: Host, port: int) -> None:
        """``host`` can no longer reach ``peer``'s ``port`` (nor hear from it): one service out
        of reach, the rest of ``peer`` still there."""
        self._both_ends(host, lambda dev, inbound: drop_filter(
            dev, PRIO_PORT, f"ip {'src' if inbound else 'dst'} {peer.address}/32",
            f"ip {'sport' if inbound else 'dport'} {port} 0xffff"))

    def lossy(self, host: Host, fraction: float) -> None:
        """``fraction`` of the packets on ``host``'s link dropped at random, each way."""
        self._both_ends(host, lambda dev, inbound: loss_filter(dev, PRIO_LOSS, fraction))

    def heal(self, host: Host) -> None:
        """Every fault on ``host``'s link removed."""
        self._run(host.holder, "tc", "filter", "del", "dev", "eth0", "parent", "1:")
        self._run(self._switch, "tc", "filter", "del", "dev", host.port, "parent", "1:")

    def _both_ends(self, host: Host, make: Callable[[str, bool], list[str]]) -> None:
        self._run(host.holder, *make("eth0", False))
        self._run(self._switch, *make(host.port, True))

    # -- teardown -----------------------------------------------------------------------

    def close(self) -> None:
        """Remove every host and the switch (what SIGKILL of this process also does)."""
        if self._operator_dev:
            subprocess.run(["ip", "link", "del", self._operator_dev], capture_output=True)
            self._operator_dev = ""
        for holder in [h.holder for h in self.hosts] + ([self._switch] if self._switch else []):
            if holder.stdin is not None:
                holder.stdin.close()
            try:
                holder.wait(timeout=5)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait()
        self.hosts.clear()
        self._switch = None

    def __enter__(self) -> HostNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_netem(self) -> None:
        assert self._switch is not None
        probe = subprocess.run(["nsenter", "-t", str(self._switch.pid), "-n", "tc", "qdisc", "add", "dev", "lo",
                                "root", "netem", "delay", "1ms"], capture_output=True, text=True)
        if probe.returncode != 0:
            raise LinkError("a link delay needs the kernel's netem qdisc (sch_netem), which this kernel lacks "
                            f"({probe.stderr.strip()}): give the link a rate only")

    @staticmethod
    def _run(holder: subprocess.Popen[bytes] | None, *argv: str) -> None:
        full = list(argv) if holder is None else ["nsenter", "-t", str(holder.pid), "-n", "--", *argv]
        done = subprocess.run(full, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise HostNetworkError(f"{' '.join(argv)}: {done.stderr.strip()}")


def _peer_filter(address: str) -> Callable[[str, bool], list[str]]:
    """Packets to ``address`` (on a host's own device) or from it (on its switch port) dropped."""
    return lambda dev, inbound: drop_filter(dev, PRIO_PEER, f"ip {'src' if inbound else 'dst'} {address}/32")


def _holder(private_shm: bool) -> subprocess.Popen[bytes]:
    """A process in new network and mount namespaces that lives until its stdin closes."""
    shm = "mount -t tmpfs -o mode=1777 kervan-shm /dev/shm && " if private_shm else ""
    proc = subprocess.Popen(["unshare", "--net", "--mount", "--propagation", "private", "--", "sh", "-c",
                             f"{shm}echo ready && exec cat >/dev/null"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line != b"ready\n":
        proc.kill()
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        raise HostNetworkError(f"a host's namespaces could not be made: {err.strip() or line!r}")
    proc.stdout.close()
    if proc.stderr is not None:
        proc.stderr.close()
    return proc


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of ``SUBNETS`` that no route of this namespace overlaps."""
    routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    taken: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for line in routes.splitlines():
        word = line.split()[0] if line.split() else ""
        if word.startswith("local") or word.startswith("broadcast"):
            word = line.split()[1]
        try:
            taken.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            continue
    subnets = [ipaddress.IPv4Network(n) for n in SUBNETS.subnets(new_prefix=24)]
    for _ in range(64):
        subnet = random.choice(subnets)
        if not any(subnet.overlaps(t) for t in taken if t.prefixlen > 0):
            return subnet
    raise HostNetworkError(f"no free /24 in {SUBNETS} for the simulated hosts")
