"""``python -m services.worker``: a model worker serving WorkerService over gRPC.

Roles: ``both`` (aggregated: prefill and decode here), ``prefill`` (compute
prompts, push their KV to decode workers), ``decode`` (receive KV, decode)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import threading
from pathlib import Path

from prometheus_client import REGISTRY

from kervan import engine_args
from kervan.worker_info import WorkerRole
from services.common import replicas
from services.common.advertise import advertised
from services.common.config import parse_service_args, service_parser
from services.common.metrics import serve_metrics
from services.common.security import MeshSecurity
from services.common.server import Service, configure_logging, run, serve_until_signal, start_server
from services.common.tracing import configure_tracing
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.worker.async_engine import AsyncEngine
from services.worker.decode_peers import DecodePeers
from services.worker.kv_transfer import sweep_stale_segments
from services.worker.membership import Membership
from services.worker.metrics import EngineCollector, KernelChoiceCollector
from services.worker.servicer import CALLERS, WorkerServicer
from worker.config import ConfigError
from worker.platform import dtype_name

log = logging.getLogger("services.worker")
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
REGISTRY_SERVICE = kv_registry_pb2.DESCRIPTOR.services_by_name["KvRegistryService"].full_name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = service_parser("services.worker", __doc__)
    ap.add_argument("--model", default=None, help="Hugging Face model directory (default: embedded model)")
    ap.add_argument("--role", type=WorkerRole, choices=list(WorkerRole), default=WorkerRole.BOTH)
    ap.add_argument("--kv-transport", choices=["auto", "shm", "grpc"], default="auto",
                    help="how a prefill worker pushes KV: shared memory (same host), gRPC stream, or auto")
    ap.add_argument("--kv-lease", type=float, default=30.0,
                    help="seconds a KV handoff may take, and the longest received KV waits for its Decode")
    ap.add_argument("--max-concurrent-pushes", type=int, default=16,
                    help="KV pushes received at once beyond which more get RESOURCE_EXHAUSTED")
    ap.add_argument("--drain-grace", type=float, default=5.0,
                    help="seconds a drain (SIGTERM) lets streams in flight finish; the router moves the rest "
                         "to another worker (keep it under the orchestrator's kill grace)")
    ap.add_argument("--registry", default=None, help="HOST:PORT of the kv-registry to join (optional)")
    ap.add_argument("--advertise-address", default=None,
                    help="HOST:PORT others reach this worker at, when not the one it binds (a proxy, a Service); "
                         "HOST 'auto': this machine's address on the route to the registry (replicas of a compose "
                         "service)")
    engine_args.add_arguments(ap)
    ap.add_argument("--max-step-failures", type=int, default=3,
                    help="engine steps failing in a row after which the worker leaves the mesh and exits (70)")
    ap.add_argument("--engine-wedge-timeout-s", type=float, default=120.0,
                    help="an engine thread that finishes no step for this long is wedged: the worker leaves the "
                         "mesh and exits (70)")
    ap.add_argument("--max-waiting", type=int, default=256,
                    help="requests queued beyond a full batch before new ones get RESOURCE_EXHAUSTED")
    return parse_service_args(ap, "worker", argv)


async def serve(args: argparse.Namespace, async_engine: AsyncEngine, model_dir: Path, stop: asyncio.Event) -> None:
    security = MeshSecurity.from_args(args)
    registry_channel = registry = None
    if args.registry:
        registry_channel = security.channel(replicas.target(args.registry), replicas.options(REGISTRY_SERVICE),
                                        role="kv-registry")
        registry = kv_registry_pb2_grpc.KvRegistryServiceStub(registry_channel)
    servicer = WorkerServicer(async_engine, args.role, args.kv_transport, args.kv_lease,
                              DecodePeers(registry, security), args.max_concurrent_pushes)
    handle = await start_server(
        [Service(SERVICE_NAME, lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, s), CALLERS)],
        args.host, args.port, security=security)
    membership = membership_task = None
    if registry is not None:
        address = advertised(args.advertise_address, args.registry) if args.advertise_address \
            else f"{args.host}:{handle.port}"
        membership = Membership(registry, async_engine, address,
                                args.role, model_dir.name, on_unhealthy=lambda why: os._exit(70))
        await membership.register()  # fail at start, not later, if the mesh refuses this worker
        membership_task = asyncio.get_running_loop().create_task(membership.run())
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(_sweep_segments())]
    if membership is None:  # with a registry, membership leaves the mesh first, then exits
        tasks.append(loop.create_task(_exit_when_unhealthy(async_engine, handle)))
    if args.metrics_port is not None:
        REGISTRY.register(EngineCollector(async_engine))
        REGISTRY.register(KernelChoiceCollector(async_engine.engine.runner.kernel_choices))
        serve_metrics(args.metrics_port, args.host, "worker")
    print(f"worker ready on {args.host}:{handle.port}", flush=True)

    async def on_drain() -> None:
        if membership_task is not None:
            membership_task.cancel()  # no heartbeat may re-register this worker now
            await asyncio.gather(membership_task, return_exceptions=True)
        if membership is not None:
            await membership.deregister()

    async def on_stop() -> None:  # after on_drain: the membership task is done
        for task in tasks:
            task.cancel()
        if registry_channel is not None:
            await registry_channel.close()
        await servicer.close()

    await serve_until_signal(handle, on_stop, grace=args.drain_grace, stop=stop, on_drain=on_drain)


async def _sweep_segments(interval_s: float = 5.0) -> None:
    """KV segments of processes that died mid-handoff, removed by whichever worker looks
    first (at start too: ``main``)."""
    while True:
        await asyncio.sleep(interval_s)
        sweep_stale_segments()


async def _exit_when_unhealthy(engine: AsyncEngine, handle, interval_s: float = 1.0) -> None:
    """An engine that no longer serves (``AsyncEngine.health``): health NOT_SERVING, for
    probes and load balancers, then exit 70 for the supervisor to restart the worker."""
    while (why := engine.health()) is None:
        await asyncio.sleep(interval_s)
    log.critical("the engine no longer serves: %s", why)
    await handle.set_serving(False)
    os._exit(70)


def main(argv: list[str] | None = None) -> None:
    """The engine steps on the main thread, the only thread that runs torch: a second
    thread calling into OpenMP/oneDNN makes every matmul markedly slower here. gRPC and
    asyncio run on a side thread."""
    from worker import Engine
    from worker.default_model import ensure_default_model
    from worker.platform import current_platform

    args = parse_args(argv)
    configure_logging()
    configure_tracing(f"kervan-{args.role}-worker")
    log.info("platform: %s", current_platform().summary())
    sweep_stale_segments()
    model_dir = Path(args.model) if args.model else ensure_default_model()
    try:
        engine = Engine.from_pretrained(model_dir, **engine_args.from_namespace(args))
    except ConfigError as exc:
        raise SystemExit(f"worker: {exc}") from None
    log.info("engine: %s on %s, native CPU kernels %s%s", dtype_name(engine.config.dtype), engine.config.device,
             "on" if engine.uses_native_kernels else "off", ", deterministic" if engine.config.deterministic else "")
    # a worker group that lost a rank exits at once: the mesh sees one dead worker, its requests move
    async_engine = AsyncEngine(engine, args.max_waiting, on_group_failed=lambda exc: os._exit(70),
                               max_step_failures=args.max_step_failures, wedge_timeout_s=args.engine_wedge_timeout_s)
    loop_ready = threading.Event()
    holder: dict = {}

    async def side() -> None:
        holder["loop"], holder["stop"] = asyncio.get_running_loop(), asyncio.Event()
        loop_ready.set()
        try:
            await serve(args, async_engine, model_dir, holder["stop"])
        finally:
            async_engine.request_stop()

    def request_stop(*_: object) -> None:
        if "loop" in holder:
            holder["loop"].call_soon_threadsafe(holder["stop"].set)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    thread = threading.Thread(target=run, args=(side,), name="grpc")
    thread.start()
    loop_ready.wait()
    async_engine.run()  # returns once the server has drained
    thread.join()
    engine.close()  # a worker group's other ranks stop with it


if __name__ == "__main__":
    main()
