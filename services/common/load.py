"""A worker's load, as workers report it and the registry stores it."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, kw_only=True)
class Load:
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0  # cached or empty
    num_blocks: int = 0
    num_prefill_tokens: int = 0  # prompt tokens admitted, not yet computed
    num_evictable_blocks: int = 0  # free blocks still holding cached prefixes (a subset of the free ones)
    num_requests: int = 0  # sequences admitted and not finished (n per request of n samples; admission limits it)
    max_requests: int = 0  # past this many new requests are refused; 0: no limit
    num_aborted: int = 0  # requests aborted before they finished, since the worker started
    # what placement prices the cluster KV tier with: the prompt tokens a second the engine computes and the
    # bytes a second its KV transfers move, both measured (0: not yet), and one block's bytes
    prefill_tokens_per_s: int = 0
    kv_link_bytes_per_s: int = 0
    kv_block_bytes: int = 0
    num_host_blocks: int = 0  # KV blocks in the host tier, and in the disk tier (0: no such tier)
    num_disk_blocks: int = 0
    # MoE: (token, expert) pairs each rank of the worker group computed, since the start (load balance);
    # the worker reports it, the registry keeps only the counts above (SCALARS)
    expert_tokens_per_rank: tuple[int, ...] = ()

    @property
    def full(self) -> bool:
        return 0 < self.max_requests <= self.num_requests


SCALARS = tuple(f.name for f in fields(Load) if f.type == "int")  # what a registry stores per worker
