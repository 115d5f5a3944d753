"""RouterService over gRPC: a caller's API key and deadline from the call, then the
router's core (``core.py``); the mesh's own failure becomes the call's status."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from kervan.tokenizer import Tokenizer
from services.common.auth import ApiKeys
from services.proto import router_pb2, router_pb2_grpc
from services.router.admission import Admission
from services.router.core import Deadline, MeshFailure, ModelLimits, RouterCore
from services.router.routes import ScheduledRoutes, StaticRoutes
from services.router.runner import MigrationPolicy


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """``api_keys``: the keys the public API takes (the interceptor has checked the call's); with
    them, slots are shared per key (``admission``) and, unless ``shared_prefix_cache``, each
    key's prompts are salted apart."""

    def __init__(self, routes: StaticRoutes | ScheduledRoutes, tokenizer: Tokenizer | None, limits: ModelLimits, *,
                 max_in_flight: int = 1024, migration: MigrationPolicy | None = None,
                 admission: Admission | None = None, api_keys: ApiKeys | None = None,
                 shared_prefix_cache: bool = False):
        self.api_keys = api_keys
        self.core = RouterCore(routes, tokenizer, limits, admission or Admission(max_in_flight), migration,
                               salt_per_key=api_keys is not None and not shared_prefix_cache)

    @property
    def in_flight(self) -> set[str]:
        return self.core.in_flight

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        key = "" if self.api_keys is None else self.api_keys.identity(dict(context.invocation_metadata() or ()))  # type: ignore[arg-type]  # str pairs
        try:
            async for response in self.core.generate(request, key, Deadline(context.time_remaining())):
                yield response
        except MeshFailure as exc:
            await context.abort(exc.code, str(exc))
