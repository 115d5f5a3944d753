"""One interceptor maps exceptions to gRPC status codes, for every service.

Servicers raise domain errors; clients see a clear status and message, never
INTERNAL for their own mistakes:

    InvalidRequest, ValueError  -> INVALID_ARGUMENT
    Overloaded                  -> RESOURCE_EXHAUSTED
    Unavailable                 -> UNAVAILABLE
    FailedPrecondition          -> FAILED_PRECONDITION
    anything else               -> INTERNAL (logged with its traceback)"""

from __future__ import annotations

import asyncio
import logging

import grpc

from worker.engine.sampling_params import InvalidRequest

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """Admission refused: queues or KV are full. Retry later."""


class Unavailable(Exception):
    """No healthy backend can serve the request right now."""


class NotFound(Exception):
    """The request names something this mesh does not have (e.g. a model)."""


class FailedPrecondition(Exception):
    """The call does not fit this server's state or role (e.g. Decode on a prefill worker)."""


def status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, (InvalidRequest, ValueError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, FailedPrecondition):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, NotFound):
        return grpc.StatusCode.NOT_FOUND
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error")
        await context.abort(code, f"internal error: {type(exc).__name__}")
    await context.abort(code, str(exc))


def _passes_through(exc: BaseException) -> bool:
    # cancellations, and aborts a servicer already chose, are not ours to remap
    return isinstance(exc, (asyncio.CancelledError, grpc.aio.AbortError)) or isinstance(exc, grpc.RpcError)


def _guard_unary(inner):
    """Wrap a behaviour that returns one response (unary-unary or stream-unary)."""
    async def behaviour(request_or_iterator, context):
        try:
            return await inner(request_or_iterator, context)
        except Exception as exc:
            if _passes_through(exc):
                raise
            await _abort(context, exc)
    return behaviour


def _guard_stream(inner):
    """Wrap a behaviour that yields responses (unary-stream)."""
    async def behaviour(request, context):
        try:
            async for response in inner(request, context):
                yield response
        except Exception as exc:
            if _passes_through(exc):
                raise
            await _abort(context, exc)
    return behaviour


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        codec = (handler.request_deserializer, handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_guard_unary(handler.unary_unary), *codec)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_guard_stream(handler.unary_stream), *codec)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_guard_unary(handler.stream_unary), *codec)
        return handler
