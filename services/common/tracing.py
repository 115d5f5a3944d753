"""OpenTelemetry tracing, configured by the standard ``OTEL_*`` environment variables.

When ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is
set, ``configure_tracing`` installs the SDK's tracer provider with a batching OTLP
exporter, instruments every ``grpc.aio`` server and channel (W3C trace context in
gRPC metadata, so one request is one trace across processes) and the Redis client.
Health checks and reflection are left out. With nothing set, nothing is installed:
the API's no-op tracer makes every span below cost a function call.

``OTEL_SERVICE_NAME`` overrides a service's name; ``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none`` turns tracing off; the exporter reads the rest of its
settings (headers, TLS, timeouts, ``OTEL_BSP_*``) from the environment itself."""

from __future__ import annotations

import atexit
import os

from opentelemetry import trace

TRACER = trace.get_tracer("kervan")
EXCLUDED_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                     "grpc.reflection.v1.ServerReflection")


def tracing_requested() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower() == "none":
        return False
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def configure_tracing(service_name: str) -> bool:
    """Install tracing for this process when the environment asks for it; returns
    whether it did. Call before any gRPC server or channel is created."""
    if not tracing_requested():
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcAioInstrumentorServer
    from opentelemetry.instrumentation.grpc.filters import any_of, negate
    from opentelemetry.instrumentation.grpc.filters import service_name as service_is
    from opentelemetry.instrumentation.redis import RedisInstrumentor
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or service_name})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)  # what is still batched goes out when the service stops
    traced = negate(any_of(*(service_is(name) for name in EXCLUDED_SERVICES)))
    GrpcAioInstrumentorServer(filter_=traced).instrument()
    GrpcAioInstrumentorClient(filter_=traced).instrument()
    RedisInstrumentor().instrument()
    return True
