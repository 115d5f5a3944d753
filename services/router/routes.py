"""Where the router sends a request: fixed workers, or the scheduler's choice.

``ScheduledRoutes`` hashes the prompt's full blocks with the mesh's block-hash
module (the same one the workers and the registry use), asks the scheduler to
place it, and keeps one channel per worker address."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kervan.block_hash import HASH_NAME, hash_blocks
from services.common.channels import ChannelPool
from services.common.errors import FailedPrecondition
from services.common.security import PLAINTEXT, MeshSecurity
from services.common.server import KEEPALIVE
from services.proto import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2_grpc


@dataclass(frozen=True)
class Placement:
    """Where a request runs: ``worker`` alone, or ``prefill`` then ``decode``."""

    worker: worker_pb2_grpc.WorkerServiceStub | None = None
    prefill: worker_pb2_grpc.WorkerServiceStub | None = None
    decode: worker_pb2_grpc.WorkerServiceStub | None = None
    decode_address: str = ""
    worker_address: str = ""
    prefill_address: str = ""
    kv_source: common_pb2.KvSource | None = None  # blocks the computing worker fetches (the cluster KV tier)
    reason: str = ""  # the scheduler's prefill reason (why remotely, or not)


Channels = ChannelPool[worker_pb2_grpc.WorkerServiceStub]


def worker_channels(security: MeshSecurity = PLAINTEXT) -> Channels:
    """The router's channels to workers, with keepalive pings (a worker that vanishes fails
    its streams in seconds). An address not placed on for the longest is closed once 1,024
    are open; the streams still on it get a minute."""
    return ChannelPool(worker_pb2_grpc.WorkerServiceStub, security, KEEPALIVE, max_channels=1024,
                       close_grace_s=60.0)


class StaticRoutes:
    alternatives = False  # one fixed placement: a worker's refusal is the answer

    def __init__(self, placement: Placement):
        self.placement = placement

    async def route(self, request_id: str, prompt: list[int], max_tokens: int, n: int, timeout: float | None,
                    model: str = "", exclude: Sequence[str] = (), avoid: Sequence[str] = (), cache_salt: str = ""
                    ) -> Placement:
        p = self.placement
        if p.worker is None and n > 1:  # FORKED_SAMPLES: the decode worker prefills too
            return Placement(worker=p.decode, worker_address=p.decode_address)
        return p


class ScheduledRoutes:
    alternatives = True  # the scheduler can place a refused request elsewhere

    def __init__(self, scheduler: scheduler_pb2_grpc.SchedulerServiceStub, channels: Channels):
        self.scheduler = scheduler
        self.channels = channels
        self.block_size: int | None = None  # the mesh's, from the registry through the scheduler

    async def mesh_block_size(self, timeout: float | None) -> int:
        """The block size the workers and the registry use, asked on first need (the router
        may start before them) and kept; a mesh that hashes otherwise is refused, not
        served with prefix hits that silently never match."""
        if self.block_size is None:
            answer = await self.scheduler.GetMeshConfig(scheduler_pb2.SchedulerServiceGetMeshConfigRequest(),
                                                        timeout=timeout)
            if answer.config.hash_name != HASH_NAME or not answer.config.block_size:
                raise FailedPrecondition(f"the mesh hashes blocks of {answer.config.block_size} tokens with "
                                         f"{answer.config.hash_name!r}; this router hashes with {HASH_NAME!r}")
            self.block_size = answer.config.block_size
        return self.block_size

    async def route(self, request_id: str, prompt: list[int], max_tokens: int, n: int, timeout: float | None,
                    model: str = "", exclude: Sequence[str] = (), avoid: Sequence[str] = (), cache_salt: str = ""
                    ) -> Placement:
        """``exclude``: worker addresses this request found unreachable (the registry may
        not know yet); ``avoid``: those other requests did lately, most recent first
        (the scheduler avoids some of them, see PlaceRequest.avoid_addresses). A
        request no worker's limits hold is refused by the scheduler (INVALID_ARGUMENT)."""
        block_size = await self.mesh_block_size(timeout)
        placed = await self.scheduler.Place(scheduler_pb2.PlaceRequest(
            request_id=request_id, block_hashes=hash_blocks(prompt, block_size, cache_salt.encode()),
            num_prompt_tokens=len(prompt),
            max_tokens=max_tokens, n=n, model=model, exclude_addresses=exclude, avoid_addresses=avoid),
            timeout=timeout)
        source = placed.kv_source if placed.HasField("kv_source") else None
        if not placed.prefill_address:
            return Placement(worker=self.channels.stub(placed.decode_address), worker_address=placed.decode_address,
                             kv_source=source, reason=placed.prefill_reason)
        return Placement(prefill=self.channels.stub(placed.prefill_address),
                         decode=self.channels.stub(placed.decode_address), decode_address=placed.decode_address,
                         prefill_address=placed.prefill_address, kv_source=source, reason=placed.prefill_reason)
