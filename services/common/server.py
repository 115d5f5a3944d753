"""Bootstrap shared by every service: a ``grpc.aio`` server on uvloop with the
standard health service (NOT_SERVING until ready and again while draining),
server reflection, the error interceptor, and a graceful stop on SIGTERM/SIGINT.

Channels and servers are created only here and after any worker processes or
threads are started (gRPC must not be forked)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.errors import ErrorInterceptor
from services.common.runtime import SERVICE_NAME as RUNTIME_SERVICE
from services.common.runtime import RuntimeServicer
from services.proto import runtime_pb2_grpc

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass
class Service:
    """One gRPC service to host: its full name, and how to add it to a server."""

    name: str
    register: Callable[[grpc.aio.Server], None]


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
                       max_message_bytes: int = MAX_MESSAGE_BYTES) -> Server:
    """Start serving (health NOT_SERVING until ``set_serving(True)``); port 0 picks a free one.
    Larger messages are refused with RESOURCE_EXHAUSTED before any servicer sees them."""
    server = grpc.aio.server(interceptors=[ErrorInterceptor()], options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
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
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
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


def run(main: Callable[[], Awaitable[None]]) -> None:
    """Run a service's async main on uvloop (on the calling thread)."""
    import uvloop
    configure_logging()
    uvloop.run(main())
