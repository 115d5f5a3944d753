"""A worker's lease in Redis, as the kv-registry writes it and the lease watch hears it expire:
the one part of the registry's key layout another process reads (the rest stays in
``services/kv_registry/index.py``)."""

from __future__ import annotations

KEY_PREFIX = "kervan:"  # every key the registry writes starts so
LEASE_PREFIX = f"{KEY_PREFIX}w:"  # a worker's lease key is LEASE_PREFIX + its id; it expires with the lease


def leased_worker(key: bytes) -> str | None:
    """The worker whose lease ``key`` is, or None (another key)."""
    prefix = LEASE_PREFIX.encode()
    return key[len(prefix):].decode() if key.startswith(prefix) else None
