# mypy: disable-error-code="arg-type,operator,union-attr"
"""The engine: add requests, ``step()``, read outputs. No gRPC in here.

    step = schedule -> execute -> update -> emit

``generate`` is the offline API on top of the same loop; the services drive
``add_request`` / ``step`` / ``abort`` themselves."""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kervan.block_hash import BlockHash
from kervan.kv_events import KVEvent
from kervan.sampling import InvalidRequest, RequestLimits, SamplingParams
from kervan.tokenizer import Tokenizer
from worker.config import ConfigError, EngineConfig, ModelConfig
from worker.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from worker.engine.scheduler import StepScheduler
from worker.kv.cluster_tier import HeldRead, read_held
from worker.kv.disk_tier import DiskTier, model_identity
from worker.kv.host_tier import HostTier
from worker.kv.kv_cache_manager import KVCacheManager
from worker.loader import load_model
from worker.parallel import get_parallel_state
from worker.parallel.group import GroupLeader
from worker.platform import current_platform
from worker.runner.model_runner import ModelRunner
from worker.runner.sampler import skip_draw
from worker.sequence import FetchedKV, Sequence
from worker.spec.proposer import make_proposer

Prompt = list[int] | str
log = logging.getLogger(__name__)
PREFILL_RATE_MIN_TOKENS = 256  # a step's prompt tokens below which its rate is not the prefill's


@dataclass(frozen=True)
class ImportedKV:
    """What a prefill worker hands a decode worker for one request."""

    first_token: int
    first_logprob: float | None
    data: torch.Tensor  # [layers, 2, prompt blocks, kv_heads, block_size * head_dim]


class Engine:
    def __init__(self, model_dir: str | Path, config: EngineConfig):
        self.model_config = ModelConfig.from_dir(model_dir)
        self.config = config.resolve(self.model_config, current_platform())
        if get_parallel_state().world > 1:  # the layers read the process's parallel state when built
            raise ConfigError("this process is rank 0 of a running worker group: one engine per process "
                              "(close the group's engine first)")
        # a worker group: the other ranks start now and load their shards while this one loads its own
        self.group = GroupLeader.start(model_dir, self.config) if self.config.world_size > 1 else None
        try:
            model = load_model(model_dir, self.config.dtype, self.config.max_model_len, self.config.device,
                               self.config.quantization)
            self.runner = ModelRunner(model, self.config, self.group)
            host = self._host_tier()
            disk = self._disk_tier(model_dir) if host is not None and self.config.enable_prefix_caching else None
            self.kv = KVCacheManager(self.config.num_kv_blocks, self.config.block_size,
                                     self.config.enable_prefix_caching, host, disk,
                                     write_through=self.config.kv_disk_write == "through",
                                     min_uses=self.config.kv_offload_min_uses)
        except BaseException:
            self.close()
            raise
        self.scheduler = StepScheduler(self.config, self.kv)
        try:
            self.proposer = make_proposer(self.config, self.runner.model, model_dir)
            self.runner.keep_hidden = self.proposer is not None and self.proposer.reads_hidden
        except BaseException:
            self.close()
            raise
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.groups: dict[str, list[Sequence]] = {}  # request id -> its sequences (n of them once forked)
        self._ids = itertools.count()
        self.num_prompt_tokens_computed = 0
        self.prefill_tokens_per_s = 0.0

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **options) -> Engine:
        return cls(model_dir, EngineConfig(**options))

    # -- the step-level interface -------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: bytes = b"", *, hold_kv: bool = False,
                    imported: ImportedKV | None = None, fetched: FetchedKV | None = None) -> str:
        """Queue a request. ``hold_kv``: keep its blocks after it finishes, for
        ``export_kv``, until ``release_kv`` (the prefill side of a KV handoff).
        ``imported``: the prompt's KV and first token were computed by another
        worker; this engine continues from the second token (the decode side).
        ``fetched``: blocks of the prompt's prefix another worker held (the cluster KV
        tier), used instead of computing them where they meet this engine's own hit."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.groups or request_id in self.scheduler.held:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        token_ids = self.validate(prompt, params)
        seq = Sequence(request_id, token_ids, params, self.config.block_size,
                      self.model_config.eos_token_ids, cache_salt)
        seq.hold_kv = hold_kv
        if fetched is not None and self._fits(fetched.data):
            seq.fetched_kv = fetched
        if imported is not None:
            self._check_import(imported, len(token_ids), params)
            seq.append_output(imported.first_token, imported.first_logprob if params.logprobs else None)
            seq.imported_kv = imported.data
            seq.num_emitted = 1  # the first token was streamed by the prefill side
            if seq.generator is not None and not params.is_greedy:
                # the prefill side drew the first token from this seed: continue its stream
                skip_draw(seq.generator, self.model_config.vocab_size)
        self.groups[request_id] = [seq]
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks; False if unknown."""
        released = self.scheduler.release(request_id)
        seqs = self.groups.pop(request_id, None)
        if seqs is None:
            return released
        self.scheduler.abort(seqs)
        return True

    def export_kv(self, request_id: str) -> torch.Tensor:
        """The prompt's KV of a finished, held request, in host memory (the handoff's
        format, whatever the device): [layers, 2, prompt blocks, kv_heads, block_size * head_dim]."""
        seq = self.scheduler.held.get(request_id)
        if seq is None:
            raise KeyError(f"no held KV for request {request_id!r}")
        num_blocks = -(-seq.num_prompt_tokens // self.config.block_size)
        return self.runner.read_blocks(self.kv.get_block_ids(request_id)[:num_blocks]).cpu()

    def release_kv(self, request_id: str) -> bool:
        return self.scheduler.release(request_id)

    def read_prefix(self, hashes: list[BlockHash]) -> HeldRead:
        """The KV of the leading blocks of ``hashes`` held here (pool, host tier, then a disk
        read): what this worker sends another that fetches them (``worker/kv/cluster_tier.py``)."""
        return read_held(hashes, self.kv.pool, self.kv.host, self.kv.disk,
                         lambda ids: self.runner.read_blocks(ids).cpu() if ids else
                         torch.empty(self.kv_block_shape(0), dtype=self.config.dtype))

    def disk_blocks(self, raw: list[bytearray]) -> torch.Tensor:
        """Blocks a disk read returned (``read_prefix``'s future), as one tensor."""
        assert self.kv.disk is not None
        return self.kv.disk.blocks(raw)

    def _fits(self, data: torch.Tensor) -> bool:
        """Whether blocks another worker sent are this engine's layout and dtype (the same model,
        block size and dtype): the ones that are not are left unused, and computed."""
        expected = self.kv_block_shape(self.config.block_size)
        if data.dim() == 5 and (*data.shape[:2], *data.shape[3:]) == (*expected[:2], *expected[3:]) \
                and data.dtype == self.config.dtype:
            return True
        log.warning("fetched KV is %s %s, this worker's blocks are %s %s: computing the prefix instead",
                    tuple(data.shape), data.dtype, expected, self.config.dtype)
        return False

    def kv_block_shape(self, num_tokens: int) -> tuple[int, ...]:
        """Shape of the exported KV of ``num_tokens`` prompt tokens: every layer and KV head,
        whatever this worker's group (``worker/parallel/kv_shards.py``)."""
        cfg = self.model_config
        return (cfg.num_layers, 2, -(-num_tokens // self.config.block_size), cfg.num_kv_heads,
                self.config.block_size * cfg.head_dim)

    def _check_import(self, imported: ImportedKV, num_prompt_tokens: int, params: SamplingParams) -> None:
        expected = self.kv_block_shape(num_prompt_tokens)
        if tuple(imported.data.shape) != expected or imported.data.dtype != self.config.dtype:
            raise InvalidRequest(f"imported KV is {tuple(imported.data.shape)} {imported.data.dtype}, this worker "
                                 f"needs {expected} {self.config.dtype} (same model, block size and dtype)")
        if not 0 <= imported.first_token < self.model_config.vocab_size:
            raise InvalidRequest(f"first token {imported.first_token} is outside the vocabulary")
        if params.n != 1:
            raise InvalidRequest("n > 1 is not supported with disaggregated prefill")

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        self._demote()
        if not batch.sequences:
            if self.kv.tiers is not None and self.kv.tiers.fetches:  # nothing to run until a prefix is read
                self.kv.tiers.wait_for_reads(0.05)
            return []
        started = time.time_ns()
        result = self.runner.execute(batch)
        ended = time.time_ns()
        prompt_tokens = 0
        for scheduled in batch.sequences:  # each prompt chunk's place in the request's timeline
            seq = scheduled.sequence
            if scheduled.num_computed < seq.num_prompt_tokens:
                seq.prefill_chunks.append((scheduled.num_computed, scheduled.num_new_tokens, started, ended))
                prompt_tokens += min(scheduled.num_new_tokens, seq.num_prompt_tokens - scheduled.num_computed)
        self._count_prefill(prompt_tokens, (ended - started) / 1e9)
        progressed = self.scheduler.update(batch, result.samples)
        if self.proposer is not None:
            self.proposer.observe(batch.sequences, result.hidden)
            self._propose()
        touched: dict[str, None] = {}
        for seq in progressed:
            group = self.groups[seq.request_id]
            if seq not in group:
                group.append(seq)
            touched[seq.request_id] = None
        return [self._output(rid) for rid in touched]

    def _count_prefill(self, num_tokens: int, seconds: float) -> None:
        """Prompt tokens computed, and the rate of steps that computed enough of them for it to
        be the prefill's, not a step's fixed cost (an average weighted toward the recent)."""
        self.num_prompt_tokens_computed += num_tokens
        if num_tokens >= PREFILL_RATE_MIN_TOKENS and seconds > 0:
            rate = num_tokens / seconds
            self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else \
                0.7 * self.prefill_tokens_per_s + 0.3 * rate

    def _propose(self) -> None:
        """Guesses for the sequences that decode next step, unless the batch is so large that
        verifying them costs more than it saves (``speculative_disable_by_batch_size``)."""
        running = self.scheduler.running
        limit = self.config.speculative_disable_by_batch_size
        if limit and len(running) > limit:
            return
        self.proposer.propose(running)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def take_events(self) -> list[KVEvent]:
        return self.kv.take_events()

    # -- the offline interface ----------------------------------------------------

    def generate(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequest(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.add_request(prompt, p))
        except Exception:
            for rid in ids:
                self.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    # -- internals ----------------------------------------------------------------

    def _host_tier(self) -> HostTier | None:
        num_blocks = self.config.host_tier_blocks(self.model_config)
        if not num_blocks:
            return None
        return HostTier(num_blocks, self._tier_block_shape(), self.config.dtype,
                        pin=self.config.device.startswith("cuda"))

    def _tier_block_shape(self) -> tuple[int, ...]:
        """One block in the tiers' (and the handoff's) layout: every layer and KV head."""
        cfg = self.model_config
        return cfg.num_layers, 2, cfg.num_kv_heads, self.config.block_size * cfg.head_dim

    def _disk_tier(self, model_dir: str | Path) -> DiskTier | None:
        num_blocks = self.config.disk_tier_blocks(self.model_config)
        if not num_blocks:
            return None
        try:
            return DiskTier(self.config.kv_disk_dir, num_blocks, self._tier_block_shape(), self.config.dtype,
                            model_identity(model_dir))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"disk tier: {exc}") from None

    def _demote(self) -> None:
        """The cached blocks this step's schedule took for reuse that go to the tiers, read
        straight into the host tier's slots before the step overwrites them."""
        tiers = self.kv.tiers
        if tiers is None:
            return
        tiers.poll_disk()
        evicted = self.kv.take_evictions()
        ids = [block_id for block_id, _ in evicted]
        tiers.demote([h for _, h in evicted],
                     lambda positions, out: self.runner.read_blocks([ids[p] for p in positions], out=out))

    def validate(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt as token ids, or InvalidRequest naming what to fix. Reads only
        configuration, so other threads may call it while the engine steps."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("prompt is text but the model has no tokenizer; pass token ids")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
        vocab = self.model_config.vocab_size
        if not token_ids:
            raise InvalidRequest("prompt is empty")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        params.check_vocabulary(vocab)
        self.limits.check(len(token_ids), params.max_tokens, params.n)
        return token_ids

    def _output(self, request_id: str) -> RequestOutput:
        seqs = self.groups[request_id]
        first = seqs[0]
        completions = []
        for seq in sorted(seqs, key=lambda s: s.sample_index):
            tokens = seq.output_token_ids
            new = tokens[seq.num_emitted:]
            seq.num_emitted = len(tokens)
            text = self.tokenizer.decode(tokens) if self.tokenizer and seq.is_finished else None
            completions.append(CompletionOutput(seq.sample_index, tokens, list(seq.logprobs) if seq.params.logprobs
                                                else None, seq.status.finish_reason, new, text))
        finished = len(seqs) == first.params.n and all(s.is_finished for s in seqs)
        if finished:
            del self.groups[request_id]
        return RequestOutput(request_id, first.token_ids[:first.num_prompt_tokens], completions,
                             max(first.num_cached_tokens, 0), finished, first.queue_time_s,
                             list(first.prefill_chunks))

    def stats(self) -> EngineStats:
        running = self.scheduler.running
        spec = self.runner.verifier.counters
        return EngineStats(num_running=len(running), num_waiting=len(self.scheduler.waiting),
                           num_free_blocks=self.kv.num_free_blocks, num_blocks=self.config.num_kv_blocks,
                           num_prefill_tokens=self.scheduler.num_prefill_tokens,
                           num_evictable_blocks=self.kv.pool.num_evictable,
                           num_preemptions=self.scheduler.num_preemptions,
                           num_kv_slots_allocated=self.config.block_size * sum(
                               len(self.kv.tables.get(seq.seq_id, ())) for seq in running),
                           num_kv_slots_used=sum(seq.num_computed_tokens for seq in running),
                           expert_tokens_per_rank=self.runner.model.routed_tokens_per_rank(),
                           num_prompt_tokens_computed=self.num_prompt_tokens_computed,
                           prefill_tokens_per_s=self.prefill_tokens_per_s,
                           kv_block_bytes=math.prod(self.kv_block_shape(self.config.block_size))
                           * self.config.dtype.itemsize,
                           kv_capacity_blocks=self.config.num_kv_blocks + sum(
                               0 if t is None else t.num_blocks for t in (self.kv.host, self.kv.disk)),
                           spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
                           spec_num_accepted_tokens=spec.num_accepted_tokens,
                           spec_accepted_per_position=tuple(spec.accepted_per_position),
                           **self._tier_stats())

    def _tier_stats(self) -> dict[str, int]:
        host = self.kv.host
        if host is None:
            return {}
        stats = {"num_host_blocks": len(host), "num_host_demoted": host.num_stored,
                 "num_host_promoted": host.num_promoted}
        disk = self.kv.disk
        if disk is not None:
            stats.update(num_disk_blocks=len(disk), num_disk_stored=disk.num_stored, num_disk_loaded=disk.num_loaded,
                         num_disk_corrupt=disk.num_corrupt, num_disk_write_dropped=disk.num_write_dropped)
        return stats

    def cached_blocks(self) -> tuple[int, list[bytes]]:
        """Every cached block's hash, as of the last KV event's sequence number (a full
        dump for the registry; events not yet taken are superseded by it)."""
        return self.kv.dump()

    def tier_blocks(self) -> dict[str, list[bytes]]:
        """The blocks only the tiers behind the pool hold, by tier ("host", "disk"; call with
        ``cached_blocks``, for one dump)."""
        return self.kv.tiers.blocks() if self.kv.tiers is not None else {}

    def keepalive(self) -> None:
        """Call while idle, at least every second: the peers of a worker group wait for
        rank 0 only so long (``KERVAN_GROUP_TIMEOUT_S``) before they take it for lost."""
        if self.group is not None:
            self.group.ping()

    def close(self) -> None:
        """Write the cached KV to the disk tier, if any (a restart finds it there), and stop
        the disk tier's thread once its writes are made and a worker group's other ranks."""
        proposer = getattr(self, "proposer", None)
        if proposer is not None:
            proposer.close()
        tiers = getattr(getattr(self, "kv", None), "tiers", None)
        if tiers is not None and tiers.disk is not None:
            try:
                tiers.keep_on_disk(self.runner.read_blocks)
            finally:
                tiers.disk.close()
        if self.group is not None:
            self.group.stop()
            self.group = None

    @property
    def limits(self) -> RequestLimits:
        """What this engine serves (a worker reports it when it registers)."""
        # a request's samples run side by side: never more of them than the batch has seats
        return RequestLimits(max_model_len=self.config.max_model_len,
                             max_n=min(self.config.max_n, self.config.max_num_seqs))

    @property
    def uses_native_kernels(self) -> bool:
        return self.runner.native_kernels
