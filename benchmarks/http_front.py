"""The OpenAI HTTP front's own cost: time to first token through ``/v1/completions``
against the router's gRPC ``Generate``, on one cluster, in the same rounds.

One ``kervan up``-style cluster (the launcher; one aggregated worker, the embedded
model by default) serves both. Each round sends the same kind of request (a fresh random
prompt of ``--input-len`` token ids, so no prefix is cached; ``--output-len`` tokens,
greedy, ``ignore_eos``) one at a time, in turn through:

- ``grpc``: the router's ``Generate`` (``kervan bench``'s kervan backend);
- ``http``: a plain HTTP/1.1 keep-alive connection with ``TCP_NODELAY``, timed from the
  request's first byte to the first SSE event that holds a token: the front alone;
- ``openai``: the ``openai`` client (``kervan bench --backend openai``, as users call it):
  the front plus that client's own cost.

Reported per path: the median TTFT of each round, and the overhead against gRPC (median
over rounds of the per-round difference of medians), with its range.

    python -m benchmarks.http_front --json-out benchmarks/results/http_front-amx.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.machine import machine, write_report
from benchmarks.stats import spread
from control_plane.bench.backends import KervanBackend, OpenAIBackend
from control_plane.bench.workload import BenchRequest
from control_plane.cli.launcher import Cluster, ClusterSpec
from services.router.__main__ import model_limits
from worker.default_model import ensure_default_model

PATHS = ("grpc", "http", "openai")


class RawHTTP:
    """One keep-alive HTTP/1.1 connection, ``TCP_NODELAY``, reading SSE by hand."""

    def __init__(self, address: str, model: str):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.model, self.buf = model, b""

    def ttft(self, prompt: list[int], max_tokens: int) -> float:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "ignore_eos": True}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        start = time.perf_counter()
        self.sock.sendall(head + body)
        first = None
        while True:  # chunked transfer: the body ends with a zero-length chunk
            if first is None and b"data: " in self.buf:  # the front sends a chunk per token delta
                first = time.perf_counter() - start
            if self.buf.endswith(b"0\r\n\r\n"):
                break
            data = self.sock.recv(1 << 16)
            if not data:
                raise RuntimeError("the front closed the connection")
            self.buf += data
        if b" 200 " not in self.buf.split(b"\r\n", 1)[0]:
            raise RuntimeError(self.buf[:300].decode(errors="replace"))
        self.buf = b""
        return first

    def close(self) -> None:
        self.sock.close()


async def rounds(cluster: Cluster, model: str, args) -> dict[str, list[float]]:
    rng = random.Random(args.seed)
    medians: dict[str, list[float]] = {p: [] for p in PATHS}
    raw = RawHTTP(cluster.addresses["router-http"], model)
    async with KervanBackend(cluster.router_address) as grpc_client, \
            OpenAIBackend(f"http://{cluster.addresses['router-http']}/v1", model) as openai_client:
        for r in range(args.rounds + 1):  # round 0 warms every path up and is not counted
            ttfts: dict[str, list[float]] = {p: [] for p in PATHS}
            for _ in range(args.requests):
                order = list(PATHS)
                rng.shuffle(order)
                for path in order:
                    prompt = [rng.randrange(3, args.vocab) for _ in range(args.input_len)]
                    if path == "http":
                        ttfts[path].append(await asyncio.to_thread(raw.ttft, prompt, args.output_len))
                        continue
                    client = grpc_client if path == "grpc" else openai_client
                    timed = await client.send(BenchRequest(prompt=prompt, max_tokens=args.output_len))
                    if timed.error:
                        raise RuntimeError(f"{path}: {timed.error}")
                    ttfts[path].append(timed.ttft)
            if r:
                for path in PATHS:
                    medians[path].append(statistics.median(ttfts[path]) * 1e3)
                print(f"round {r}: " + "  ".join(f"{p} {medians[p][-1]:.1f} ms" for p in PATHS), flush=True)
    raw.close()
    return medians


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model directory (default: the embedded model)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=20, help="requests per path per round")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    model_dir = Path(args.model) if args.model else ensure_default_model()
    limits = model_limits(model_dir)
    args.vocab = min(limits.vocab_size, 30000)
    with tempfile.TemporaryDirectory() as logs:
        cluster = Cluster(ClusterSpec(model_dir, num_prefill=0, num_decode=0, num_both=1, http_port=0),
                          Path(logs))
        try:
            cluster.start(timeout=300)
            medians = asyncio.run(rounds(cluster, limits.name, args))
        finally:
            cluster.stop()
    overhead = {p: spread([m - g for m, g in zip(medians[p], medians["grpc"])]) for p in ("http", "openai")}
    report = {"benchmark": "http_front", "model": args.model or "embedded", "machine": machine("auto"),
              "arguments": vars(args), "ttft_ms": {p: spread(medians[p]) for p in PATHS},
              "overhead_vs_grpc_ms": overhead}
    write_report(report, args.json_out)


if __name__ == "__main__":
    main()
