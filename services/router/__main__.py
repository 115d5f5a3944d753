"""``python -m services.router``: the public RouterService over gRPC.

Reads the model directory's ``config.json`` (the vocabulary) and ``tokenizer.json``;
places each request through the scheduler, which checks it against the limits the
workers registered (or on fixed workers, which check it themselves: for small
setups and tests)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kervan.chat_template import ChatTemplate
from kervan.default_model import default_model_written
from kervan.tokenizer import Tokenizer
from services.common import replicas
from services.common.auth import ApiKeys
from services.common.config import parse_service_args, service_parser
from services.common.metrics import serve_metrics
from services.common.security import MeshSecurity
from services.common.server import KEEPALIVE, Service, run_service, serve_until_signal, start_server
from services.proto import kv_registry_pb2_grpc, router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.router.admission import Admission
from services.router.core import ModelLimits
from services.router.http_front import OpenAIFront
from services.router.http_guard import HttpLimits
from services.router.mesh_view import MeshView
from services.router.openai_protocol import MAX_PROMPTS, MAX_SAMPLES, RequestBounds
from services.router.routes import Placement, ScheduledRoutes, StaticRoutes, worker_channels
from services.router.runner import MigrationPolicy
from services.router.servicer import RouterServicer

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name
SCHEDULER_SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = service_parser("services.router", __doc__)
    ap.add_argument("--scheduler", default=None,
                    help="HOST:PORT of the scheduler (KV-aware placement); several, comma-separated: replicas, "
                         "balanced, a call to one that is down retried on another")
    ap.add_argument("--registry", default=None,
                    help="HOST:PORT of the kv-registry: the mesh page (GET /mesh) lists its live workers")
    ap.add_argument("--worker", default=None, help="HOST:PORT of an aggregated worker (no scheduler)")
    ap.add_argument("--prefill", default=None, help="HOST:PORT of a prefill worker (with --decode)")
    ap.add_argument("--decode", default=None, help="HOST:PORT of a decode worker (with --prefill)")
    ap.add_argument("--model", default=None, help="the workers' model directory (default: embedded model)")
    ap.add_argument("--max-migrations", type=int, default=MigrationPolicy.max_migrations,
                    help="times a request may move to another worker when its worker is lost (0: never)")
    ap.add_argument("--stall-timeout-s", type=float, default=MigrationPolicy.stall_timeout_s,
                    help="no token for this long after the first: the worker is taken for lost")
    ap.add_argument("--first-token-timeout-s", type=float, default=MigrationPolicy.first_token_timeout_s,
                    help="no first token for this long (queue and prefill): the worker is taken for lost")
    ap.add_argument("--max-in-flight", type=int, default=1024,
                    help="requests in flight beyond which new ones get RESOURCE_EXHAUSTED (HTTP: 429)")
    ap.add_argument("--max-in-flight-per-key", type=int, default=None,
                    help="the share of --max-in-flight the holders of one API key may take (default: half of it "
                         "when --api-key-file holds two keys or more, else all of it)")
    ap.add_argument("--max-prompts-per-request", type=int, default=MAX_PROMPTS,
                    help="prompts one HTTP completions body may hold (more: 400, before any starts)")
    ap.add_argument("--max-samples-per-request", type=int, default=MAX_SAMPLES,
                    help="prompts x n one HTTP body may ask for (more: 400, before any starts)")
    ap.add_argument("--max-request-bytes", type=int, default=4 << 20,
                    help="larger requests are refused with RESOURCE_EXHAUSTED (HTTP bodies: 413, unread)")
    ap.add_argument("--http-port", type=int, default=None,
                    help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                         "/v1/models, /health) on this port, on --host (0: a free port, printed at start)")
    ap.add_argument("--http-header-timeout-s", type=float, default=HttpLimits.header_timeout_s,
                    help="an HTTP connection that has not sent its headers this long after opening is closed")
    ap.add_argument("--http-body-timeout-s", type=float, default=HttpLimits.body_timeout_s,
                    help="an HTTP request whose body has not arrived this long after its headers is closed")
    ap.add_argument("--http-max-connections", type=int, default=HttpLimits.max_connections,
                    help="open HTTP connections beyond which new ones are closed as they open (at most half "
                         "the open files limit, which is raised to its hard limit at start)")
    ap.add_argument("--http-max-connections-per-client", type=int, default=HttpLimits.max_per_client,
                    help="open HTTP connections one client address may hold")
    ap.add_argument("--api-key-file", default=None,
                    help="clients must send 'authorization: Bearer <key>' with a key from this file (one per line, "
                         "optionally 'expires=<ISO time>'); health and reflection stay open")
    ap.add_argument("--shared-prefix-cache", action="store_true",
                    help="with --api-key-file, let the holders of different keys share cached prompt prefixes "
                         "(by default each key's KV blocks are salted apart: a tenant never hits, times or counts "
                         "another's cache)")
    ap.add_argument("--public-tls-cert", default=None,
                    help="what the public port (gRPC and HTTP) serves to clients, with --public-tls-key (default: "
                         "--tls-cert, this router's mesh certificate); the mesh certificate stays its identity "
                         "towards the scheduler and workers")
    ap.add_argument("--public-tls-key", default=None)
    return parse_service_args(ap, "router", argv)


def model_limits(model_dir: Path) -> ModelLimits:
    cfg = json.loads((model_dir / "config.json").read_text())
    return ModelLimits(vocab_size=cfg["vocab_size"], name=model_dir.name,
                       max_position_embeddings=cfg.get("max_position_embeddings"))


async def serve(args: argparse.Namespace) -> None:
    security = MeshSecurity.from_args(args)
    try:
        api_keys = ApiKeys.from_file(args.api_key_file) if args.api_key_file else None
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--api-key-file: {exc}") from None
    model_dir = Path(args.model) if args.model else default_model_written()
    channels = worker_channels(security)
    scheduler_channel = None
    routes: ScheduledRoutes | StaticRoutes
    if args.scheduler:
        scheduler_channel = security.channel(replicas.target(args.scheduler),
                                             KEEPALIVE + replicas.options(SCHEDULER_SERVICE), role="scheduler")
        routes = ScheduledRoutes(scheduler_pb2_grpc.SchedulerServiceStub(scheduler_channel), channels)
    elif args.worker:
        routes = StaticRoutes(Placement(worker=channels.stub(args.worker), worker_address=args.worker))
    elif args.prefill and args.decode:
        routes = StaticRoutes(Placement(prefill=channels.stub(args.prefill), decode=channels.stub(args.decode),
                                        decode_address=args.decode, prefill_address=args.prefill))
    else:
        raise SystemExit("give --scheduler, or --worker, or --prefill and --decode")
    admission = router_admission(args, api_keys)
    migration = MigrationPolicy(max_migrations=args.max_migrations, stall_timeout_s=args.stall_timeout_s,
                                first_token_timeout_s=args.first_token_timeout_s)
    servicer = RouterServicer(routes, Tokenizer.from_dir(model_dir), model_limits(model_dir), migration=migration,
                              admission=admission, api_keys=api_keys, shared_prefix_cache=args.shared_prefix_cache)
    public = public_security(args, security)
    handle = await start_server(
        [Service(SERVICE_NAME, lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, s))],
        args.host, args.port, max_message_bytes=args.max_request_bytes, security=public, api_keys=api_keys,
        public=True)
    front = registry_channel = None
    if args.http_port is not None:
        # only the mesh page reads the registry: no channel to it without the HTTP front
        registry_channel = security.channel(args.registry, KEEPALIVE, role="kv-registry") if args.registry else None
        registry_stub = kv_registry_pb2_grpc.KvRegistryServiceStub(registry_channel) if registry_channel else None
        scheduler_stub = routes.scheduler if isinstance(routes, ScheduledRoutes) else None
        front = OpenAIFront(servicer.core, model_limits(model_dir).name, Tokenizer.from_dir(model_dir),
                            ChatTemplate.from_dir(model_dir), api_keys, args.max_request_bytes,
                            RequestBounds(args.max_prompts_per_request, args.max_samples_per_request),
                            HttpLimits(args.http_header_timeout_s, args.http_body_timeout_s, args.http_max_connections,
                                       args.http_max_connections_per_client),
                            MeshView(model_limits(model_dir).name, servicer.core.runner.journal,
                                     registry_stub, scheduler_stub))
        http_port = await front.start(args.host, args.http_port, tls_cert=args.public_tls_cert or args.tls_cert,
                                      tls_key=args.public_tls_key or args.tls_key)
        scheme = "https" if security.tls else "http"
        print(f"router HTTP (OpenAI API) on {scheme}://{args.host}:{http_port}/v1", flush=True)
    serve_metrics(args.metrics_port, args.host, "router")
    print(f"router ready on {args.host}:{handle.port}", flush=True)

    async def drain() -> None:  # HTTP first: no new request comes in by it while gRPC drains
        if front is not None:
            await front.stop()

    async def close() -> None:
        await channels.close()
        if scheduler_channel is not None:
            await scheduler_channel.close()
        if registry_channel is not None:
            await registry_channel.close()

    await serve_until_signal(handle, close, on_drain=drain)


def router_admission(args: argparse.Namespace, api_keys: ApiKeys | None) -> Admission:
    per_key = args.max_in_flight_per_key
    if per_key is None and api_keys is not None and len(api_keys.keys) > 1:
        per_key = max(1, args.max_in_flight // 2)
    try:
        return Admission(args.max_in_flight, per_key)
    except ValueError as exc:
        raise SystemExit(f"--max-in-flight: {exc}") from None


def public_security(args: argparse.Namespace, mesh: MeshSecurity) -> MeshSecurity:
    """What the public port (gRPC and HTTP) serves: the public certificate, or the mesh one."""
    if not mesh.tls or not (args.public_tls_cert or args.public_tls_key):
        return mesh
    if not (args.public_tls_cert and args.public_tls_key):
        raise SystemExit("security: --public-tls-cert needs --public-tls-key, and the key the certificate")
    return MeshSecurity(cert=Path(args.public_tls_cert).read_bytes(), key=Path(args.public_tls_key).read_bytes(),
                        ca=mesh.ca)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_service("kervan-router", lambda: serve(args))


if __name__ == "__main__":
    main()
