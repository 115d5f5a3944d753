"""KV events: what a worker tells the kv-registry about its cache.

Shapes follow vLLM's and SGLang's events (consumed by Dynamo and llm-d): one
``BlockStored`` per run of consecutive blocks a request filled, carrying the
parent hash so the consumer can chain them; ``BlockRemoved`` when cached blocks
are evicted; ``AllBlocksCleared`` when the cache is reset. Every event carries
the engine's monotonic sequence number so a consumer can detect gaps."""

from __future__ import annotations

from dataclasses import dataclass

from kervan.block_hash import BlockHash

MEDIUM_DEVICE = "device"  # the engine's own pool (accelerator memory; the CPU's KV cache)
MEDIUM_HOST = "host"  # tier 1 behind the pool: host memory
MEDIUM_DISK = "disk"  # tier 2 behind the host tier: local disk


@dataclass(frozen=True)
class BlockStored:
    seq: int
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None  # None: the first block hangs off the root
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM_DEVICE


@dataclass(frozen=True)
class BlockRemoved:
    seq: int
    block_hashes: list[BlockHash]
    medium: str = MEDIUM_DEVICE


@dataclass(frozen=True)
class AllBlocksCleared:
    seq: int


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
