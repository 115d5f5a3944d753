"""A sequence inside the engine: one sample of a request — its tokens, how many
have KV in the cache, its status, and the hashes of its full blocks (kept current
as tokens are appended).

A request runs as one sequence per sample: the first one's ``seq_id`` is the
request id; for ``n > 1`` the rest are forked from it after the prompt is computed
(``seq_id`` ``{request_id}#{k}``) and share its blocks (copy-on-write).
``request_id`` names the request a sequence belongs to; ``sample_index`` is its
place among the request's samples."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch

from kervan.block_hash import ROOT_HASH, BlockHash, hash_blocks
from kervan.sampling import SamplingParams
from worker.noise import exponential


@dataclass(frozen=True)
class FetchedKV:
    """Blocks of a prompt's prefix another worker held and sent (the cluster KV tier,
    ``worker/kv/cluster_tier.py``)."""

    first_block: int  # the prompt's block the data starts at
    data: torch.Tensor  # [layers, 2, blocks, kv_heads, block_size * head_dim]


class SequenceStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # finished statuses sort last
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {SequenceStatus.FINISHED_STOPPED: "stop", SequenceStatus.FINISHED_LENGTH: "length",
                SequenceStatus.FINISHED_ABORTED: "abort"}.get(self)


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 block_size: int, eos_token_ids: tuple[int, ...] = (), cache_salt: bytes = b""):
        self.seq_id = request_id  # the first sample's; forks get their own
        self.request_id = request_id
        self.sample_index = 0
        self.params = params
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt, then outputs
        self.logprobs: list[float] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.status = SequenceStatus.WAITING
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                              else frozenset(eos_token_ids))
        self.block_size = block_size
        self.cache_salt = cache_salt
        self.block_hashes: list[BlockHash] = []
        self._update_block_hashes()
        # one random stream per sample, independent of the batch; None when unseeded
        self.sample_generators = [None if params.seed is None else torch.Generator().manual_seed(params.seed + k)
                                  for k in range(params.n)]
        self.num_emitted = 0  # output tokens already reported by step()
        # disaggregated serving: KV of the prompt computed elsewhere ([layers, 2, blocks,
        # kv_heads, block_size * head_dim]), written into this engine's blocks on admission
        self.imported_kv: torch.Tensor | None = None
        # the cluster KV tier: blocks of the prompt's prefix fetched from another worker (worker/kv/cluster_tier.py)
        self.fetched_kv: FetchedKV | None = None
        self.hold_kv = False  # keep the blocks after finishing, until released (prefill side)
        self.arrival_time = time.monotonic()
        self.queue_time_s: float | None = None  # arrival to first scheduled (set once, by the scheduler)
        # prompt chunks computed: (first token, tokens, step start, step end; ns since the epoch)
        self.prefill_chunks: list[tuple[int, int, int, int]] = []
        # speculative decoding (``worker/spec/``): the proposer's guesses of the next tokens, for
        # the next step to verify (never in ``token_ids``, so never hashed), with the draft's
        # distributions they were drawn from ([guesses, vocab]; None: point proposals)
        self.draft_tokens: list[int] = []
        self.draft_probs: torch.Tensor | None = None
        # a seeded sample's noise drawn for positions not yet emitted (a step verifying k guesses
        # draws k + 1 and may keep fewer tokens): the next tokens use it first, so a seed gives
        # the same tokens with speculation as without
        self.pending_noise: list[torch.Tensor] = []

    @property
    def generator(self) -> torch.Generator | None:
        return self.sample_generators[self.sample_index]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output(self, token_id: int, logprob: float | None) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        done = len(self.block_hashes)
        if self.num_tokens // self.block_size > done:
            parent = self.block_hashes[-1] if done else ROOT_HASH
            self.block_hashes += hash_blocks(self.token_ids, self.block_size, self.cache_salt, parent, done)

    def fork(self, sample_index: int) -> Sequence:
        """A sibling sample sharing everything computed so far (the prompt)."""
        child = Sequence.__new__(Sequence)
        child.__dict__.update(self.__dict__)
        child.seq_id = f"{self.request_id}#{sample_index}"
        child.sample_index = sample_index
        child.token_ids = list(self.token_ids)
        child.logprobs = list(self.logprobs)
        child.block_hashes = list(self.block_hashes)
        child.draft_tokens, child.draft_probs, child.pending_noise = [], None, []
        return child

    def take_noise(self, count: int, vocab_size: int) -> list[torch.Tensor]:
        """The exponential noise of this seeded sample's next ``count`` positions, in the
        order its generator gives it (what ``Sampler`` draws one token at a time)."""
        noise, self.pending_noise = self.pending_noise[:count], self.pending_noise[count:]
        noise += [exponential((vocab_size,), self.generator) for _ in range(count - len(noise))]
        return noise

    def keep_noise(self, unused: list[torch.Tensor]) -> None:
        """Give back noise taken but not used (the positions after a rejected guess)."""
        self.pending_noise = unused + self.pending_noise
