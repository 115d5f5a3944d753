"""The processes that never run a model (router, scheduler, kv-registry, lease watch, the
gRPC client, ``kervan bench``) and the shared vocabulary they use (``kervan``) import
neither torch nor the engine package: they start fast and stay small, and a change that
makes one of them pull in the engine fails here. The running processes are checked too
(``test_cluster.py``: no torch library mapped into them), and ``kervan`` imports no gRPC either."""

import json
import os
import pkgutil
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import kervan

KERVAN = [f"kervan.{m.name}" for m in pkgutil.iter_modules(kervan.__path__)]
TORCH_FREE = KERVAN + [
    "services.router.__main__", "services.scheduler.__main__", "services.kv_registry.__main__",
    "control_plane.lease_watch.__main__", "control_plane.cli.client", "control_plane.bench.command",
    "control_plane.bench.backends", "control_plane.bench.load", "control_plane.bench.report",
]


def _imported_after(names: list[str], prefixes: tuple[str, ...]) -> list[str]:
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "import json\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {prefixes!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_the_processes_that_run_no_model_import_neither_torch_nor_the_engine():
    assert _imported_after(TORCH_FREE, ("torch", "worker")) == []


def test_the_shared_vocabulary_imports_no_grpc_and_no_service():
    assert "kervan.tokenizer" in KERVAN and "kervan.default_model" in KERVAN
    assert _imported_after(KERVAN, ("torch", "worker", "grpc", "services", "control_plane")) == []


def torch_mapped(pid: int) -> list[str]:
    """The torch libraries mapped into a running process (none: it never imported torch)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return sorted({line.split()[-1] for line in maps.splitlines() if "/torch/lib/" in line})


def test_a_router_on_the_default_model_runs_without_torch(tmp_path):
    """With no ``--model`` the router reads the default model's tokenizer; on a fresh
    machine it has the model written by a child process rather than import the engine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "services.router", "--allow-plaintext", "--port", str(port),
                             "--worker", "127.0.0.1:9"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "KERVAN_CACHE_DIR": str(tmp_path)}, text=True)
    try:
        for line in proc.stdout:
            if "router ready" in line:
                break
        assert proc.poll() is None, "the router exited"
        assert torch_mapped(proc.pid) == []
        assert (tmp_path / "kervan-tiny-llama-v1" / "tokenizer.json").is_file()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


SERVICE_OPTION = re.compile(r"KERVAN_(WORKER|ROUTER|SCHEDULER|KV_REGISTRY|CONTROL_PLANE)_")  # services/common/config.py


def test_every_environment_variable_kervan_reads_is_named_in_envs():
    """``kervan/envs.py`` says it names them all; any ``KERVAN_*`` string in the code that is
    not a service option (``KERVAN_<SERVICE>_<OPTION>``) must be one of its names."""
    from kervan import envs
    named = {v for k, v in vars(envs).items() if k.startswith("KERVAN_")}
    root = Path(__file__).resolve().parent.parent
    found = {}
    for package in ("kervan", "services", "control_plane", "worker"):
        for path in (root / package).rglob("*.py"):
            if "proto" in path.parts:
                continue
            for name in re.findall(r"[\"'](KERVAN_[A-Z0-9_]+)[\"']", path.read_text()):
                if not SERVICE_OPTION.match(name):
                    found.setdefault(name, path.relative_to(root).as_posix())
    assert {n: p for n, p in found.items() if n not in named} == {}
