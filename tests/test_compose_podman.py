"""The compose cluster run for real, under podman, on a machine that reaches no image registry:
Kervan's image built from a debootstrap base (``deploy/offline-image.sh``), ``compose.yaml`` with
``compose.offline.yaml`` brought up by Compose v2 against podman's Docker-compatible socket,
health-gated as written, a request answered through the router, then the decode service scaled
to two, both replicas listed live by the mesh (each advertising its own address) and answering.

Where this cannot run it skips, saying why: not root, no podman, no Compose v2, or the image not
built from this checkout's sources (``deploy/offline-image.sh`` takes minutes, so the test uses
the image, never builds it, and compares the Python sources inside it with the checkout's).
Two things of this machine are worked around, not hidden: podman runs health checks from
systemd timers, and there is no systemd here, so the test runs each container's health check
itself every two seconds, as the timer would; and the kernel refuses podman's default rlimits and
crun's cgroup handling, so the test's ``containers.conf`` names runc and lower limits."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import subprocess
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from control_plane.cli.client import Completion, accumulate, build_request, stream
from tests.fetched_tools import ToolMissing, compose_command

COMPOSE = Path(__file__).parent.parent / "deploy" / "compose"
IMAGE = "localhost/kervan:latest"


PACKAGES = ("kervan", "worker", "services", "control_plane")
DIGEST = "find {} -name '*.py' -type f | LC_ALL=C sort | xargs sha256sum | sha256sum"


def podman_or_skip() -> None:
    if os.geteuid() != 0:
        pytest.skip("the compose cluster under podman runs as root here")
    if shutil.which("podman") is None:
        pytest.skip("no podman here (Debian: apt-get install podman runc)")
    if subprocess.run(["podman", "image", "exists", IMAGE], capture_output=True, timeout=60).returncode != 0:
        pytest.skip(f"no {IMAGE}: build it with deploy/offline-image.sh (minutes; the test never builds it)")


def image_is_of_this_checkout(env: dict) -> bool:
    """The Python sources baked into the image are this checkout's (their digest, the same way)."""
    digest = DIGEST.format(" ".join(PACKAGES))
    inside = subprocess.run(["podman", "run", "--rm", "--entrypoint", "sh", "-w", "/opt/kervan/src", IMAGE, "-c",
                             digest], capture_output=True, text=True, env=env, timeout=120)
    here = subprocess.run(["sh", "-c", digest], cwd=Path(__file__).parent.parent, capture_output=True, text=True,
                          timeout=120)
    return inside.returncode == 0 and inside.stdout == here.stdout


def containers_conf(path: Path) -> Path:
    """runc where there is one, and rlimits no higher than this process's own (lowering needs no
    privilege; podman's defaults raise them)."""
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    procs = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    limits = [f'"nofile={min(files, 16384)}:{min(files, 16384)}"', f'"nproc={min(procs, 4096)}:{min(procs, 4096)}"']
    runtime = '\n[engine]\nruntime = "runc"\n' if shutil.which("runc") else ""
    path.write_text(f"[containers]\ndefault_ulimits = [{', '.join(limits)}]\n{runtime}")
    return path


class HealthChecks(threading.Thread):
    """``podman healthcheck run`` for every container of the project, every two seconds."""

    def __init__(self, project: str, env: dict):
        super().__init__(daemon=True)
        self.project, self.env, self.halt = project, env, threading.Event()

    def run(self) -> None:
        while not self.halt.wait(2.0):
            names = subprocess.run(["podman", "ps", "--filter", f"label=com.docker.compose.project={self.project}",
                                    "--format", "{{.Names}}"], capture_output=True, text=True, env=self.env,
                                   timeout=60).stdout.split()
            for name in names:
                subprocess.run(["podman", "healthcheck", "run", name], capture_output=True, env=self.env, timeout=60)


def ask(address: str, prompt: str) -> Completion:
    completion = Completion()

    async def run() -> None:
        async for msg in stream(address, build_request(prompt, max_tokens=8, temperature=0.0), timeout=120):
            accumulate(completion, msg)

    asyncio.run(run())
    return completion


def live_decoders(base: str) -> list[str]:
    with urllib.request.urlopen(f"{base}/mesh/state", timeout=10) as r:
        return [w["address"] for w in json.loads(r.read())["workers"] if w["role"] == "decode"]


def test_the_compose_cluster_answers_through_the_router_and_scales_decode_to_two(tmp_path):
    podman_or_skip()
    try:
        compose = compose_command()
    except ToolMissing as exc:
        pytest.skip(str(exc))
    env = {**os.environ, "CONTAINERS_CONF": str(containers_conf(tmp_path / "containers.conf"))}
    if not image_is_of_this_checkout(env):
        pytest.skip(f"{IMAGE} holds other sources than this checkout: rebuild it with deploy/offline-image.sh")
    socket = tmp_path / "podman.sock"
    service = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{socket}"], env=env,
                               stdout=subprocess.DEVNULL, stderr=open(tmp_path / "podman-service.log", "w"))
    project = f"kervan-test-{uuid.uuid4().hex[:6]}"
    env["DOCKER_HOST"] = f"unix://{socket}"
    files = ["-p", project, "-f", str(COMPOSE / "compose.yaml"), "-f", str(COMPOSE / "compose.offline.yaml")]
    checks = HealthChecks(project, env)
    try:
        for _ in range(100):
            if socket.exists():
                break
            time.sleep(0.1)
        checks.start()
        started = time.monotonic()
        up = subprocess.run([*compose, *files, "up", "-d", "--wait", "--wait-timeout", "400"], env=env,
                            capture_output=True, text=True, timeout=600)
        assert up.returncode == 0, up.stderr[-3000:]
        print(f"compose up, every service healthy, in {time.monotonic() - started:.0f} s")
        first = ask("127.0.0.1:8470", "Once upon a time")
        assert first.finish_reason == "length" and len(first.token_ids) == 8
        assert len(live_decoders("http://127.0.0.1:8000")) == 1

        scaled = subprocess.run([*compose, *files, "up", "-d", "--wait", "--wait-timeout", "300", "--no-recreate",
                                 "--scale", "decode=2"], env=env, capture_output=True, text=True, timeout=400)
        assert scaled.returncode == 0, scaled.stderr[-3000:]
        deadline = time.monotonic() + 60
        while len(live_decoders("http://127.0.0.1:8000")) < 2 and time.monotonic() < deadline:
            time.sleep(1)
        decoders = live_decoders("http://127.0.0.1:8000")
        assert len(set(decoders)) == 2, decoders  # each replica its own address (auto), both live
        for i in range(4):
            again = ask("127.0.0.1:8470", f"Once upon a time {i}")
            assert again.finish_reason == "length" and len(again.token_ids) == 8
    finally:
        checks.halt.set()
        subprocess.run([*compose, *files, "down", "-v", "--timeout", "10"], env=env, capture_output=True, timeout=300)
        service.terminate()
        service.wait(timeout=30)
