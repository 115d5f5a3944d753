"""``kervan up``: a whole local cluster as supervised processes.

    redis-server -> kv-registry -> control plane -> scheduler -> workers (prefill, decode, both) -> router

Every service is its own process on 127.0.0.1 with a port chosen here (or, with ``hosts``,
on simulated hosts of this machine: ``control_plane/hosts/``, ``service_hosts.py``); the
launcher waits until each reports SERVING on the standard health service before
starting the services that depend on it, prints the router's address, and on
Ctrl-C, SIGTERM or SIGHUP stops them all (SIGTERM, then SIGKILL after a grace
period), leaving no process behind. Until then it restarts a service that dies,
on the same port, after a back-off that doubles with each crash (1 s to 30 s).
Children die with the launcher, even one SIGKILLed, so no orphan keeps a port: the
services watch a pipe the launcher holds (``services/common/lifeline.py``), and
redis-server gets ``PR_SET_PDEATHSIG`` when the launcher runs no other thread.

The private Redis gets a random password; it and the Redis URL reach the
services that need them in their environment, never on a command line (which
any local user can read). With ``tls``, a throw-away CA in the run's directory
issues each role its certificate, and every channel is mutual TLS."""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from control_plane.cli.death_signal import death_signal
from control_plane.cli.redis_server import redis_argv, wait_listening
from control_plane.cli.service_hosts import LoopbackHosts, ServiceHosts, SimulatedHosts
from control_plane.hosts.link import Link
from kervan.engine_args import EngineArgs, to_flags
from kervan.envs import KERVAN_LISTEN_REUSEPORT
from kervan.worker_info import WorkerRole
from services.common.lifeline import ENV as ENV_LIFELINE
from services.common.security import MESH_SECRET_ENV, PLAINTEXT, MeshSecurity
from worker.platform import usable_cores

if TYPE_CHECKING:
    from control_plane.cli.certificates import CertificateAuthority

RESTART_BACKOFF_S = (1.0, 30.0)  # first and longest wait before restarting a crashed service


@dataclass(frozen=True)
class ClusterSpec:
    model_dir: Path
    num_prefill: int = 1
    num_decode: int = 1
    num_both: int = 0
    router_port: int = 0  # 0: a free port
    redis_url: str | None = None  # None: start a private redis-server
    # every worker's engine options (``kervan/engine_args.py``): its flags are the fields not at their
    # defaults; a disk tier's directory gets a subdirectory per worker, and a prefill worker never speculates
    engine: EngineArgs = field(default_factory=EngineArgs)
    threads_per_worker: int | None = None  # None: this host's cores shared evenly among its workers
    pin_cores: bool = False  # pin worker i to its own core(s) (benchmarks: no two engines share a core)
    scheduler_args: tuple[str, ...] = ()  # extra flags for the scheduler, e.g. ("--policy", "round_robin")
    router_args: tuple[str, ...] = ()  # extra flags for the router, e.g. ("--max-migrations", "0")
    registry_args: tuple[str, ...] = ()  # extra flags for the kv-registry, e.g. ("--ttl", "2")
    worker_args: tuple[str, ...] = ()  # extra flags for every worker, e.g. ("--max-waiting", "8")
    http_port: int | None = None  # the router's OpenAI-compatible HTTP API (None: off, 0: a free port)
    metrics: bool = False  # every service serves Prometheus metrics on a free port (addresses["NAME-metrics"])
    tls: bool = False  # mutual TLS between all services (a throw-away CA in the run's directory)
    # with tls: the registry refuses worker certificates that name no address (every worker's names its
    # own); False runs it as a deploy whose workers share one certificate (the k8s manifests)
    require_worker_addresses: bool = True
    api_key_file: Path | None = None  # the router requires one of these keys
    num_routers: int = 1  # replicas: "router", "router-1", ... (clients list them all: replicas.py)
    num_schedulers: int = 1  # replicas: "scheduler", "scheduler-1", ... (every router lists them all)
    redis_persistent: bool = False  # the private Redis keeps an append-only file (survives its restart)
    # > 0: the cluster laid over that many simulated hosts (network namespaces), each linked to the others
    # by ``link``: the control services on the first, the workers spread over the rest
    hosts: int = 0
    link: Link = field(default_factory=Link)

    def __post_init__(self) -> None:
        if self.hosts and not self.tls:  # every service refuses to listen beyond loopback in plaintext
            raise ValueError("services on simulated hosts talk over a network: start them with tls, as production")
        if self.engine.world_size == 1:
            return
        from worker.config import ConfigError, ModelConfig, check_parallel
        from worker.platform import current_platform
        platform = current_platform()
        try:  # refused here, before any process starts, naming the numbers
            check_parallel(ModelConfig.from_dir(self.model_dir), self.engine.tensor_parallel_size,
                           self.engine.expert_parallel_size, self.engine.pipeline_parallel_size,
                           platform.num_ranks(platform.resolve_device("auto")))
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    def worker_engine(self, name: str, role: WorkerRole) -> EngineArgs:
        """The engine options of worker ``name``."""
        engine = self.engine.without_speculation() if role is WorkerRole.PREFILL else self.engine
        if engine.kv_disk_dir:  # each worker its own file, found again by name after a restart
            engine = dataclasses.replace(engine, kv_disk_dir=str(Path(engine.kv_disk_dir) / name))
        return engine

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode + self.num_both

    def worker_threads(self) -> int:
        # engines that share cores must not oversubscribe them: OpenMP teams spinning in
        # two processes on the same cores cost far more than they save
        # (per rank: a worker group's ranks share what one worker gets)
        per_worker = self.threads_per_worker or max(1, len(usable_cores()) // max(1, self.num_workers))
        return max(1, per_worker // self.engine.world_size)


@dataclass
class Cluster:
    spec: ClusterSpec
    log_dir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)
    spawned: Counter[WorkerRole] = field(default_factory=Counter)  # workers started so far, by role
    client_security: MeshSecurity = PLAINTEXT  # the launcher's own (an admin certificate with TLS)
    mesh_secret: str | None = None  # without TLS but with API keys: what internal services require
    redis_url: str | None = None  # the URL the services use (with the private Redis's password)
    redis_password: str | None = None
    authority: CertificateAuthority | None = None  # with tls: the run's CA (it can issue more certificates)
    restarts: Counter[str] = field(default_factory=Counter)  # crashed services restarted, by name
    pids: list[int] = field(default_factory=list)  # every process started, dead ones included
    # how each service was started (argv, env, cores): what a restart repeats
    _launch: dict[str, tuple[list[str], dict[str, str], set[int] | None]] = field(default_factory=dict)
    _tls_flags: dict[str, list[str]] = field(default_factory=dict)  # role -> its --tls-* flags
    _restart_due: dict[str, float] = field(default_factory=dict)
    _lifeline: tuple[int, int] | None = None  # the pipe whose closing tells children the launcher is gone
    # workers told to drain and not yet gone: name -> (process, when it is killed if still there)
    draining: dict[str, tuple[subprocess.Popen, float]] = field(default_factory=dict)
    # where each service runs; on loopback every service's port is held for the cluster's life: no other
    # user takes one while its service restarts
    service_hosts: ServiceHosts = field(default_factory=LoopbackHosts)
    serving: set[str] = field(default_factory=set)  # services that answered their health check
    # told, while the start waits, which services serve and which are still starting (kervan up's line)
    on_progress: Callable[[list[str], list[str]], None] | None = None

    @property
    def router_address(self) -> str:
        return self.addresses["router"]

    @property
    def router_addresses(self) -> str:
        """Every router, comma-separated: what a client given all of them connects to."""
        return ",".join(self.addresses[n] for n in _replica_names("router", self.spec.num_routers))

    @property
    def tls_dir(self) -> Path:
        return self.log_dir / "tls"

    @property
    def api_key(self) -> str | None:
        """The first key of the spec's key file (what ``--request`` sends)."""
        if self.spec.api_key_file is None:
            return None
        from services.common.auth import ApiKeys
        return ApiKeys.from_file(self.spec.api_key_file).keys[0].secret.decode()

    def _make_certificates(self) -> None:
        from control_plane.cli.certificates import CertificateAuthority
        from services.common.security import ROLES
        ca = self.authority = CertificateAuthority(self.tls_dir)
        for role in ROLES:
            if role != "worker":  # each worker gets its own, naming its address (spawn_worker): no unbound one
                self._tls_flags[role] = ca.issue(role).flags()
        # what the router's public port serves (clients check it for 127.0.0.1, or the router's host)
        public = ca.issue_public(hosts=[self.service_hosts.address("router")])
        self._tls_flags["router"] += ["--public-tls-cert", str(public.cert), "--public-tls-key", str(public.key)]
        admin = ca.issue("admin")
        self.client_security = MeshSecurity.from_files(str(admin.cert), str(admin.key), str(admin.ca))

    def registry_flags(self) -> list[str]:
        bound = ["--require-worker-addresses"] if self.spec.tls and self.spec.require_worker_addresses else []
        return ["--block-size", str(self.spec.engine.block_size), *bound, *self.spec.registry_args]

    def start(self, timeout: float = 180.0) -> None:
        """Start every service in dependency order; raises if one dies or never serves."""
        try:
            if self.spec.hosts:
                from control_plane.hosts.network import HostNetwork
                self.service_hosts = SimulatedHosts(HostNetwork.create(self.spec.hosts, self.spec.link))
            if self.spec.tls:
                self._make_certificates()
            elif self.spec.api_key_file is not None:  # keys guard the router; the secret, every other service
                self.mesh_secret = secrets.token_hex(32)
                self.client_security = dataclasses.replace(self.client_security, mesh_secret=self.mesh_secret.encode())
            redis_url = self.redis_url = self.spec.redis_url or self._start_redis()
            self._start("kv-registry", "services.kv_registry", *self.registry_flags(),
                        env={"KERVAN_KV_REGISTRY_REDIS": redis_url})
            self._wait_serving(["kv-registry"], timeout)
            self._spawn("control-plane", [sys.executable, "-m", "control_plane.lease_watch",
                                          *self._metrics_args("control-plane"),
                                          *self._tls_flags.get("control-plane", []),
                                          "--registry", self.addresses["kv-registry"]],
                        env={"KERVAN_CONTROL_PLANE_REDIS": redis_url})
            schedulers = _replica_names("scheduler", self.spec.num_schedulers)
            for name in schedulers:
                self._start(name, "services.scheduler", "--registry", self.addresses["kv-registry"],
                            *self._link_flags(), *self.spec.scheduler_args)
            roles = [role for role, n in ((WorkerRole.PREFILL, self.spec.num_prefill),
                                          (WorkerRole.DECODE, self.spec.num_decode),
                                          (WorkerRole.BOTH, self.spec.num_both)) for _ in range(n)]
            if not set(roles) & {WorkerRole.DECODE, WorkerRole.BOTH}:
                raise ValueError("a cluster needs at least one decode or aggregated (both) worker")
            workers = [self.spawn_worker(role) for role in roles]
            self._wait_serving([*schedulers, *workers], timeout)
            keys = ["--api-key-file", str(self.spec.api_key_file)] if self.spec.api_key_file is not None else []
            routers = _replica_names("router", self.spec.num_routers)
            for name in routers:
                http = []
                if self.spec.http_port is not None:  # every router serves HTTP: the first on the port asked for
                    port = self.service_hosts.port(f"{name}-http", self.spec.http_port if name == "router" else 0)
                    self.addresses[f"{name}-http"] = f"{self.service_hosts.address(name)}:{port}"
                    http = ["--http-port", str(port)]
                self._start(name, "services.router", "--scheduler", ",".join(self.addresses[s] for s in schedulers),
                            "--registry", self.addresses["kv-registry"], "--model", str(self.spec.model_dir),
                            *http, *keys, *self.spec.router_args,
                            port=self.spec.router_port if name == "router" else 0)
            self._wait_serving(routers, timeout)
        except BaseException:
            self.stop()
            raise

    def spawn_worker(self, role: WorkerRole | str, *args: str) -> str:
        """Start one more worker (it joins the mesh once it registers), with ``args`` added
        to its flags; returns its name."""
        role = WorkerRole(role)  # a name ("decode") is taken too, and a wrong one refused here
        name = f"{role}-{self.spawned[role]}"
        threads = self.spec.worker_threads()
        cores = None
        if self.spec.pin_cores:
            slot = sum(self.spawned.values())
            usable = usable_cores()
            cores = {usable[(slot * threads + k) % len(usable)] for k in range(threads)}
        self.spawned[role] += 1
        port = self.service_hosts.port(name)
        tls = None
        if self.authority is not None:  # its own certificate, naming the one address it may register
            address = f"{self.service_hosts.address(name)}:{port}"
            tls = self.authority.issue("worker", name=name, addresses=[address]).flags()
        self._start(name, "services.worker", "--role", str(role), "--model", str(self.spec.model_dir),
                    "--registry", self.addresses["kv-registry"], *to_flags(self.spec.worker_engine(name, role)),
                    *self.spec.worker_args, *args, port=port, tls_flags=tls,
                    env={"OMP_NUM_THREADS": str(threads),
                         **self.service_hosts.group_env(name, self.spec.engine.world_size)}, cores=cores)
        return name

    def add_worker(self, role: WorkerRole | str, *args: str, timeout: float = 180.0) -> str:
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

    def drain_worker(self, name: str, grace: float = 30.0) -> None:
        """SIGTERM a worker without waiting: it leaves the mesh and finishes what it runs;
        ``reap_drained`` kills it if it is still there after ``grace``. It is never restarted."""
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGTERM)
        self.draining[name] = (proc, time.monotonic() + grace)

    def reap_drained(self, now: float | None = None) -> list[str]:
        """Forget the drained workers that exited, kill those past their grace; returns the
        names gone, with their exit codes in the log."""
        now = time.monotonic() if now is None else now
        gone = []
        for name, (proc, deadline) in list(self.draining.items()):
            if proc.poll() is None and now < deadline:
                continue
            if proc.poll() is None:
                proc.kill()
            code = proc.wait()
            with open(self.log_dir / f"{name}.log", "ab") as log:
                log.write(f"--- drained, exited with {code} ---\n".encode())
            del self.draining[name]
            gone.append(name)
        return gone

    def _link_flags(self) -> list[str]:
        """The simulated hosts' link rate: what the scheduler prices a KV fetch with until the
        workers have measured their links."""
        rate = self.spec.link.bytes_per_s if self.spec.hosts > 1 else None
        return [] if rate is None else ["--link-bytes-per-s", f"{rate:g}"]

    def _start_redis(self) -> str:
        port = self.service_hosts.unreserved_port("redis")
        host = self.service_hosts.address("redis")
        password = self.redis_password = secrets.token_hex(16)
        self._spawn("redis", redis_argv(port, self.log_dir, password, self.spec.redis_persistent, bind=host))
        self.addresses["redis"] = f"{host}:{port}"
        wait_listening(port, self.procs["redis"], host=host)
        return f"redis://:{password}@{host}:{port}/0"

    def _start(self, name: str, module: str, *args: str, port: int = 0, env: dict[str, str] | None = None,
               cores: set[int] | None = None, tls_flags: list[str] | None = None) -> None:
        port = self.service_hosts.port(name, port)
        host = self.service_hosts.address(name)
        self.addresses[name] = f"{host}:{port}"
        role = module.removeprefix("services.").replace("_", "-")  # the mesh role its certificate names
        tls = tls_flags if tls_flags is not None else self._tls_flags.get(role, [])
        self._spawn(name, [sys.executable, "-m", module, "--host", host, "--port", str(port),
                           *self._metrics_args(name), *tls, *args], env, cores)

    def _metrics_args(self, name: str) -> list[str]:
        if not self.spec.metrics:
            return []
        port = self.service_hosts.unreserved_port(f"{name}-metrics")
        self.addresses[f"{name}-metrics"] = f"{self.service_hosts.address(name)}:{port}"
        return ["--metrics-port", str(port)]

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None,
               cores: set[int] | None = None) -> None:
        if self._lifeline is None:
            self._lifeline = os.pipe()  # the write end stays here, never written, never inherited
        if self.mesh_secret is not None and name != "redis":  # in the environment: never on a command line
            env = {**(env or {}), MESH_SECRET_ENV: self.mesh_secret}
        if name != "redis":  # it binds beside its port's reservation (port_reservations.py)
            env = {**(env or {}), KERVAN_LISTEN_REUSEPORT: "1"}
        self._launch[name] = (argv, {**(env or {})}, cores)
        log = open(self.log_dir / f"{name}.log", "ab")
        # Python code between fork and exec (preexec_fn) can crash a process that runs other
        # threads (gRPC's, a thread pool's): only redis-server, which cannot watch the lifeline,
        # gets one, and only from a launcher with no other thread (`kervan up`)
        setup = death_signal(os.getpid()) if name == "redis" and threading.active_count() == 1 else None
        # a new session: Ctrl-C in the terminal reaches the launcher only, which stops children in order
        self.procs[name] = subprocess.Popen(  # inside its host, when the cluster spans simulated hosts
            self.service_hosts.argv(name, argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {}), ENV_LIFELINE: str(self._lifeline[0])}, pass_fds=(self._lifeline[0],),
            preexec_fn=setup)
        if cores:  # before the child starts its OpenMP threads, which inherit the mask
            os.sched_setaffinity(self.procs[name].pid, cores)
        self.pids.append(self.procs[name].pid)
        log.close()

    def restart_crashed(self, now: float | None = None) -> list[str]:
        """Restarts each service that exited since it was started, once its back-off has
        passed (doubling with each crash of that service); returns the names restarted."""
        now = time.monotonic() if now is None else now
        restarted = []
        for name, proc in list(self.procs.items()):
            if proc.poll() is None:
                continue
            due = self._restart_due.setdefault(name, now + min(RESTART_BACKOFF_S[0] * 2 ** self.restarts[name],
                                                               RESTART_BACKOFF_S[1]))
            if now < due:
                continue
            del self._restart_due[name]
            self.restarts[name] += 1
            with open(self.log_dir / f"{name}.log", "ab") as log:
                log.write(f"--- exited with {proc.returncode}; restart {self.restarts[name]} ---\n".encode())
            self._spawn(name, *self._launch[name])
            restarted.append(name)
        return restarted

    def supervise_until_signal(self, poll_s: float = 0.5, ready: Callable[[], None] | None = None,
                               tick: Callable[[float], object] | None = None) -> None:
        """Restart crashed services until SIGINT, SIGTERM or SIGHUP. ``ready`` runs once the
        signals are caught (what tells the user they may stop it: a signal sent on seeing it
        must not find the default action, which kills this process and leaves no stop).
        ``tick(now)`` runs every poll (the planner: it acts when its interval is due)."""
        received: list[int] = []
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda s, f: received.append(s))
        if ready is not None:
            ready()
        while not received:
            for name in self.restart_crashed():
                print(f"kervan: {name} exited; restarted it (restart {self.restarts[name]})", file=sys.stderr,
                      flush=True)
            self.reap_drained()
            if tick is not None:
                tick(time.monotonic())
            time.sleep(poll_s)

    def _wait_serving(self, names: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for name in names:
            with self.client_security.sync_channel(self.addresses[name], role=served_role(name)) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                while True:
                    self._check_alive()
                    if self.on_progress is not None:
                        self.on_progress(sorted(self.serving), [n for n in names if n not in self.serving])
                    try:
                        status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                        if status == health_pb2.HealthCheckResponse.SERVING:
                            self.serving.add(name)
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
        """Stop in reverse start order (the router before the workers it calls, Redis
        last): SIGTERM (drain), then SIGKILL for a service still there after ``grace``.
        The whole stop is bounded too, by twice ``grace``: a service that waits out its
        grace eats into the next ones' (each keeps at least 1 s)."""
        deadline = time.monotonic() + 2 * grace
        procs = {**self.procs, **{name: proc for name, (proc, _) in self.draining.items()}}  # draining first
        self.draining.clear()
        for name in reversed(list(procs)):
            proc = procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            wait_s = max(1.0, min(grace, deadline - time.monotonic()))
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                print(f"{name} did not stop within {wait_s:.0f}s of SIGTERM: killed (its log: "
                      f"{self.log_dir / name}.log)", file=sys.stderr, flush=True)
                proc.kill()
                proc.wait()
        self.procs.clear()
        self.service_hosts.close()
        if self._lifeline is not None:
            for fd in self._lifeline:
                os.close(fd)
            self._lifeline = None


def served_role(name: str) -> str | None:
    """The mesh role a service of the cluster serves as (None: the router's public port)."""
    kind = name.rsplit("-", 1)[0] if name[-1].isdigit() else name
    return {"router": None, "prefill": "worker", "decode": "worker", "both": "worker"}.get(kind, kind)


def _replica_names(service: str, num: int) -> list[str]:
    return [service if k == 0 else f"{service}-{k}" for k in range(num)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_log_dir() -> Path:
    from kervan.envs import cache_dir
    base = cache_dir() / "runs"
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=base))

