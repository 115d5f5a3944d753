# mypy: disable-error-code="arg-type,index,operator,type-var,union-attr"
"""Turns a ``ScheduledBatch`` into tensors, runs the model, samples.

Owns the KV cache tensors, one per layer: [2, num_blocks, num_kv_heads,
block_size * head_dim] (see ``paged_attention`` for the layout inside a block).
Sequences are laid out decodes first (one row per token), then prompt chunks,
which is the layout ``paged_attention`` expects. Only
rows that sample become logits: the last token of each sequence that reaches its
end this step (repeated ``n`` times for the first sample of an ``n > 1`` request),
and with speculative guesses (``worker/spec/``) the rows from its next token on."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kervan.sampling import SamplingParams
from worker.batch import KVWrite, ScheduledBatch, ScheduledSequence
from worker.config import ConfigError, EngineConfig
from worker.kernels import has_native_kernels
from worker.kv.memory import keep_freed_heap, zeros_on_huge_pages
from worker.layers.paged_attention import AttentionMetadata
from worker.models.decode_stack import build_decode_stack
from worker.models.decoder import DecoderModel
from worker.parallel import get_parallel_state, kv_shards, pipeline
from worker.parallel.group import GroupFailed, GroupLeader
from worker.parallel.step_inputs import StepInputs
from worker.quant.kernel_choice import choose_kernels
from worker.runner.graphs import GRAPH_MAX_CONTEXT, CudaGraphRunner, decode_buckets
from worker.runner.sampler import Sampler, SamplingRow
from worker.spec.verifier import Verifier

# the most tokens after a context that run as decode rows rather than as a chunk (``is_chunk``)
MAX_DECODE_ROWS = 8
ARGMAX = SamplingParams(temperature=0.0)  # a row whose token the sampler need not draw

Token = tuple[int, float | None]  # (token id, its logprob when the request asked for them)


@dataclass
class RunnerOutput:
    # sequence id -> per sample drawn for it this step, its run of tokens (more than one: speculative
    # guesses the target kept, then its own next token)
    samples: dict[str, list[list[Token]]]
    # with ``ModelRunner.keep_hidden``: sequence id -> the final hidden states of its rows this step, in
    # position order (what an EAGLE head reads)
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: DecoderModel, config: EngineConfig, group: GroupLeader | None = None):
        """``group``: the peers of a worker group, sent each step's inputs before this
        rank runs it (None: one process)."""
        self.model = model
        self.group = group
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_heap()  # each step's activations on pages the last step freed
        cfg = model.cfg
        # a pipeline stage holds the KV of its layers only; one block past the pool's pads CUDA graphs' batches
        self.pad_block = config.num_kv_blocks
        # every layer's cache in one tensor, [layers, 2, blocks, kv_heads, block_size * head_dim]: a run of
        # blocks moves in or out of the pool as one copy, not one per layer
        self.kv_pool = allocate_kv_pool(len(model.layers), config.num_kv_blocks + 1,
                                        model.layers[0].attn.num_kv_heads, config.block_size, cfg.head_dim,
                                        config.dtype, self.device)
        self.kv_caches = list(self.kv_pool.unbind(0))
        self.native_kernels = self.device.type == "cpu" and has_native_kernels()
        # each quantized weight's kernel, one for all its calls
        self.kernel_choices = choose_kernels(model) if self.native_kernels else []
        # a token's output is the same whatever else runs beside it: every matmul's kernel computes a
        # row alone, and attention takes one kernel for every token (``AttentionMetadata``'s per_token)
        variant = model.batch_variant_layers() if self.native_kernels else ["attention"]
        self.batch_invariant = not variant
        if config.deterministic and not self.native_kernels:
            raise ConfigError("deterministic mode needs the native CPU kernels (one attention kernel for prompts "
                              "and decodes), and they are off here: see the warning above, or unset "
                              "KERVAN_ATTENTION_BACKEND=torch")
        if config.deterministic and variant:
            raise ConfigError("deterministic mode needs a batch-invariant kernel for every layer, and these have "
                              f"none: {', '.join(variant[:4])} (leave KERVAN_WEIGHT_PACKING unset; latent attention, "
                              "DeepSeek's, has no batch-invariant kernel yet)")
        if self.native_kernels:
            model.decode_stack = build_decode_stack(model, self.kv_caches)
        self.sampler = Sampler(config.seed)
        self.verifier = Verifier(self.sampler, cfg.vocab_size)
        # keep the last forward's final hidden states of every row (an EAGLE head reads them); one process only
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        self.graphs = self._capture_graphs() if self._uses_graphs() else None

    def _uses_graphs(self) -> bool:
        """CUDA graphs for decode steps: on CUDA, one process, a model whose forward
        never waits on the host (not the MoE dispatch), unless ``enforce_eager``."""
        return (self.device.type == "cuda" and not self.config.enforce_eager and get_parallel_state().world == 1
                and not self.model.moes)

    def _capture_graphs(self) -> CudaGraphRunner:
        bs = self.config.block_size
        max_blocks = -(-min(self.config.max_model_len, GRAPH_MAX_CONTEXT) // bs)
        graphs = CudaGraphRunner(self.model, self.kv_caches, bs, max_blocks, self.pad_block,
                                 decode_buckets(self.config.max_num_seqs))
        with torch.inference_mode():
            graphs.capture()
        return graphs

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        seqs = sorted(batch.sequences, key=is_chunk)  # decodes first (stable)
        if self.group is None:
            logits = self.forward(self.prepare(seqs, batch.block_copies), batch.kv_writes)
        else:  # a collective that fails: a rank died or hangs
            logits = self._in_group(self._group_forward, seqs, batch.block_copies, batch.kv_writes)
        hidden = self._hidden_by_sequence(seqs) if self.keep_hidden else {}
        if logits is None:
            return RunnerOutput({}, hidden)
        logits = logits.cpu()
        per_seq = [self.verifier.rows(seq) for seq in seqs]
        # rows that rejection sampling draws from itself take the argmax here (no noise, no filters)
        rows = [SamplingRow(ARGMAX, None) if self.verifier.rejection_samples(seq) else row
                for seq, seq_rows in zip(seqs, per_seq) for row in seq_rows]
        tokens, logprobs = self.sampler(logits, rows)
        out: dict[str, list[list[Token]]] = {}
        i = 0
        for seq, seq_rows in zip(seqs, per_seq):
            span = slice(i, i + len(seq_rows))
            i = span.stop
            lps = logprobs[span] if logprobs is not None and seq.sequence.params.logprobs else None
            if seq.guesses:
                out[seq.sequence.seq_id] = [self.verifier.run(seq, logits[span], seq_rows, tokens[span], lps)]
            else:  # one row per sample
                out[seq.sequence.seq_id] = [[(t, None if lps is None else lps[k])]
                                            for k, t in enumerate(tokens[span])]
        return RunnerOutput(out, hidden)

    def _hidden_by_sequence(self, seqs: list[ScheduledSequence]) -> dict[str, torch.Tensor]:
        out, row = {}, 0
        for seq in seqs:
            out[seq.sequence.seq_id] = self.last_hidden[row:row + seq.num_new_tokens]
            row += seq.num_new_tokens
        return out

    def _group_forward(self, seqs: list[ScheduledSequence], block_copies,
                       kv_writes: Sequence[KVWrite]) -> torch.Tensor | None:
        ps = get_parallel_state()
        for write in kv_writes:  # imported KV: every rank keeps its part
            self.group.write_kv(write.block_ids, write.data)
            self.write_blocks(write.block_ids, write.data)
        if ps.pp_size == 1:  # every rank runs the whole step on its shard
            step = self.prepare(seqs, block_copies)
            self.group.send(step)
            return self.forward(step)
        parts = pipeline.split(seqs, lambda seq: seq.num_new_tokens, pipeline.MICRO_BATCHES_PER_STAGE * ps.pp_size)
        steps = [self.prepare(part, block_copies if i == 0 else []) for i, part in enumerate(parts)]
        self.group.send_micro_batches(steps)
        return pipeline.run_first_stage(self.forward, steps, ps, self.model.cfg.vocab_size, self.device)

    @torch.inference_mode()
    def forward(self, step: StepInputs, kv_writes: Sequence[KVWrite] = (),
                carried: torch.Tensor | None = None) -> torch.Tensor | None:
        """The model on one step's inputs: the logits of its sampling rows (None when no
        row samples). Every rank of a worker group runs it on the same ``step``; a
        pipeline stage but the last returns what the next stage takes (``carried``)."""
        for src, dst in step.block_copies:
            for cache in self.kv_caches:
                cache[:, dst].copy_(cache[:, src])
        for write in kv_writes:
            self.write_blocks(write.block_ids, write.data)
        return self._forward(step, kv_writes, carried)

    def _forward(self, step: StepInputs, kv_writes: Sequence[KVWrite], carried: torch.Tensor | None
                 ) -> torch.Tensor | None:
        stack = self.model.decode_stack
        if stack is not None and carried is None and stack.serves(step):
            hidden, logits = stack.run(step)  # the embedding, the layers and the head: one native call
            if self.keep_hidden:
                self.last_hidden = hidden
            return logits
        if self.graphs is not None and not kv_writes and self.graphs.can_run(step):
            hidden = self.graphs.run(step)
        else:
            meta = AttentionMetadata.build(step.slots, step.decode_tables, step.decode_lens, step.prefills,
                                           self.config.block_size, self.device, self.native_kernels,
                                           per_token=self.batch_invariant)
            hidden = self.model(torch.tensor(step.token_ids, device=self.device),
                                torch.tensor(step.positions, device=self.device), self.kv_caches, meta,
                                None if carried is None else carried.to(self.device))
        if not self.model.is_last_stage:
            return hidden
        if self.keep_hidden:
            self.last_hidden = hidden.clone() if self.graphs is not None else hidden  # graphs reuse their buffer
        if not step.logit_rows:
            return None
        return self.model.compute_logits(hidden[torch.tensor(step.logit_rows, device=self.device)])

    @torch.inference_mode()
    def read_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor | None:
        """A copy of blocks' KV in the handoff's layout, every layer and KV head: [layers, 2,
        len(block_ids), kv_heads, block_size * head_dim], written into ``out`` when given (a
        view of a host tier's slots: one copy, nothing allocated). In a worker group every
        rank calls it (rank 0 first sends the peers ``read_kv``) and rank 0 gets the
        gathered whole; the peers get None."""
        if self.group is not None:
            self._in_group(self.group.read_kv, block_ids)
        pool = self.kv_pool
        direct = out is not None and self.group is None and out.device == pool.device
        local = out if direct else pool.new_empty((*pool.shape[:2], len(block_ids), *pool.shape[3:]))
        run = _run_start(block_ids)  # every layer's blocks gathered straight into the result: one copy
        if run is not None:
            local.copy_(pool.narrow(2, run, len(block_ids)))
        else:
            torch.index_select(pool, 2, torch.tensor(block_ids, dtype=torch.long, device=pool.device), out=local)
        if direct:
            return out
        cfg = self.model.cfg
        whole = self._in_group(kv_shards.gather, local, get_parallel_state(), cfg.num_layers, cfg.num_kv_heads)
        if out is not None and whole is not None:
            out.copy_(whole)
            return out
        return whole

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write imported KV (the handoff's layout: every layer and KV head); this rank
        keeps its part."""
        cfg = self.model.cfg
        local = kv_shards.local_part(data, get_parallel_state(), cfg.num_layers, cfg.num_kv_heads)
        local = local.to(self.device)
        run = _run_start(block_ids)  # a run of consecutive blocks: one plain copy
        if run is not None:
            self.kv_pool.narrow(2, run, len(block_ids)).copy_(local)
        else:
            self.kv_pool.index_copy_(2, torch.tensor(block_ids, dtype=torch.long, device=self.device), local)

    def _in_group(self, fn, *args):
        """``fn(*args)``; in a group a RuntimeError (a rank died or hangs) fails the group."""
        if self.group is None:
            return fn(*args)
        try:
            return fn(*args)
        except GroupFailed:
            raise
        except RuntimeError as exc:
            raise self.group.fail(exc) from exc

    def prepare(self, seqs: list[ScheduledSequence], block_copies) -> StepInputs:
        """One step's inputs; ``seqs`` decodes first (``is_chunk`` last)."""
        bs = self.config.block_size
        step = StepInputs(block_copies=[(c.src, c.dst) for c in block_copies])
        for seq in seqs:
            start, end = seq.num_computed, seq.num_computed + seq.num_new_tokens
            step.token_ids += seq.sequence.token_ids[start:end - len(seq.guesses)] + seq.guesses
            step.positions += range(start, end)
            step.slots += [seq.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            if not is_chunk(seq):
                # one decode row per token, each attending to its prefix (the step writes every row's KV before
                # attention reads it)
                step.decode_tables += [seq.block_ids] * seq.num_new_tokens
                step.decode_lens += range(start + 1, end + 1)
            else:
                step.prefills.append((len(step.token_ids) - seq.num_new_tokens, seq.num_new_tokens, start,
                                      seq.block_ids))
            # the last row samples, once per sample drawn (n for the first sample of an n > 1 request);
            # with guesses, so does each row before it from the sequence's next token on
            last = len(step.token_ids) - 1
            step.logit_rows += range(last - len(seq.guesses), last) if seq.guesses else ()
            step.logit_rows += [last] * seq.num_samples
        return step


def is_chunk(seq: ScheduledSequence) -> bool:
    """Tokens that run as a chunk of their own, after the decode rows. A few tokens after a
    context (a sequence's next token and its speculative guesses; a draft catching up; a
    prompt's tail after a prefix hit) are decode rows instead: the decode kernel reads their
    context in place, where a chunk's attention first gathers it."""
    return seq.num_new_tokens > 1 and not (seq.num_computed and seq.num_new_tokens <= MAX_DECODE_ROWS)


def max_logit_rows(config: EngineConfig) -> int:
    """The most rows a step turns into logits: one per sequence (or sample), and each guess."""
    return config.max_num_seqs * (1 + (config.num_speculative_tokens if config.speculative else 0))


def allocate_kv_pool(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                     dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every layer's KV cache, zeroed: [num_layers, 2, num_blocks, num_kv_heads, block_size *
    head_dim]; on the CPU on huge pages (decode attention reads blocks scattered over it)."""
    shape = (num_layers, 2, num_blocks, num_kv_heads, block_size * head_dim)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return zeros_on_huge_pages(shape, dtype)


def allocate_kv_caches(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """``allocate_kv_pool``, one [2, num_blocks, num_kv_heads, block_size * head_dim] view per layer."""
    return list(allocate_kv_pool(num_layers, num_blocks, num_kv_heads, block_size, head_dim, dtype, device).unbind(0))


def _run_start(block_ids: list[int]) -> int | None:
    """The first id when ``block_ids`` are consecutive and ascending, else None."""
    if block_ids and all(b - a == 1 for a, b in zip(block_ids, block_ids[1:])):
        return block_ids[0]
    return None
