"""In-process services on loopback: a real worker (the engine on a tiny model) and
a real router, each a grpc.aio server on 127.0.0.1:0."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.common.server import Service, start_server
from services.proto import router_pb2_grpc, worker_pb2_grpc
from services.router.__main__ import SERVICE_NAME as ROUTER_NAME
from services.router.__main__ import model_limits
from services.router.servicer import RouterServicer
from services.worker.__main__ import SERVICE_NAME as WORKER_NAME
from services.worker.async_engine import AsyncEngine
from services.worker.servicer import WorkerServicer
from tests.conftest import make_engine
from worker.tokenizer import Tokenizer


@dataclass
class Mesh:
    engine: AsyncEngine
    worker_port: int
    router_port: int
    router: router_pb2_grpc.RouterServiceStub
    worker: worker_pb2_grpc.WorkerServiceStub


async def start_mesh(model_dir: Path, **engine_options):
    engine = AsyncEngine(make_engine(model_dir, **engine_options))
    engine.start()
    worker_servicer = WorkerServicer(engine)
    worker = await start_server([Service(WORKER_NAME, lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(
        worker_servicer, s))])
    worker_channel = grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}")
    router_servicer = RouterServicer(worker_pb2_grpc.WorkerServiceStub(worker_channel), Tokenizer.from_dir(model_dir),
                                     model_limits(Path(model_dir)))
    router = await start_server([Service(ROUTER_NAME, lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(
        router_servicer, s))])
    await worker.set_serving(True)
    await router.set_serving(True)
    client = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
    mesh = Mesh(engine, worker.port, router.port, router_pb2_grpc.RouterServiceStub(client),
                worker_pb2_grpc.WorkerServiceStub(worker_channel))

    async def stop():
        await client.close()
        await router.stop(0)
        await worker_channel.close()
        await worker.stop(0)
        engine.stop()
    return mesh, stop


@pytest.fixture
async def llama_mesh(llama):
    mesh, stop = await start_mesh(llama[1])
    yield mesh
    await stop()


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory):
    from worker.default_model import write_model
    path = tmp_path_factory.mktemp("default-model")
    write_model(path)
    assert json.loads((path / "config.json").read_text())["vocab_size"] > 0
    return path


@pytest.fixture
async def text_mesh(default_model_dir):
    mesh, stop = await start_mesh(default_model_dir, dtype="bfloat16", block_size=16, num_kv_blocks=256)
    yield mesh
    await stop()
