"""Chained block hashes for prefix caching, shared by the engine, the kv-registry and the router.

``h_i = sha256(h_{i-1} || tokens_i || extra)`` over *full* blocks only, starting
from a fixed root, so two processes (or two machines) hashing the same tokens
agree; never Python's ``hash()``, which is seeded per process. ``extra`` carries
what must separate otherwise equal prefixes (a LoRA id, a tenant's cache salt);
it enters the first block only, and the chain carries it onward.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_NAME = "sha256"  # advertised to the mesh so every member hashes alike
# tokens per block unless a mesh is started with another size (the kv-registry's --block-size,
# which every worker must match and the router asks for)
DEFAULT_BLOCK_SIZE = 16
ROOT_HASH = hashlib.sha256(b"kervan.block_hash.v1").digest()

BlockHash = bytes


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if extra:
        h.update(b"\x00extra")
        h.update(extra)
    return h.digest()


def hash_blocks(token_ids: Sequence[int], block_size: int, extra: bytes = b"",
                parent: BlockHash = ROOT_HASH, first_block: int = 0) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` from block ``first_block`` on;
    ``parent`` is the hash of block ``first_block - 1`` (the root for block 0)."""
    out = []
    for i in range(first_block, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra if i == 0 else b"")
        out.append(parent)
    return out
