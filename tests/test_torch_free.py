"""The processes that never run a model (router, scheduler, kv-registry, lease watch, the
gRPC client) and the shared vocabulary they use (``kervan``) import neither torch nor
the engine package: they start fast and stay small, and a change that makes one of
them pull in the engine fails here."""

import subprocess
import sys

TORCH_FREE = [
    "kervan.block_hash", "kervan.kv_events", "kervan.sampling", "kervan.envs", "kervan.tokenizer",
    "services.router.__main__", "services.scheduler.__main__", "services.kv_registry.__main__",
    "control_plane.lease_watch", "control_plane.client", "kervan.bench.command", "kervan.bench.backends",
    "kervan.bench.load", "kervan.bench.report",
]


def test_the_processes_that_run_no_model_import_neither_torch_nor_the_engine():
    code = ("import importlib, sys\n"
            f"for name in {TORCH_FREE!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.split('.')[0] == 'worker'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
