"""``kervan up``: a whole local cluster as supervised processes.

    redis-server -> kv-registry -> control plane -> scheduler -> workers (prefill, decode, both) -> router

Every service is its own process on 127.0.0.1 with a port chosen here; the
launcher waits until each reports SERVING on the standard health service before
starting the services that depend on it, prints the router's address, and on
Ctrl-C or SIGTERM stops them all (SIGTERM, then SIGKILL after a grace period),
leaving no process behind. Logs go to one file per service."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from control_plane.redis_server import redis_argv, wait_listening
from worker.platform import usable_cores


@dataclass(frozen=True)
class ClusterSpec:
    model_dir: Path
    num_prefill: int = 1
    num_decode: int = 1
    num_both: int = 0
    router_port: int = 0  # 0: a free port
    redis_url: str | None = None  # None: start a private redis-server
    block_size: int = 16
    dtype: str = "auto"
    num_kv_blocks: int | None = None
    threads_per_worker: int | None = None  # None: this host's cores shared evenly among its workers
    pin_cores: bool = False  # pin worker i to its own core(s) (benchmarks: no two engines share a core)
    scheduler_args: tuple[str, ...] = ()  # extra flags for the scheduler, e.g. ("--policy", "round_robin")
    router_args: tuple[str, ...] = ()  # extra flags for the router, e.g. ("--max-migrations", "0")
    registry_args: tuple[str, ...] = ()  # extra flags for the kv-registry, e.g. ("--ttl", "2")
    worker_args: tuple[str, ...] = ()  # extra flags for every worker, e.g. ("--max-waiting", "8")
    http_port: int | None = None  # the router's OpenAI-compatible HTTP API (None: off, 0: a free port)
    metrics: bool = False  # every service serves Prometheus metrics on a free port (addresses["NAME-metrics"])
    # every worker a worker group of these sizes
    tensor_parallel: int = 1
    expert_parallel: int = 1
    pipeline_parallel: int = 1

    def __post_init__(self) -> None:
        sizes = self.parallel_sizes()
        if min(sizes.values()) < 1:
            raise ValueError(f"parallel sizes must be >= 1, got {sizes}")
        if self.group_size == 1:
            return
        from worker.config import ConfigError, ModelConfig, check_parallel
        from worker.platform import current_platform
        platform = current_platform()
        try:  # refused here, before any process starts, naming the numbers
            check_parallel(ModelConfig.from_dir(self.model_dir), self.tensor_parallel, self.expert_parallel,
                           self.pipeline_parallel, platform.num_ranks(platform.resolve_device("auto")))
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    def parallel_sizes(self) -> dict[str, int]:
        return {"tensor": self.tensor_parallel, "expert": self.expert_parallel, "pipeline": self.pipeline_parallel}

    @property
    def group_size(self) -> int:
        """Ranks per aggregated worker."""
        return max(self.tensor_parallel, self.expert_parallel) * self.pipeline_parallel


    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode + self.num_both

    def worker_threads(self) -> int:
        # engines that share cores must not oversubscribe them: OpenMP teams spinning in
        # two processes on the same cores cost far more than they save
        # (per rank: a worker group's ranks share what one worker gets)
        per_worker = self.threads_per_worker or max(1, len(usable_cores()) // max(1, self.num_workers))
        return max(1, per_worker // self.group_size)


@dataclass
class Cluster:
    spec: ClusterSpec
    log_dir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)
    spawned: Counter[str] = field(default_factory=Counter)  # workers started so far, by role

    @property
    def router_address(self) -> str:
        return self.addresses["router"]

    def start(self, timeout: float = 180.0) -> None:
        """Start every service in dependency order; raises if one dies or never serves."""
        try:
            redis_url = self.spec.redis_url or self._start_redis()
            self._start("kv-registry", "services.kv_registry", "--redis", redis_url,
                        "--block-size", str(self.spec.block_size), *self.spec.registry_args)
            self._wait_serving(["kv-registry"], timeout)
            self._spawn("control-plane", [sys.executable, "-m", "control_plane.lease_watch", "--redis", redis_url,
                                          *self._metrics_args("control-plane"),
                                          "--registry", self.addresses["kv-registry"]])
            self._start("scheduler", "services.scheduler", "--registry", self.addresses["kv-registry"],
                        *self.spec.scheduler_args)
            roles = [role for role, n in (("prefill", self.spec.num_prefill), ("decode", self.spec.num_decode),
                                          ("both", self.spec.num_both)) for _ in range(n)]
            if not set(roles) & {"decode", "both"}:
                raise ValueError("a cluster needs at least one decode or aggregated (both) worker")
            workers = [self.spawn_worker(role) for role in roles]
            self._wait_serving(["scheduler", *workers], timeout)
            http = []
            if self.spec.http_port is not None:
                port = self.spec.http_port or free_port()
                self.addresses["router-http"] = f"127.0.0.1:{port}"
                http = ["--http-port", str(port)]
            self._start("router", "services.router", "--scheduler", self.addresses["scheduler"],
                        "--model", str(self.spec.model_dir), "--block-size", str(self.spec.block_size),
                        *http, *self.spec.router_args, port=self.spec.router_port)
            self._wait_serving(["router"], timeout)
        except BaseException:
            self.stop()
            raise

    def spawn_worker(self, role: str, *args: str) -> str:
        """Start one more worker (it joins the mesh once it registers), with ``args`` added
        to its flags; returns its name."""
        name = f"{role}-{self.spawned[role]}"
        threads = self.spec.worker_threads()
        cores = None
        if self.spec.pin_cores:
            slot = sum(self.spawned.values())
            usable = usable_cores()
            cores = {usable[(slot * threads + k) % len(usable)] for k in range(threads)}
        self.spawned[role] += 1
        extra = ["--num-kv-blocks", str(self.spec.num_kv_blocks)] if self.spec.num_kv_blocks else []
        extra += [arg for name, n in self.spec.parallel_sizes().items() if n > 1
                  for arg in (f"--{name}-parallel", str(n))]
        self._start(name, "services.worker", "--role", role, "--model", str(self.spec.model_dir),
                    "--registry", self.addresses["kv-registry"], "--dtype", self.spec.dtype,
                    "--block-size", str(self.spec.block_size), *extra,
                    *self.spec.worker_args, *args,
                    env={"OMP_NUM_THREADS": str(threads)}, cores=cores)
        return name

    def add_worker(self, role: str, *args: str, timeout: float = 180.0) -> str:
        """A worker joining a running cluster: started and waited for."""
        name = self.spawn_worker(role, *args)
        self._wait_serving([name], timeout)
        return name

    def stop_process(self, name: str, grace: float = 10.0) -> int:
        """SIGTERM one service (a worker drains: it leaves the mesh, then finishes its
        requests); SIGKILL after ``grace``. Returns its exit code."""
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def _start_redis(self) -> str:
        port = free_port()
        self._spawn("redis", redis_argv(port, self.log_dir))
        self.addresses["redis"] = f"127.0.0.1:{port}"
        wait_listening(port, self.procs["redis"])
        return f"redis://127.0.0.1:{port}/0"

    def _start(self, name: str, module: str, *args: str, port: int = 0, env: dict[str, str] | None = None,
               cores: set[int] | None = None) -> None:
        port = port or free_port()
        self.addresses[name] = f"127.0.0.1:{port}"
        self._spawn(name, [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port),
                           *self._metrics_args(name), *args], env, cores)

    def _metrics_args(self, name: str) -> list[str]:
        if not self.spec.metrics:
            return []
        port = free_port()
        self.addresses[f"{name}-metrics"] = f"127.0.0.1:{port}"
        return ["--metrics-port", str(port)]

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None,
               cores: set[int] | None = None) -> None:
        log = open(self.log_dir / f"{name}.log", "wb")
        # a new session: Ctrl-C in the terminal reaches the launcher only, which stops children in order
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, env={**os.environ, **(env or {})},
                                            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
        log.close()

    def _wait_serving(self, names: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for name in names:
            with grpc.insecure_channel(self.addresses[name]) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                while True:
                    self._check_alive()
                    try:
                        status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                        if status == health_pb2.HealthCheckResponse.SERVING:
                            break
                    except grpc.RpcError:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{name} did not become SERVING within {timeout:.0f}s "
                                           f"(see {self.log_dir / (name + '.log')})")
                    time.sleep(0.1)

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")

    def stop(self, grace: float = 10.0) -> None:
        """Stop in reverse start order: SIGTERM (drain), then SIGKILL after ``grace``."""
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_log_dir() -> Path:
    from kervan.envs import cache_dir
    base = cache_dir() / "runs"
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=base))


def wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM."""
    received = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, f: received.append(s))
    while not received:
        signal.pause() if hasattr(signal, "pause") else time.sleep(0.5)
