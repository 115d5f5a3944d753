"""One interceptor maps exceptions to gRPC status codes, for every service.

Servicers raise domain errors; clients see a clear status and message, never
INTERNAL for their own mistakes:

    InvalidRequest              -> INVALID_ARGUMENT
    Overloaded                  -> RESOURCE_EXHAUSTED
    Unavailable, Redis down     -> UNAVAILABLE
    FailedPrecondition          -> FAILED_PRECONDITION
    NotFound, AlreadyExists     -> NOT_FOUND, ALREADY_EXISTS
    PermissionDenied            -> PERMISSION_DENIED
    Aborted                     -> ABORTED (a peer of this server failed the call: not this server)
    anything else               -> INTERNAL (logged with its traceback and the request id)

Only the domain's own exceptions name a client mistake: a ``ValueError`` from deep
inside (a block pool out of blocks, a shape that does not match) is Kervan's fault,
and says so."""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.protobuf.duration_pb2 import Duration
from google.rpc import status_pb2
from google.rpc.error_details_pb2 import RetryInfo
from grpc_status import rpc_status
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MasterDownError, OutOfMemoryError, ReadOnlyError, ResponseError, TryAgainError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kervan.sampling import InvalidRequest
from services.common.metrics import RPC_ERRORS

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """Admission refused: queues or KV are full. Retry later (the status carries a
    google.rpc.RetryInfo with ``retry_after_s``)."""

    def __init__(self, message: str, retry_after_s: float = 0.5):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(Exception):
    """No healthy backend can serve the request right now."""


class NotFound(Exception):
    """The request names something this mesh does not have (e.g. a model)."""


class AlreadyExists(Exception):
    """The request names something that exists already (e.g. an in-flight request id)."""


class PermissionDenied(Exception):
    """The caller's identity may not do this (a worker certificate registering another's address)."""


class Aborted(Exception):
    """The call failed on another server this one depends on (a prefill worker's KV push
    to its decode worker): the caller should not blame this server."""


class FailedPrecondition(Exception):
    """The call does not fit this server's state or role (e.g. Decode on a prefill worker)."""


_UNSERVED = re.compile(r"(?:^|caused error: (?:\(')?|@user_script: ?\d+: -)"
                       r"(?:BUSY|MISCONF|OOM|READONLY|MASTERDOWN|TRYAGAIN|LOADING) ")


def redis_unavailable(exc: BaseException) -> bool:
    """A Redis that answers but cannot serve now — a script running past its limit (BUSY),
    memory full (OOM), persistence failing (MISCONF), a read-only replica, a failover in
    progress: the caller may try again or fall back, as when Redis is unreachable."""
    if isinstance(exc, (OutOfMemoryError, ReadOnlyError, MasterDownError, TryAgainError)):
        return True
    # as Redis words it, or wrapped by redis-py's pipeline ("Command # 1 (MGET ...) of pipeline
    # caused error: ('BUSY Redis is busy running a script...',)", or without the tuple from
    # redis-py 8: "... caused error: BUSY Redis is busy ..."), or inside a script by Redis 6, which
    # wraps what redis.call met ("Error running script (call to f_...): @user_script:3:
    # @user_script: 3: -OOM command not allowed ..."; Redis 7 answers the OOM itself)
    return isinstance(exc, ResponseError) and _UNSERVED.search(str(exc)) is not None


def status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, (Unavailable, RedisConnectionError, RedisTimeoutError)) or redis_unavailable(exc):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, FailedPrecondition):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, NotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, AlreadyExists):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(exc, Aborted):
        return grpc.StatusCode.ABORTED
    if isinstance(exc, PermissionDenied):
        return grpc.StatusCode.PERMISSION_DENIED
    return grpc.StatusCode.INTERNAL


def overloaded_status(exc: Overloaded) -> grpc.Status:
    """RESOURCE_EXHAUSTED with a google.rpc.RetryInfo: when to try again."""
    delay = Duration()
    delay.FromMilliseconds(int(exc.retry_after_s * 1000))
    detail = any_pb2.Any()
    detail.Pack(RetryInfo(retry_delay=delay))
    status: grpc.Status = rpc_status.to_status(status_pb2.Status(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                                  message=str(exc), details=[detail]))
    return status


def retry_after_s(err: grpc.aio.AioRpcError) -> float | None:
    """The RetryInfo delay of a failed call, if its status carries one."""
    status = rpc_status.from_call(err)
    for detail in status.details if status else ():
        if detail.Is(RetryInfo.DESCRIPTOR):
            info = RetryInfo()
            detail.Unpack(info)
            delay_ms: int = info.retry_delay.ToMilliseconds()
            return delay_ms / 1000
    return None


# a handler's behaviour, (request or request iterator, context) -> response or responses, and a
# function that wraps one
Behaviour = Callable[..., Any]
Wrap = Callable[[Behaviour], Behaviour]


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: Exception, request: object = None,
                 method: str = "") -> None:
    code = status_for(exc)
    RPC_ERRORS.labels(method, code.name).inc()
    if isinstance(exc, Overloaded):
        await context.abort_with_status(overloaded_status(exc))
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error in %s (request_id %r)", context.peer(), getattr(request, "request_id", ""))
        await context.abort(code, f"internal error: {type(exc).__name__}")
    await context.abort(code, str(exc))


def _passes_through(exc: BaseException) -> bool:
    # cancellations, and aborts a servicer already chose, are not ours to remap
    return isinstance(exc, (asyncio.CancelledError, grpc.aio.AbortError)) or isinstance(exc, grpc.RpcError)


def _guard_unary(inner: Behaviour, method: str) -> Behaviour:
    """Wrap a behaviour that returns one response (unary-unary or stream-unary)."""
    async def behaviour(request_or_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            return await inner(request_or_iterator, context)
        except Exception as exc:
            if _passes_through(exc):
                raise
            await _abort(context, exc, request_or_iterator, method)
    return behaviour


def _guard_stream(inner: Behaviour, method: str) -> Behaviour:
    """Wrap a behaviour that yields responses (unary-stream), or one that writes them with
    ``context.write`` and returns nothing (the health service's ``Watch``)."""
    if not inspect.isasyncgenfunction(inner):
        return _guard_unary(inner, method)

    async def behaviour(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        try:
            async for response in inner(request, context):
                yield response
        except Exception as exc:
            if _passes_through(exc):
                raise
            await _abort(context, exc, request, method)
    return behaviour


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        return rewrap(handler, lambda inner: _guard_unary(inner, method), lambda inner: _guard_stream(inner, method))


def rewrap(handler: grpc.RpcMethodHandler[Any, Any], wrap_unary: Wrap,
           wrap_stream: Wrap) -> grpc.RpcMethodHandler[Any, Any]:
    """The same handler with its behaviour wrapped: ``wrap_unary`` for behaviours that
    return one response, ``wrap_stream`` for those that yield them (stream-stream as is)."""
    codec = (handler.request_deserializer, handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), *codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap_stream(handler.unary_stream), *codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap_unary(handler.stream_unary), *codec)
    return handler
