"""What the engine hands back: one ``RequestOutput`` per request, holding one
``CompletionOutput`` per sample (``n`` of them). ``step()`` returns outputs for
requests that progressed, with the tokens new since the last step in ``.new_token_ids``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    new_token_ids: list[int] = field(default_factory=list)
    text: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
    queue_time_s: float | None = None  # from arrival to first scheduled; None until then
    # the prompt's chunks as computed: (first token, tokens, step start, step end; ns since the epoch)
    prefill_chunks: list[tuple[int, int, int, int]] = field(default_factory=list)

    # a single-sample request reads like its only completion
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[float] | None:
        return self.outputs[0].logprobs

    @property
    def text(self) -> str | None:
        return self.outputs[0].text


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    """The engine's load as of its last step (what a worker reports to the mesh), and
    how well its KV cache is used."""

    num_running: int  # sequences running
    num_waiting: int  # sequences waiting
    num_free_blocks: int  # KV blocks free (cached or empty)
    num_blocks: int
    num_prefill_tokens: int  # prompt tokens admitted, not yet computed
    num_evictable_blocks: int  # free blocks still holding cached prefixes
    num_preemptions: int  # sequences preempted (their KV dropped) since the engine started
    # KV slots (one token each) in the blocks of running sequences, and how many of them hold
    # KV; the difference is the cache's internal waste (a block shared by two sequences counts twice)
    num_kv_slots_allocated: int
    num_kv_slots_used: int
    # MoE: (token, expert) pairs each rank of the worker group computed since the start; () if dense
    expert_tokens_per_rank: tuple[int, ...] = ()
    # the host tier behind the pool: blocks it holds, and blocks demoted into it and copied back since the start
    num_host_blocks: int = 0
    num_host_demoted: int = 0
    num_host_promoted: int = 0
    # the disk tier behind it: blocks it holds; blocks written, read back, refused by their
    # checksum, and not written because the disk lagged, since the start
    num_disk_blocks: int = 0
    num_disk_stored: int = 0
    num_disk_loaded: int = 0
    num_disk_corrupt: int = 0
    num_disk_write_dropped: int = 0
    # every block the worker may hold a hash for: the pool's, the host tier's and the disk tier's
    # (what it registers as its capacity; 0 in stats made elsewhere: the pool's alone)
    kv_capacity_blocks: int = 0
    # prompt tokens the model computed since the start (not those cached, promoted, imported or fetched),
    # and the rate its recent prefill steps computed them at (0 before the first)
    num_prompt_tokens_computed: int = 0
    prefill_tokens_per_s: float = 0.0
    kv_block_bytes: int = 0  # one KV block, every layer and KV head
    # speculative decoding since the start (vLLM's spec_decode counters): sequences that ran guesses
    # in a step, their guesses, the guesses kept, and those kept at each position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
