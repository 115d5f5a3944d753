"""``python -m services.worker``: a model worker serving WorkerService over gRPC.

Roles: ``both`` (aggregated: prefill and decode here), ``prefill`` (compute
prompts, push their KV to decode workers), ``decode`` (receive KV, decode)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import grpc

from services.common.server import Service, run, serve_until_signal, start_server
from services.proto import kv_registry_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.worker.async_engine import AsyncEngine
from services.worker.membership import Membership
from services.worker.servicer import WorkerServicer

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m services.worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="Hugging Face model directory (default: embedded model)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port (printed at start)")
    ap.add_argument("--role", choices=["both", "prefill", "decode"], default="both")
    ap.add_argument("--kv-transport", choices=["auto", "shm", "grpc"], default="auto",
                    help="how a prefill worker pushes KV: shared memory (same host), gRPC stream, or auto")
    ap.add_argument("--kv-lease", type=float, default=30.0, help="seconds a KV handoff may take")
    ap.add_argument("--registry", default=None, help="HOST:PORT of the kv-registry to join (optional)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    return ap.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    from worker import Engine
    from worker.default_model import ensure_default_model

    model_dir = args.model or ensure_default_model()
    engine = Engine.from_pretrained(model_dir, dtype=args.dtype,
                                    num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs)
    async_engine = AsyncEngine(engine)
    async_engine.start()  # the engine thread exists before any gRPC object does
    servicer = WorkerServicer(async_engine, args.role, args.kv_transport, args.kv_lease)
    handle = await start_server(
        [Service(SERVICE_NAME, lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, s))],
        args.host, args.port)
    membership_task = registry_channel = None
    if args.registry:
        registry_channel = grpc.aio.insecure_channel(args.registry)
        membership = Membership(kv_registry_pb2_grpc.KvRegistryServiceStub(registry_channel), async_engine,
                                f"{args.host}:{handle.port}", args.role, Path(model_dir).name)
        await membership.register()  # fail at start, not later, if the mesh refuses this worker
        membership_task = asyncio.get_running_loop().create_task(membership.run())
    print(f"worker ready on {args.host}:{handle.port}", flush=True)

    async def on_stop() -> None:
        if membership_task is not None:
            membership_task.cancel()
            await registry_channel.close()
        await servicer.close()
        await asyncio.to_thread(async_engine.stop)

    await serve_until_signal(handle, on_stop)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run(lambda: serve(args))


if __name__ == "__main__":
    main()
