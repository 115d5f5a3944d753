"""One Redis URL for every service that talks to Redis, with timeouts always set.

- ``redis://[[user]:password@]host:port/db``, ``rediss://...?ssl_ca_certs=ca.pem`` (TLS),
  ``unix://...``: as redis-py takes them;
- ``redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]``: ask the
  Sentinels for the current master of ``service`` (and again after a failover), so Redis
  itself is not a single point of failure; the password is the data nodes' and the
  Sentinels' alike.

Every command times out after ``timeout_s``: a slow or partitioned Redis fails the call
(UNAVAILABLE to the caller) instead of hanging it for minutes."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

import redis.asyncio as redis
from redis.asyncio.sentinel import Sentinel

SENTINEL_SCHEME = "redis+sentinel"


def connect(url: str, timeout_s: float = 2.0, max_connections: int | None = None,
            connection_class: type | None = None, read_timeout: bool = True) -> redis.Redis:
    """A client for ``url``. ``read_timeout`` False: reads wait as long as they must (a
    subscription that waits for messages), connecting and the health checks still time out."""
    timeouts: dict[str, Any] = {"socket_connect_timeout": timeout_s,
                                "socket_timeout": timeout_s if read_timeout else None}
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        pool_class = redis.BlockingConnectionPool if max_connections else redis.ConnectionPool
        options: dict[str, Any] = {"max_connections": max_connections, "timeout": timeout_s} if max_connections else {}
        if connection_class is not None:
            options["connection_class"] = connection_class
        return redis.Redis(connection_pool=pool_class.from_url(url, **options, **timeouts),
                           health_check_interval=5)
    hosts = []
    for node in parts.netloc.rpartition("@")[2].split(","):
        host, _, port = node.rpartition(":")
        hosts.append((host.strip("[]"), int(port or 26379)))
    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise ValueError(f"{SENTINEL_SCHEME} URL needs the master's service name: {SENTINEL_SCHEME}://HOST:PORT/NAME")
    auth: dict[str, Any] = {"username": unquote(parts.username) if parts.username else None,
            "password": unquote(parts.password) if parts.password else None}
    sentinel = Sentinel(hosts, sentinel_kwargs={**auth, **timeouts}, **auth, **timeouts)
    master: redis.Redis = sentinel.master_for(path[0], db=int(path[1]) if len(path) > 1 else 0,
                                              health_check_interval=5)
    return master
