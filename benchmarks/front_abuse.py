"""What one abusive HTTP client does to a router: the before and after of issue 51's
findings 1 (one body of many prompts) and 6 (slowloris), on a ``kervan up``-style cluster
(one aggregated worker, the embedded model, HTTP on, no keys: no key is needed for either).

- ``many_prompts``: one ``/v1/completions`` body of ``--prompts`` one-token prompts; the
  answer's status and time, the router's RSS before and at its peak, and the longest a gRPC
  health check of the router took meanwhile (checked every 50 ms);
- ``slowloris``: ``--connections`` connections from 127.0.0.2 that send half a request's
  headers and nothing more; the router's open fds at their peak, ``/health`` from 127.0.0.1
  meanwhile (status, longest latency), and how many of them the router still holds open
  after ``--hold-s`` seconds.

    python -m benchmarks.front_abuse --json-out benchmarks/results/front_abuse-amx-after.json

It runs on any checkout that has the launcher (the same script measured the commit before the
fixes, for the "before" report)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.machine import machine, write_report
from control_plane.cli.launcher import Cluster, ClusterSpec
from worker.default_model import ensure_default_model


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Watch:
    """A thread that samples ``probe`` every ``every_s`` until stopped: the longest it took,
    the failures, and the peak of ``gauge``."""

    def __init__(self, probe, gauge, every_s: float = 0.05):
        self.probe, self.gauge, self.every_s = probe, gauge, every_s
        self.longest_s, self.failures, self.peak = 0.0, 0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.gauge())
            start = time.monotonic()
            try:
                self.probe()
            except Exception:  # noqa: BLE001 (a failed probe is what is counted)
                self.failures += 1
            self.longest_s = max(self.longest_s, time.monotonic() - start)
            self._stop.wait(self.every_s)


def grpc_health(address: str):
    channel = grpc.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)
    return lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=60)


def http_health(port: int):
    def probe() -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=60) as resp:
            assert resp.status == 200
    return probe


def many_prompts(cluster: Cluster, http_port: int, prompts: int) -> dict:
    pid = cluster.procs["router"].pid
    body = json.dumps({"model": cluster.spec.model_dir.name, "prompt": [[5]] * prompts, "max_tokens": 1}).encode()
    before = rss_mb(pid)
    with Watch(grpc_health(cluster.router_address), lambda: rss_mb(pid)) as watch:
        start = time.monotonic()
        req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                status, text = resp.status, resp.read()[:300].decode(errors="replace")
        except urllib.error.HTTPError as err:
            status, text = err.code, err.read()[:300].decode(errors="replace")
        elapsed = time.monotonic() - start
        time.sleep(0.5)
    return {"prompts": prompts, "body_bytes": len(body), "status": status, "answer": text,
            "seconds": round(elapsed, 3), "router_rss_mb_before": round(before, 1),
            "router_rss_mb_peak": round(watch.peak, 1), "router_rss_mb_after": round(rss_mb(pid), 1),
            "grpc_health_longest_s": round(watch.longest_s, 3), "grpc_health_failures": watch.failures}


def slowloris(cluster: Cluster, http_port: int, connections: int, hold_s: float) -> dict:
    pid = cluster.procs["router"].pid
    fds_before = num_fds(pid)
    socks: list[socket.socket] = []
    refused = 0
    with Watch(http_health(http_port), lambda: num_fds(pid)) as watch:
        for _ in range(connections):
            try:
                s = socket.create_connection(("127.0.0.1", http_port), timeout=5, source_address=("127.0.0.2", 0))
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                socks.append(s)
            except OSError:
                refused += 1
        time.sleep(hold_s)
        peak_fds = watch.peak
    still_open = 0
    for s in socks:
        s.setblocking(False)
        try:
            still_open += bool(s.recv(1))  # b"": the router closed it
        except BlockingIOError:
            still_open += 1  # nothing to read and not closed: the router still holds it
        except OSError:
            pass
        s.close()
    return {"connections": connections, "refused_at_connect": refused, "hold_s": hold_s,
            "router_fds_before": fds_before, "router_fds_peak": int(peak_fds),
            "still_open_after_hold": still_open, "http_health_longest_s": round(watch.longest_s, 3),
            "http_health_failures": watch.failures}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=20_000)
    ap.add_argument("--connections", type=int, default=1100)
    ap.add_argument("--hold-s", type=float, default=15.0)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # this client holds --connections sockets
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, args.connections + 256)), hard))
    with tempfile.TemporaryDirectory() as logs:
        cluster = Cluster(ClusterSpec(ensure_default_model(), num_prefill=0, num_decode=0, num_both=1, http_port=0),
                          Path(logs))
        cluster.start(timeout=300)
        try:
            http_port = int(cluster.addresses["router-http"].rsplit(":", 1)[1])
            report = {"benchmark": "front_abuse", "machine": machine(),
                      "many_prompts": many_prompts(cluster, http_port, args.prompts),
                      "slowloris": slowloris(cluster, http_port, args.connections, args.hold_s)}
        finally:
            cluster.stop()
    write_report(report, args.json_out, args)


if __name__ == "__main__":
    main()
