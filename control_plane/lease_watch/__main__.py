"""``python -m control_plane.lease_watch``: the lease watch as a process (flags, mesh security,
metrics, signals)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from control_plane import lease_watch
from control_plane.lease_watch.watcher import LeaseWatcher
from services.common import redis_url
from services.common.config import parse_service_args, service_parser
from services.common.metrics import serve_metrics
from services.common.security import MeshSecurity
from services.proto import kv_registry_pb2_grpc

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = service_parser("control_plane.lease_watch", lease_watch.__doc__, listens=False)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0",
                    help="Redis URL (a password: in KERVAN_CONTROL_PLANE_REDIS rather than on the command line)")
    ap.add_argument("--registry", required=True, help="HOST:PORT of the kv-registry")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between reconciliations")
    return parse_service_args(ap, "control_plane", argv)


async def serve(args: argparse.Namespace) -> None:
    security = MeshSecurity.from_args(args)
    client = redis_url.connect(args.redis)
    async with security.channel(args.registry, role="kv-registry") as channel:
        watcher = LeaseWatcher(client, kv_registry_pb2_grpc.KvRegistryServiceStub(channel), args.interval)
        task = asyncio.ensure_future(watcher.run())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        serve_metrics(args.metrics_port, args.host, "control-plane")
        print("control-plane membership watch ready", flush=True)
        try:
            await task
        except asyncio.CancelledError:
            log.info("stopping")
        finally:
            await client.aclose()


def main(argv: list[str] | None = None) -> None:
    from services.common.server import run_service
    args = parse_args(argv)
    run_service("kervan-lease-watch", lambda: serve(args))


if __name__ == "__main__":
    main()
