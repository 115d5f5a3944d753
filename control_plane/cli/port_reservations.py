"""Ports the launcher holds for its services' whole life, so that no other user can take one
while its service restarts.

Without TLS a client knows a service only by its loopback port. After a crash the launcher
restarts the service on the same port after a back-off, and in that gap a process of any
user could bind the port and collect what clients send it (the mesh secret, API keys and
prompts). The launcher therefore binds each service's port itself first, with
``SO_REUSEPORT``, and never listens on it: the kernel lets only sockets of the same user
with the same option share a port, so the service (started with ``KERVAN_LISTEN_REUSEPORT``)
binds it beside the reservation, and another user gets ``EADDRINUSE`` before, during and after
a restart. A socket that does not listen receives no connection."""

from __future__ import annotations

import socket


class PortReservations:
    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self._held: dict[int, socket.socket] = {}

    def reserve(self, port: int = 0) -> int:
        """Hold ``port`` (0: a free one) from now until ``release_all``; returns it."""
        if port in self._held:
            return port
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((self.host, port))
        except OSError:
            s.close()
            raise
        port = s.getsockname()[1]
        self._held[port] = s
        return port

    def release_all(self) -> None:
        for s in self._held.values():
            s.close()
        self._held.clear()
