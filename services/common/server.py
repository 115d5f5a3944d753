"""Bootstrap shared by every service: a ``grpc.aio`` server on uvloop with the
standard health service (NOT_SERVING until ready and again while draining),
server reflection, the error interceptor, and a graceful stop on SIGTERM/SIGINT.

Channels and servers are created only here and after any worker processes or
threads are started (gRPC must not be forked)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kervan.envs import listen_reuseport
from services.common.auth import ANY_ROLE, ApiKeys, AuthInterceptor
from services.common.errors import ErrorInterceptor
from services.common.runtime import SERVICE_NAME as RUNTIME_SERVICE
from services.common.runtime import RuntimeServicer
from services.common.security import PLAINTEXT, MeshSecurity
from services.proto import runtime_pb2_grpc

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Channels between services: HTTP/2 pings every 2 s, 2 s to answer: a peer that
# died without closing its connections, or a network that drops everything, fails
# the calls in about 4 s (then the router migrates them) instead of leaving them
# hanging. gRPC core waits
# for a ping's ack ``ping_timeout_ms`` (60 s by default), whatever the keepalive
# timeout says: without it a blackholed connection took 61 s to fail.
KEEPALIVE = [("grpc.keepalive_time_ms", 2000), ("grpc.keepalive_timeout_ms", 2000),
             ("grpc.http2.ping_timeout_ms", 2000), ("grpc.keepalive_permit_without_calls", 1),
             ("grpc.http2.max_pings_without_data", 0)]




@dataclass
class Service:
    """One gRPC service to host: its full name, how to add it to a server, and which
    mesh roles may call its methods (method name, or ``*`` for the rest -> roles;
    empty: any role)."""

    name: str
    register: Callable[[grpc.aio.Server], None]
    callers: Mapping[str, Collection[str]] = field(default_factory=dict)

    def method_callers(self) -> dict[str, Collection[str]]:
        return {f"/{self.name}/" + ("" if method == ANY_ROLE else method): roles
                for method, roles in self.callers.items()}


@dataclass
class Server:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    names: list[str] = field(default_factory=list)

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ["", *self.names]:
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)


async def start_server(services: list[Service], host: str = "127.0.0.1", port: int = 0,
                       max_message_bytes: int = MAX_MESSAGE_BYTES, security: MeshSecurity = PLAINTEXT,
                       api_keys: ApiKeys | None = None, public: bool = False) -> Server:
    """Start serving (health NOT_SERVING until ``set_serving(True)``); port 0 picks a free one.
    Larger messages are refused with RESOURCE_EXHAUSTED before any servicer sees them.
    With TLS, callers must present a mesh certificate, unless ``public`` (the router:
    its clients verify it, and present ``api_keys`` when it has some)."""
    security.check_listen(host, "the gRPC server")
    callers = {k: v for s in services for k, v in s.method_callers().items()}
    auth = AuthInterceptor(callers, mesh_tls=security.tls and not public, api_keys=api_keys,
                           mesh_secret=None if public else security.mesh_secret)
    server = grpc.aio.server(interceptors=[auth, ErrorInterceptor()], options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # a second process cannot bind a port a live one holds (gRPC allows it by default): a
        # replacement started too early fails instead of sharing the port with the old one; under
        # the launcher, which restarts only after the old process is gone, the port is shared
        # with the launcher's reservation instead (control_plane/cli/port_reservations.py)
        ("grpc.so_reuseport", int(listen_reuseport())),
        # accept the keepalive pings peers use to notice a dead or unreachable server
        ("grpc.http2.min_ping_interval_without_data_ms", 1000), ("grpc.http2.max_ping_strikes", 0),
        ("grpc.keepalive_permit_without_calls", 1)])
    for service in services:
        service.register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    runtime_pb2_grpc.add_RuntimeServiceServicer_to_server(RuntimeServicer(), server)
    names = [s.name for s in services]
    reflection.enable_server_reflection([*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                         RUNTIME_SERVICE, reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    try:
        bound = (server.add_secure_port(address, security.server_credentials(require_client_cert=not public))
                 if security.tls else server.add_insecure_port(address))
    except RuntimeError:  # grpcio raises where it once returned 0
        bound = 0
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port} (in use?)")
    await server.start()
    handle = Server(server, health_servicer, bound, names)
    await handle.set_serving(False)
    return handle


async def serve_until_signal(handle: Server, on_stop: Callable[[], Awaitable[None]] | None = None,
                             grace: float = 5.0, stop: asyncio.Event | None = None,
                             on_drain: Callable[[], Awaitable[None]] | None = None) -> None:
    """Mark SERVING, wait for SIGTERM or SIGINT (or ``stop``, when the main thread owns
    the signals), then drain: NOT_SERVING (health watchers and load balancers learn it
    first), run ``on_drain`` (e.g. leave the mesh), finish in-flight calls for up to
    ``grace`` seconds while refusing new ones, run ``on_stop``."""
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    await handle.set_serving(True)
    await stop.wait()
    log.info("draining")
    await handle.set_serving(False)
    if on_drain is not None:
        await on_drain()
    await handle.stop(grace)
    if on_stop is not None:
        await on_stop()


def configure_logging() -> None:
    from kervan.envs import log_level
    logging.basicConfig(level=log_level(), format="%(asctime)s %(name)s %(levelname)s %(message)s")


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a service's async main on uvloop (on the calling thread); a service started
    by a launcher stops when the launcher is gone (``lifeline.py``)."""
    import uvloop

    from services.common.lifeline import watch_lifeline
    configure_logging()
    watch_lifeline()
    uvloop.run(main())


def run_service(tracing_name: str, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """A service's ``main()``: its spans named ``tracing_name`` (when the environment asks for
    tracing), then ``main`` on uvloop."""
    from services.common.tracing import configure_tracing
    configure_tracing(tracing_name)
    run(main)
