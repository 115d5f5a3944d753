"""One request is one OpenTelemetry trace across every process of a disaggregated
cluster: router, scheduler, kv-registry (and its Redis calls), prefill worker (and
the KV push) and decode worker, exported over OTLP (the standard ``OTEL_*`` variables)
to a real OTLP trace receiver in this test; GenAI attributes on the router's span,
the placement on the scheduler's, the engine's first output as an event. A request
whose decode worker is killed mid-stream stays one trace: the migration is an event
on its root, and its continuation on the other worker hangs from the same root."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import defaultdict
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from control_plane.cli.launcher import Cluster, ClusterSpec
from kervan.engine_args import EngineArgs
from tests.cluster_helpers import complete
from tests.conftest import make_prompts


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps every span with its service's name."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                self.spans += [(attrs.get("service.name", ""), span) for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    sink = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sink, port
    server.stop(0)


def attributes(span) -> dict:
    out = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        out[a.key] = getattr(a.value, kind) if kind != "array_value" else [
            v.string_value for v in a.value.array_value.values]
    return out


async def test_one_request_is_one_trace_across_every_process(llama, tmp_path, receiver, monkeypatch):
    sink, port = receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # export every 0.2 s, not 5
    cluster = Cluster(ClusterSpec(llama[1], num_prefill=1, num_decode=2,
                                  engine=EngineArgs(dtype="float32", num_kv_blocks=256),
                                  scheduler_args=("--min-remote-prefill-blocks", "1"),
                                  worker_args=("--max-num-seqs", "1")), tmp_path)  # streams queue: see migrated_trace
    await asyncio.to_thread(cluster.start, 240)
    try:
        prompt = make_prompts([40], seed=46)[0]  # uncached: prefilled on the prefill worker, KV pushed
        out = await complete(cluster, token_ids=prompt, max_tokens=5, temperature=0.0, ignore_eos=True,
                             request_id="traced-1")
        assert out.usage["completion_tokens"] == 5
        expected = {"kervan-router", "kervan-scheduler", "kervan-kv-registry", "kervan-prefill-worker",
                    "kervan-decode-worker"}
        deadline = time.monotonic() + 30
        while True:
            roots = [s for name, s in sink.spans if name == "kervan-router"
                     and attributes(s).get("kervan.request_id") == "traced-1"]
            trace_id = roots[0].trace_id if roots else None
            in_trace = [(name, s) for name, s in sink.spans if s.trace_id == trace_id]
            if roots and expected <= {name for name, _ in in_trace} and any(
                    s.name.endswith("PushKv") for _, s in in_trace):
                break
            assert time.monotonic() < deadline, sorted({(n, s.name) for n, s in sink.spans})
            await asyncio.sleep(0.2)
        migrated = await migrated_trace(cluster, sink)
    finally:
        await asyncio.to_thread(cluster.stop)  # each service flushes what it still batched as it exits
    in_trace = [(name, s) for name, s in sink.spans if s.trace_id == trace_id]
    by_id = {s.span_id: s for _, s in in_trace}
    [root] = [s for _, s in in_trace if not s.parent_span_id]  # one root: the router's Generate
    assert root is roots[0] and root.name.lstrip("/") == "kervan.v1.RouterService/Generate"
    for _, s in in_trace:  # connected: every other span's parent is in the same trace
        assert s is root or s.parent_span_id in by_id, s.name
    names = defaultdict(set)
    for service, s in in_trace:
        names[service].add(s.name.lstrip("/"))  # the gRPC instrumentation names spans "/service/method"
    assert {"kervan.v1.SchedulerService/Place"} <= names["kervan-scheduler"]
    assert "kervan.v1.KvRegistryService/Match" in names["kervan-kv-registry"]
    assert any(not n.startswith("kervan.v1") for n in names["kervan-kv-registry"])  # its Redis calls
    assert "kervan.v1.WorkerService/Prefill" in names["kervan-prefill-worker"]
    assert {"kervan.v1.WorkerService/PushKv", "kervan.v1.WorkerService/Decode"} <= names["kervan-decode-worker"]
    # health checks (the launcher's, every second) are left out of the traces
    assert not [s.name for _, s in sink.spans if "grpc.health" in s.name]
    genai = attributes(root)
    assert genai["gen_ai.operation.name"] == "text_completion" and genai["gen_ai.usage.input_tokens"] == 40
    assert genai["gen_ai.usage.output_tokens"] == 5 and genai["gen_ai.request.max_tokens"] == 5
    [place] = [s for service, s in in_trace if service == "kervan-scheduler" and s.name.endswith("/Place")]
    assert attributes(place)["kervan.placement.reason"] == "remote"
    [prefill] = [s for _, s in in_trace if s.name.endswith("WorkerService/Prefill") and s.kind == 2]  # server
    # the engine's side: the prompt's chunks (the scheduler's 2,048-token budget: one here), then the first token
    assert [e.name for e in prefill.events] == ["kervan.prefill_chunk", "kervan.first_token"]
    chunk = {a.key: a.value.int_value for a in prefill.events[0].attributes if a.key != "kervan.chunk.step_ms"}
    assert chunk == {"kervan.chunk.start": 0, "kervan.chunk.tokens": 40}

    # the migrated request: one trace, its root noting the move, the survivor's spans under it
    root, _ = migrated
    spans = [(name, s) for name, s in sink.spans if s.trace_id == root.trace_id]  # with what the stop flushed
    [event] = [e for e in root.events if e.name == "kervan.migration"]
    assert {a.key for a in event.attributes} >= {"kervan.attempt", "kervan.lost_worker"}
    ids = {s.span_id for _, s in spans}
    orphans = [(n, s.name) for n, s in spans if s is not root and s.parent_span_id not in ids]
    assert not orphans, orphans
    assert any(service == "kervan-decode-worker" and s.kind == 2 for service, s in spans)  # the continuation


async def migrated_trace(cluster, sink):
    """Kill a decode worker under streams that delivered tokens; returns (root span, spans of
    its trace) of a request that migrated."""
    from tests.chaos.checker import streams_decoding_on_one_of
    prompts = make_prompts([20, 21, 22, 23, 24, 25, 26, 27], seed=47)
    # the tiny model decodes 400 tokens in under half a second: with one sequence per worker the
    # eight streams queue on the two decode workers, and the one first seen streaming is killed at
    # once (by a signal from here, not a `kill` process to start); either will do, as placement
    # may give one worker few enough streams to finish before the last client holds its token
    decode = {cluster.addresses[name]: name for name in ("decode-0", "decode-1")}
    tasks, victim = await streams_decoding_on_one_of(cluster.router_address, list(decode), prompts, 480, 120)
    os.kill(cluster.procs[decode[victim]].pid, signal.SIGKILL)
    await asyncio.gather(*tasks)
    deadline = time.monotonic() + 30
    while True:
        roots = [s for name, s in sink.spans if name == "kervan-router" and not s.parent_span_id
                 and any(e.name == "kervan.migration" for e in s.events)]
        for root in roots:
            spans = [(name, s) for name, s in sink.spans if s.trace_id == root.trace_id]
            if any(name == "kervan-decode-worker" and s.kind == 2 for name, s in spans):
                return root, spans
        assert time.monotonic() < deadline, f"{len(roots)} migrated roots, none with its continuation yet"
        await asyncio.sleep(0.2)


def test_tracing_is_off_unless_an_otlp_endpoint_is_set(monkeypatch):
    from services.common.tracing import tracing_requested
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED",
                 "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    assert not tracing_requested()  # nothing set: nothing installed, spans are no-ops
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4317")
    assert tracing_requested()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not tracing_requested()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing_requested()
