"""``python -m services.kv_registry``: the KV registry over gRPC, backed by Redis."""

from __future__ import annotations

import argparse

from kervan.block_hash import DEFAULT_BLOCK_SIZE, HASH_NAME
from services.common import redis_url
from services.common.config import parse_service_args, service_parser
from services.common.metrics import serve_metrics
from services.common.security import MeshSecurity
from services.common.server import Service, run_service, serve_until_signal, start_server
from services.kv_registry.index import MAX_BLOCKS_PER_WORKER, PrefixIndex
from services.kv_registry.metrics import CountingConnection
from services.kv_registry.servicer import CALLERS, KvRegistryServicer
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc

SERVICE_NAME = kv_registry_pb2.DESCRIPTOR.services_by_name["KvRegistryService"].full_name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = service_parser("services.kv_registry", __doc__)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0",
                    help="Redis URL: redis://[[user]:password@]host:port/db, rediss:// for TLS (with ?ssl_ca_certs=), "
                         "redis+sentinel://[:password@]host:port,.../service[/db] for Sentinel; pass a password in "
                         "KERVAN_KV_REGISTRY_REDIS rather than on the command line")
    ap.add_argument("--redis-timeout", type=float, default=2.0,
                    help="seconds a Redis command may take before the call fails UNAVAILABLE (a slow or "
                         "partitioned Redis must not hang handlers)")
    ap.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                    help="tokens per KV block across the mesh: workers must match it, the router asks for it")
    ap.add_argument("--ttl", type=int, default=5, help="seconds a worker stays registered without a heartbeat")
    ap.add_argument("--redis-max-connections", type=int, default=16,
                    help="Redis connections at most (more concurrent calls wait for one); bounds the open sockets, "
                         "which a pool without a bound grows to every burst's peak, after each Redis restart")
    ap.add_argument("--max-blocks-per-worker", type=int, default=MAX_BLOCKS_PER_WORKER,
                    help="the most KV blocks the registry keeps for one worker (a worker that registered a smaller "
                         "capacity is held to that): a PublishEvents past it is refused")
    ap.add_argument("--watch-resync-s", type=float, default=0.5,
                    help="seconds between two whole reads of the live set for WatchWorkers streams (between them, "
                         "changes are sent as workers publish them; this bounds how late an expired lease is seen)")
    ap.add_argument("--require-worker-addresses", action="store_true",
                    help="with TLS: refuse a worker certificate that names no address it may register "
                         "(kervan-worker://HOST:PORT URIs); without this flag only certificates that name some are "
                         "held to them")
    return parse_service_args(ap, "kv_registry", argv)


async def serve(args: argparse.Namespace) -> None:
    security = MeshSecurity.from_args(args)
    client = redis_url.connect(args.redis, args.redis_timeout, args.redis_max_connections, CountingConnection)
    await client.ping()
    index = PrefixIndex(client, args.ttl, args.max_blocks_per_worker)
    await index.forget_all()  # rebuild from the workers' dumps, asked for on their next heartbeat
    servicer = KvRegistryServicer(index, args.block_size, HASH_NAME, args.require_worker_addresses,
                                  args.watch_resync_s)
    handle = await start_server([Service(SERVICE_NAME, lambda s: (
        kv_registry_pb2_grpc.add_KvRegistryServiceServicer_to_server(servicer, s)), CALLERS)], args.host, args.port,
        security=security)
    serve_metrics(args.metrics_port, args.host, "kv-registry")
    print(f"kv-registry ready on {args.host}:{handle.port}", flush=True)
    async def drain() -> None:
        servicer.feed.close()  # the streams end now: the grace is for calls that finish
    await serve_until_signal(handle, client.aclose, on_drain=drain)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_service("kervan-kv-registry", lambda: serve(args))


if __name__ == "__main__":
    main()
