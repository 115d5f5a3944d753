"""A prefill worker pushes KV only to an address the registry lists as a decode or both worker."""

import pytest

from services.common.errors import Aborted
from services.proto import kv_registry_pb2
from services.worker.decode_peers import DecodePeers


class Registry:
    async def ListWorkers(self, request, timeout=None):
        roles = {"d:1": kv_registry_pb2.WORKER_ROLE_DECODE, "b:1": kv_registry_pb2.WORKER_ROLE_BOTH,
                 "p:1": kv_registry_pb2.WORKER_ROLE_PREFILL}
        return kv_registry_pb2.ListWorkersResponse(workers=[
            kv_registry_pb2.LiveWorker(info=kv_registry_pb2.WorkerInfo(address=a, role=r)) for a, r in roles.items()])


async def test_only_decoding_roles_are_push_targets():
    peers = DecodePeers(Registry())
    try:
        assert await peers.stub("d:1") is not None and await peers.stub("b:1") is not None
        with pytest.raises(Aborted, match="'p:1' is not a registered decode worker"):
            await peers.stub("p:1")
    finally:
        await peers.close()
