"""The mesh against the in-process engine, and KV transfer against a plain copy.

1. The same workload (prompts and output lengths drawn from ranges, greedy,
   ``ignore_eos``) at 1 and at 32 concurrent requests, through
   - the engine in this process (requests added as others finish),
   - the full mesh started like ``kervan up`` (router -> scheduler -> prefill worker
     -> KV push -> decode worker, all over loopback, each its own process), and
   - the same services around one aggregated worker;
   output tokens/s, time to first token and inter-token latency (p50, p99).
   With ``--topologies mesh,mesh_traced``: the full mesh again with OpenTelemetry on
   (``OTEL_EXPORTER_OTLP_ENDPOINT`` pointing at an OTLP receiver in this process that
   counts the spans), against the mesh with nothing configured: what tracing costs.
   With ``mesh_tls`` among them: the full mesh on mutual TLS (``kervan up --tls``),
   against the plaintext one: what encryption and certificate checks cost.
2. KV transfer: the prompt KV of the default model pushed to a decode worker in
   another process through the shared-memory and the gRPC-stream paths, against a
   plain shared-memory copy of the same bytes (copy in, copy out) in this process,
   made as the push makes it (a new segment each time: page faults included), and
   against the floor: the same copies through a segment and a buffer made and
   touched beforehand (``warm``).
   Workers are pinned one per core (``ClusterSpec(pin_cores=True)``); the engine
   baseline runs on both cores in this process.

    python -m benchmarks.mesh_throughput            # ~8 min on the embedded default model
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import grpc
import torch

from benchmarks import plots
from benchmarks.load import pct_ms, run_closed_loop
from benchmarks.machine import add_dtype_argument, machine
from control_plane.launcher import Cluster, ClusterSpec, free_port, new_log_dir
from services.proto import worker_pb2_grpc
from services.worker import kv_transfer
from worker import Engine, SamplingParams
from worker.default_model import ensure_default_model


def workload(num, prompt_range, output_range, vocab, seed):
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
            for _ in range(num)]


def summary(seconds, tokens, ttfts, itls) -> dict:
    return {"output_tokens_per_s": round(tokens / seconds, 1), "seconds": round(seconds, 2),
            "ttft_ms": {"p50": pct_ms(ttfts, 50), "p99": pct_ms(ttfts, 99)},
            "itl_ms": {"p50": pct_ms(itls, 50), "p99": pct_ms(itls, 99)}}


def unfinished(engine: Engine) -> int:
    stats = engine.stats()
    return stats.num_running + stats.num_waiting


def run_engine(engine: Engine, work, concurrency: int) -> dict:
    pending = list(enumerate(work))
    started, last, ttfts, itls = {}, {}, [], []
    tokens = 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and unfinished(engine) < concurrency:
            _, (prompt, n) = pending.pop(0)
            rid = engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            started[rid] = time.perf_counter()
        for out in engine.step():
            now = time.perf_counter()
            new = len(out.outputs[0].new_token_ids)
            if not new:
                continue
            tokens += new
            if out.request_id not in last:
                ttfts.append(now - started[out.request_id])
            else:
                itls += [(now - last[out.request_id]) / new] * new
            last[out.request_id] = now
    return summary(time.perf_counter() - t0, tokens, ttfts, itls)


async def run_mesh(cluster: Cluster, work, concurrency: int) -> dict:
    results, seconds = await run_closed_loop(cluster.router_address, work, concurrency,
                                             security=cluster.client_security)
    return summary(seconds, sum(r.tokens for r in results), [r.ttft for r in results],
                   [x for r in results for x in r.itls])


def warm_copy_bytes_per_s(data: torch.Tensor, rounds: int) -> float:
    """The floor: the same copy in and out of one segment created and touched beforehand,
    into a buffer allocated beforehand (no page faults, no segment creation timed)."""
    raw = data.contiguous().view(torch.uint8).reshape(-1)
    shm = shared_memory.SharedMemory(create=True, size=raw.numel())
    try:
        seg = torch.frombuffer(shm.buf, dtype=torch.uint8, count=raw.numel())
        out = torch.empty_like(raw)
        seg.copy_(raw)
        out.copy_(seg)
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            seg.copy_(raw)
            out.copy_(seg)
            best = min(best, time.perf_counter() - t0)
        del seg
    finally:
        shm.close()
        shm.unlink()
    return raw.numel() / best


def plain_copy_bytes_per_s(data: torch.Tensor, rounds: int) -> float:
    raw = data.contiguous().view(torch.uint8).reshape(-1)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        shm = shared_memory.SharedMemory(create=True, size=raw.numel())
        torch.frombuffer(shm.buf, dtype=torch.uint8, count=raw.numel()).copy_(raw)
        out = torch.frombuffer(shm.buf, dtype=torch.uint8, count=raw.numel()).clone()
        shm.close()
        shm.unlink()
        best = min(best, time.perf_counter() - t0)
        del out
    return raw.numel() / best


async def push_bytes_per_s(address: str, data: torch.Tensor, use_shm: bool, rounds: int) -> float:
    best = float("inf")
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        for r in range(rounds):
            t0 = time.perf_counter()
            if use_shm:
                export = kv_transfer.SharedMemoryExport(data)
                head = kv_transfer.header(f"r{r}", [5], data, 30, export.name)
                messages = _one(kv_transfer.worker_pb2.PushKvRequest(header=head))
            else:
                export = None
                messages = kv_transfer.stream_messages(kv_transfer.header(f"r{r}", [5], data, 30), data)
            await stub.PushKv(messages, timeout=60)
            if export is not None:
                export.close()
            best = min(best, time.perf_counter() - t0)
            await stub.Abort(kv_transfer.worker_pb2.AbortRequest(request_id=f"r{r}"))  # drop the staged copy
    return data.numel() * data.element_size() / best


async def _one(message):
    yield message


def kv_transfer_report(model_dir: Path, dtype: str, num_tokens: int, rounds: int) -> dict:
    engine = Engine.from_pretrained(model_dir, dtype=dtype, num_kv_blocks=512)
    data = torch.randn(engine.kv_block_shape(num_tokens)).to(engine.config.dtype)
    del engine
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.worker", "--role", "decode", "--port", str(port),
                             "--model", str(model_dir), "--num-kv-blocks", "64", "--dtype", dtype],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        proc.stdout.readline()  # "worker ready on ..."
        address = f"127.0.0.1:{port}"
        shm = asyncio.run(push_bytes_per_s(address, data, True, rounds))
        stream = asyncio.run(push_bytes_per_s(address, data, False, rounds))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    plain = plain_copy_bytes_per_s(data, rounds)
    warm = warm_copy_bytes_per_s(data, rounds)
    nbytes = data.numel() * data.element_size()
    return {"kv_bytes": nbytes, "prompt_tokens": num_tokens,
            "plain_shm_copy_gb_per_s": round(plain / 1e9, 2), "warm_shm_copy_gb_per_s": round(warm / 1e9, 2),
            "shared_memory_vs_warm": round(shm / warm, 2),
            "shared_memory_push_gb_per_s": round(shm / 1e9, 2),
            "grpc_stream_push_gb_per_s": round(stream / 1e9, 2),
            "shared_memory_vs_plain": round(shm / plain, 2), "grpc_stream_vs_plain": round(stream / plain, 2)}


class SpanCounter:
    """An OTLP/gRPC trace receiver in this process that counts the spans it is sent."""

    def __init__(self):
        from concurrent import futures

        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
        counter = self
        self.count = 0

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                counter.count += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @contextlib.contextmanager
    def exporting(self):
        """OTEL_* variables pointing here while the block runs (processes started in it keep them)."""
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.port}", "OTEL_EXPORTER_OTLP_INSECURE": "true"}
        os.environ.update(env)
        try:
            yield
        finally:
            for key in env:
                del os.environ[key]

    def stop(self) -> None:
        self.server.stop(0)


def median_entry(results: list[dict]) -> dict:
    return sorted(results, key=lambda r: r["output_tokens_per_s"])[len(results) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=192,
                    help="requests at 32 concurrent (8 at 1); several times the concurrency, so the run "
                         "is mostly steady state rather than ramp-up and drain")
    ap.add_argument("--rounds", type=int, default=3, help="rounds alternating the systems; medians are reported")
    ap.add_argument("--prompt-len", default="32:512")
    ap.add_argument("--output-len", default="16:128")
    ap.add_argument("--kv-tokens", type=int, default=4096, help="prompt tokens whose KV the transfer test moves")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", default="1,32", help="which of 1 and 32 to run")
    ap.add_argument("--topologies", default="mesh,mesh_aggregated", help="which mesh shapes to run")
    add_dtype_argument(ap)
    args = ap.parse_args()
    model_dir = Path(args.model) if args.model else ensure_default_model()
    prompt_range = tuple(int(x) for x in args.prompt_len.split(":"))
    output_range = tuple(int(x) for x in args.output_len.split(":"))
    concurrencies = [int(c) for c in args.concurrency.split(",")]

    engine = Engine.from_pretrained(model_dir, dtype=args.dtype, max_num_seqs=64)
    vocab = engine.model_config.vocab_size
    engine.generate([[5] * 8], SamplingParams(max_tokens=2))  # warm-up
    # the full disaggregated mesh, and the same services around one aggregated worker: the
    # second isolates what the services cost from what splitting the cores between two
    # engines costs. Both stay up (idle workers sleep) while the systems take turns.
    shapes = {"mesh": dict(num_prefill=1, num_decode=1),
              "mesh_aggregated": dict(num_prefill=0, num_decode=0, num_both=1),
              "mesh_traced": dict(num_prefill=1, num_decode=1),
              "mesh_tls": dict(num_prefill=1, num_decode=1, tls=True)}
    clusters = {name: Cluster(ClusterSpec(model_dir, **shapes[name], dtype=args.dtype, pin_cores=True), new_log_dir())
                for name in args.topologies.split(",")}
    receiver = SpanCounter() if "mesh_traced" in clusters else None
    results: dict[int, dict[str, list[dict]]] = {c: {name: [] for name in ["engine", *clusters]} for c in concurrencies}
    try:
        for name, cluster in clusters.items():
            if name == "mesh_traced":  # its processes inherit the OTEL_* variables, the others do not
                with receiver.exporting():
                    cluster.start()
            else:
                cluster.start()
        for r in range(args.rounds):
            for conc in concurrencies:  # fresh prompts every round: no prefix hit from an earlier one
                num = 8 if conc == 1 else args.requests
                work = workload(num, prompt_range, output_range, vocab, args.seed + 100 * r + conc)
                results[conc]["engine"].append(run_engine(engine, work, conc))
                for name, cluster in clusters.items():
                    results[conc][name].append(asyncio.run(run_mesh(cluster, work, conc)))
    finally:
        for cluster in clusters.values():
            cluster.stop()
        if receiver is not None:
            receiver.stop()
    del engine
    report = {"benchmark": "mesh_throughput", "model": str(model_dir), "machine": machine(args.dtype),
              "threads_per_process": torch.get_num_threads(),
              "workload": {"prompt_len": prompt_range, "output_len": output_range}, "rounds": args.rounds,
              "concurrency": {}}
    for conc, by_system in results.items():
        entry = report["concurrency"][conc] = {"requests": 8 if conc == 1 else args.requests}
        for name, runs in by_system.items():
            entry[name] = median_entry(runs)  # the round with the median throughput
        for name in clusters:
            ratios = [m["output_tokens_per_s"] / e["output_tokens_per_s"]
                      for m, e in zip(by_system[name], by_system["engine"])]
            entry[f"{name}_vs_engine_throughput"] = round(sorted(ratios)[len(ratios) // 2], 2)
            entry[f"{name}_vs_engine_rounds"] = [round(x, 2) for x in ratios]
    if receiver is not None:
        report["spans_received_from_mesh_traced"] = receiver.count
        for conc, entry in report["concurrency"].items():
            ratios = [t["output_tokens_per_s"] / m["output_tokens_per_s"]
                      for t, m in zip(results[conc]["mesh_traced"], results[conc]["mesh"])]
            entry["mesh_traced_vs_mesh_throughput"] = round(sorted(ratios)[len(ratios) // 2], 3)
    if "mesh_tls" in clusters:  # mutual TLS on every hop (KV pushes go over shared memory, as on one host)
        for conc, entry in report["concurrency"].items():
            ratios = [t["output_tokens_per_s"] / m["output_tokens_per_s"]
                      for t, m in zip(results[conc]["mesh_tls"], results[conc]["mesh"])]
            entry["mesh_tls_vs_mesh_throughput"] = round(sorted(ratios)[len(ratios) // 2], 3)
            entry["mesh_tls_vs_mesh_rounds"] = [round(x, 3) for x in ratios]
    report["kv_transfer"] = kv_transfer_report(model_dir, args.dtype, args.kv_tokens, rounds=5)
    top = report["concurrency"].get(32)
    if top:
        systems = ["engine", *clusters]
        plots.grouped_bars("mesh_throughput", "32 concurrent requests (median round)",
                           ["output tokens/s", "TTFT p50", "inter-token p99"],
                           {s: [top[s]["output_tokens_per_s"], top[s]["ttft_ms"]["p50"], top[s]["itl_ms"]["p99"]]
                            for s in systems}, ["tokens/s", "ms", "ms"])
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
