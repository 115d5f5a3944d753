"""Where each of a cluster's services runs: its address, its port, the argv that starts it there.

``LoopbackHosts``: everything on 127.0.0.1 of this machine, each port held by the launcher for
the service's life (``port_reservations.py``). ``SimulatedHosts``: the control services (Redis,
registry, lease watch, schedulers, routers) on host ``h0`` and the workers spread over the
others in turn (all on ``h0`` when it is the only one), each started inside its host. A
simulated host's ports belong to this cluster alone, so a port there is just the next number,
kept for the service's restarts. A worker group there has its peer ranks on the next worker
hosts (``group_env``), talking gloo over the links."""

from __future__ import annotations

import json
import socket
from typing import Protocol

from control_plane.cli.port_reservations import PortReservations
from control_plane.hosts.network import Host, HostNetwork
from kervan.envs import KERVAN_GROUP_PEER_HOSTS

FIRST_PORT = 20000


class ServiceHosts(Protocol):
    def address(self, name: str) -> str: ...

    def port(self, name: str, wanted: int = 0) -> int: ...

    def unreserved_port(self, name: str) -> int: ...

    def argv(self, name: str, argv: list[str]) -> list[str]: ...

    def group_env(self, name: str, world_size: int) -> dict[str, str]: ...

    def close(self) -> None: ...


class LoopbackHosts:
    def __init__(self) -> None:
        self.reservations = PortReservations()

    def address(self, name: str) -> str:
        return "127.0.0.1"

    def port(self, name: str, wanted: int = 0) -> int:
        return self.reservations.reserve(wanted)

    def unreserved_port(self, name: str) -> int:
        """A free port not held (for a server that does not bind beside a reservation)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
            return port

    def argv(self, name: str, argv: list[str]) -> list[str]:
        return argv

    def group_env(self, name: str, world_size: int) -> dict[str, str]:
        return {}  # a group's ranks share this host: shared memory between them

    def close(self) -> None:
        self.reservations.release_all()


class SimulatedHosts:
    def __init__(self, network: HostNetwork):
        self.network = network
        self.placed: dict[str, Host] = {}
        self.ports: dict[str, int] = {}
        self._next_port = FIRST_PORT
        self._num_workers = 0

    def host_of(self, name: str) -> Host:
        if name not in self.placed:
            hosts = self.network.hosts
            if _is_worker(name) and len(hosts) > 1:
                self.placed[name] = hosts[1 + self._num_workers % (len(hosts) - 1)]
                self._num_workers += 1
            else:
                self.placed[name] = hosts[0]
        return self.placed[name]

    def address(self, name: str) -> str:
        return self.host_of(name.removesuffix("-metrics").removesuffix("-http")).address

    def port(self, name: str, wanted: int = 0) -> int:
        if name not in self.ports:
            self.ports[name] = wanted or self._next_port
            self._next_port += 0 if wanted else 1
        return self.ports[name]

    def unreserved_port(self, name: str) -> int:
        return self.port(name)

    def argv(self, name: str, argv: list[str]) -> list[str]:
        return self.host_of(name).enter(argv)

    def group_env(self, name: str, world_size: int) -> dict[str, str]:
        """A worker group's ranks 1..N-1 on the worker hosts after its rank 0's, in turn (with one
        worker host, all on it): the group's collectives then cross the links."""
        workers = self.network.hosts[1:]
        if world_size == 1 or len(workers) < 2:
            return {}
        first = workers.index(self.host_of(name))
        peers = [workers[(first + rank) % len(workers)] for rank in range(1, world_size)]
        return {KERVAN_GROUP_PEER_HOSTS: json.dumps([h.enter([]) for h in peers]), "GLOO_SOCKET_IFNAME": "eth0"}

    def close(self) -> None:
        self.network.close()


def _is_worker(name: str) -> bool:
    return name.split("-", 1)[0] in ("prefill", "decode", "both")
