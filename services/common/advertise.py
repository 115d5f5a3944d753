"""The address a worker tells the mesh to reach it at. ``--advertise-address`` is taken as
given, except a host of ``auto``: this machine's own address on the route toward the
registry (the source address the kernel picks for it; no packet is sent). That is what a
replica of a compose service or any container without a stable name advertises: each
replica its own address, where the service's name would be shared by all of them."""

from __future__ import annotations

import socket

AUTO = "auto"


def advertised(address: str, registry: str) -> str:
    host, _, port = address.rpartition(":")
    if host != AUTO:
        return address
    registry_host, _, registry_port = registry.rpartition(":")
    family = socket.AF_INET6 if ":" in registry_host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((registry_host.strip("[]"), int(registry_port or 1)))  # routes only: UDP sends nothing here
        own = probe.getsockname()[0]
    return f"[{own}]:{port}" if family == socket.AF_INET6 else f"{own}:{port}"
