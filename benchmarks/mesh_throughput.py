"""The mesh against the in-process engine, and KV transfer against a plain copy.

1. The same workload (prompts and output lengths drawn from ranges, greedy,
   ``ignore_eos``) at 1 and at 32 concurrent requests, through
   - the engine in this process on every core (requests added as others finish),
   - ``engines_pinned``: one engine process per core, pinned, one thread each, the
     requests dealt out between them in turn and the concurrency split (what a user
     would run on one host instead of a mesh: data parallelism with no services),
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
   touched beforehand (``warm``). The four alternate round by round.

The mesh's workers are pinned one per core (``ClusterSpec(pin_cores=True)``), as the
``engines_pinned`` baseline's engines are; the ``engine`` baseline runs on both cores.

Every round of every system is kept in the report (``*_rounds``); ratios are the
median of the per-round ratios with their range.

    python -m benchmarks.mesh_throughput --json-out benchmarks/results/mesh_throughput-amx.json   # ~10 min
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
from typing import NamedTuple

import grpc
import torch

from benchmarks.load import pct_ms, run_closed_loop
from benchmarks.machine import add_dtype_argument, machine, write_report
from benchmarks.stats import spread
from control_plane.cli.launcher import Cluster, ClusterSpec, free_port, new_log_dir
from kervan.engine_args import EngineArgs
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


class EngineLoop(NamedTuple):
    """One engine's closed loop: wall-clock start and end (``time.time()``, comparable
    across processes), output tokens, and every TTFT and inter-token gap in seconds."""
    start: float
    end: float
    tokens: int
    ttfts: list[float]
    itls: list[float]


def engine_loop(engine: Engine, work, concurrency: int) -> EngineLoop:
    """``work`` through ``engine``, ``concurrency`` requests at a time, timed as a client of a
    stream would time it: one inter-token gap per step that returned tokens (vLLM's ITL)."""
    pending = list(work)
    started, last, ttfts, itls = {}, {}, [], []
    tokens = 0
    t0 = time.time()
    while pending or engine.has_unfinished_requests():
        while pending and unfinished(engine) < concurrency:
            prompt, n = pending.pop(0)
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
                itls.append(now - last[out.request_id])
            last[out.request_id] = now
    return EngineLoop(t0, time.time(), tokens, ttfts, itls)


def run_engine(engine: Engine, work, concurrency: int) -> dict:
    loop = engine_loop(engine, work, concurrency)
    return summary(loop.end - loop.start, loop.tokens, loop.ttfts, loop.itls)


class PinnedEngines:
    """Data parallelism without the mesh: one engine process per core (pinned, one thread),
    the requests dealt out in turn and the concurrency split between them; the baseline a
    user would start instead of a cluster on one host. The processes stay up between loads."""

    def __init__(self, model_dir: Path, dtype: str):
        cores = sorted(os.sched_getaffinity(0))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.mesh_throughput", "--engine-child",
                                        str(core), "--model", str(model_dir), "--dtype", dtype],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                      for core in cores]
        for proc in self.procs:
            assert proc.stdout.readline().strip() == "ready"

    def run(self, work, concurrency: int) -> dict:
        used = self.procs[:min(len(self.procs), concurrency)]
        for i, proc in enumerate(used):
            job = {"work": work[i::len(used)], "concurrency": concurrency // len(used)}
            proc.stdin.write(json.dumps(job) + "\n")
            proc.stdin.flush()
        loops = [EngineLoop(*json.loads(proc.stdout.readline())) for proc in used]
        return summary(max(x.end for x in loops) - min(x.start for x in loops), sum(x.tokens for x in loops),
                       [t for x in loops for t in x.ttfts], [t for x in loops for t in x.itls])

    def stop(self) -> None:
        for proc in self.procs:
            proc.stdin.close()
            proc.wait(timeout=30)


def engine_child(core: int, model_dir: str, dtype: str) -> None:
    """A PinnedEngines process: pinned to ``core``, one thread; a closed loop per job line."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    engine = Engine.from_pretrained(model_dir, dtype=dtype, max_num_seqs=64)
    engine.generate([[5] * 8], SamplingParams(max_tokens=2))  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        work = [(prompt, n) for prompt, n in job["work"]]
        print(json.dumps(engine_loop(engine, work, job["concurrency"])), flush=True)


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
    rates: dict[str, list[float]] = {"shared_memory_push": [], "grpc_stream_push": [], "plain_shm_copy": [],
                                     "warm_shm_copy": []}
    try:
        proc.stdout.readline()  # "worker ready on ..."
        address = f"127.0.0.1:{port}"
        for _ in range(rounds):  # the four alternate, so a round's ratios share the machine's moment
            rates["shared_memory_push"].append(asyncio.run(push_bytes_per_s(address, data, True, 1)))
            rates["grpc_stream_push"].append(asyncio.run(push_bytes_per_s(address, data, False, 1)))
            rates["plain_shm_copy"].append(plain_copy_bytes_per_s(data, 1))
            rates["warm_shm_copy"].append(warm_copy_bytes_per_s(data, 1))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    out: dict = {"kv_bytes": data.numel() * data.element_size(), "prompt_tokens": num_tokens, "rounds": rounds}
    for name, values in rates.items():
        out[f"{name}_gb_per_s"] = spread([v / 1e9 for v in values])
    for name in ("shared_memory_push", "grpc_stream_push"):
        for base in ("plain_shm_copy", "warm_shm_copy"):
            out[f"{name}_vs_{base}"] = spread([a / b for a, b in zip(rates[name], rates[base])])
    return out


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
    ap.add_argument("--kv-rounds", type=int, default=7, help="rounds of the four KV transfers, alternating")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", default="1,32", help="which of 1 and 32 to run")
    ap.add_argument("--topologies", default="mesh,mesh_aggregated", help="which mesh shapes to run")
    ap.add_argument("--skip-pinned", action="store_true",
                    help="leave out the engines_pinned baseline (one engine process per core, pinned)")
    ap.add_argument("--json-out", default=None, help="also write the report here (with the commit)")
    ap.add_argument("--engine-child", type=int, default=None, help=argparse.SUPPRESS)
    add_dtype_argument(ap)
    args = ap.parse_args()
    if args.engine_child is not None:
        engine_child(args.engine_child, args.model, args.dtype)
        return
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
    clusters = {name: Cluster(ClusterSpec(model_dir, **shapes[name], engine=EngineArgs(dtype=args.dtype),
                                          pin_cores=True), new_log_dir())
                for name in args.topologies.split(",")}
    receiver = SpanCounter() if "mesh_traced" in clusters else None
    pinned = None if args.skip_pinned else PinnedEngines(model_dir, args.dtype)
    systems = ["engine", *(["engines_pinned"] if pinned else []), *clusters]
    results: dict[int, dict[str, list[dict]]] = {c: {name: [] for name in systems} for c in concurrencies}
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
                if pinned:
                    results[conc]["engines_pinned"].append(pinned.run(work, conc))
                for name, cluster in clusters.items():
                    results[conc][name].append(asyncio.run(run_mesh(cluster, work, conc)))
    finally:
        if pinned:
            pinned.stop()
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
            entry[f"{name}_rounds"] = runs
        for name in systems[1:]:
            for base in ("engine", "engines_pinned"):
                if base in by_system and base != name:
                    ratios = [m["output_tokens_per_s"] / e["output_tokens_per_s"]
                              for m, e in zip(by_system[name], by_system[base])]
                    entry[f"{name}_vs_{base}_throughput"] = spread(ratios)
    for name in ("mesh_traced", "mesh_tls"):  # what tracing, and mutual TLS on every hop, cost the mesh
        if name in clusters:
            for conc, entry in report["concurrency"].items():
                entry[f"{name}_vs_mesh_throughput"] = spread(
                    [t["output_tokens_per_s"] / m["output_tokens_per_s"]
                     for t, m in zip(results[conc][name], results[conc]["mesh"])])
    if receiver is not None:
        report["spans_received_from_mesh_traced"] = receiver.count
    report["kv_transfer"] = kv_transfer_report(model_dir, args.dtype, args.kv_tokens, rounds=args.kv_rounds)
    write_report(report, args.json_out, args)


if __name__ == "__main__":
    main()
