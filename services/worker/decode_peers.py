"""The decode workers a prefill worker may push KV to, the workers any worker may fetch KV
blocks from (the cluster KV tier: any role), and its channels to them.

``Prefill.decode_address`` comes from the caller: taken as is, it would have this
worker open connections to any host the caller names, and keep a channel per
name for ever. With a registry, only the addresses of live decode (or
aggregated) workers are accepted; the live set is read at most every
``refresh_s`` (and again at once for an address not in it, so a worker that just
joined is found), and the channel to a worker that left is closed. Channels are
bounded either way (``services/common/channels.py``): past ``max_channels`` the least
recently used one closes."""

from __future__ import annotations

import time

import grpc

from services.common.channels import ChannelPool
from services.common.convert import role_from_proto
from services.common.errors import Aborted, Unavailable
from services.common.security import PLAINTEXT, MeshSecurity
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc, worker_pb2_grpc
from worker import InvalidRequest

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]


class DecodePeers:
    def __init__(self, registry: kv_registry_pb2_grpc.KvRegistryServiceStub | None = None,
                 security: MeshSecurity = PLAINTEXT, refresh_s: float = 1.0, max_channels: int = 64):
        self.registry = registry
        self.refresh_s = refresh_s
        self._live: set[str] = set()  # decode-capable workers
        self._registered: set[str] = set()  # every worker
        self._read_at = float("-inf")
        self._channels = ChannelPool(worker_pb2_grpc.WorkerServiceStub, security, CHANNEL_OPTIONS,
                                     max_channels=max_channels)

    async def stub(self, address: str, any_role: bool = False) -> worker_pb2_grpc.WorkerServiceStub:
        """A channel to a registered decode worker (``any_role``: to any registered worker)."""
        if not address:
            raise InvalidRequest("decode_address is empty")
        if self.registry is not None:
            known = self._registered if any_role else self._live
            if address not in known or time.monotonic() - self._read_at > self.refresh_s:
                await self._refresh()
                known = self._registered if any_role else self._live
            if address not in known:
                # ABORTED, not INVALID_ARGUMENT: a worker that just left is the router's to place around
                raise Aborted(f"{address!r} is not a registered {'' if any_role else 'decode '}worker")
        return self._channels.stub(address)

    async def _refresh(self) -> None:
        assert self.registry is not None  # only a worker with a registry refreshes
        try:
            reply = await self.registry.ListWorkers(kv_registry_pb2.ListWorkersRequest(), timeout=2)
        except grpc.aio.AioRpcError as err:
            if self._live:  # the last view, while the registry is away
                return
            raise Unavailable(f"cannot check decode_address: kv-registry {err.code().name}") from None
        self._read_at = time.monotonic()
        self._live = {w.info.address for w in reply.workers if role_from_proto(w.info.role).can_decode}
        self._registered = {w.info.address for w in reply.workers}
        for address in [a for a in self._channels.addresses() if a not in self._registered]:
            await self._channels.discard(address)

    @property
    def num_channels(self) -> int:
        return len(self._channels)

    async def close(self) -> None:
        await self._channels.close()
