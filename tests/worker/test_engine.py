"""The engine end to end on tiny models of every family: batching, caching, chunking and
preemption never change greedy output; aborts and finishes return every block."""

import dataclasses

import pytest

from tests.conftest import MODEL_KINDS, hf_greedy, make_engine, make_prompts
from worker import InvalidRequest, SamplingParams
from worker.config import ConfigError

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def assert_idle(engine):
    engine.kv.pool.check_integrity()
    assert engine.kv.num_free_blocks == engine.config.num_kv_blocks
    assert not engine.kv.tables and not engine.groups and not engine.has_unfinished_requests()


def test_request_alone_equals_request_in_a_mixed_batch(llama):
    _, path = llama
    engine = make_engine(path)
    target = make_prompts([11], seed=5)[0]
    [alone] = engine.generate([target], GREEDY)
    others = make_prompts([3, 29, 17, 8, 40], seed=6)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (4, 15, 7, 12, 3)]
    batch = engine.generate(others[:2] + [target] + others[2:], params[:2] + [GREEDY] + params[2:])
    assert batch[2].token_ids == alone.token_ids
    assert_idle(engine)


def test_seeded_sample_is_the_same_alone_and_in_a_batch(llama):
    _, path = llama
    engine = make_engine(path)
    target = make_prompts([14], seed=7)[0]
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    [alone] = engine.generate([target], seeded)
    noisy = SamplingParams(max_tokens=12, temperature=1.2, ignore_eos=True)
    batch = engine.generate(make_prompts([6, 21], seed=8) + [target], [noisy, noisy, seeded])
    assert batch[2].token_ids == alone.token_ids
    # a different seed gives a different sample
    [other] = engine.generate([target], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=43,
                                                       ignore_eos=True))
    assert other.token_ids != alone.token_ids


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_prefix_cache_hit_reports_cached_tokens_and_keeps_output(hf_models, kind):
    hf, path = hf_models(kind)
    engine = make_engine(path)
    shared = make_prompts([18], seed=9)[0]
    first, second = shared + [5, 6, 7], shared + [9, 10]
    [a] = engine.generate([first], GREEDY)
    [b] = engine.generate([second], GREEDY)
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 16  # four full blocks of 4
    assert b.token_ids == hf_greedy(hf, second, 10)
    [again] = engine.generate([first], GREEDY)
    assert again.num_cached_tokens == 20 and again.token_ids == a.token_ids
    assert_idle(engine)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_chunked_prefill_keeps_output(hf_models, kind):
    hf, path = hf_models(kind)
    engine = make_engine(path, max_num_batched_tokens=7)  # a 45-token prompt takes 7 steps
    prompts = make_prompts([45, 20], seed=10)
    outs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 10)
    assert_idle(engine)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_preemption_by_recompute_keeps_output(hf_models, kind):
    hf, path = hf_models(kind)
    # 24 blocks of 4 tokens cannot hold four 20-token prompts growing by 10 tokens each
    engine = make_engine(path, num_kv_blocks=24, enable_prefix_caching=False)
    prompts = make_prompts([20, 19, 21, 18], seed=11)
    outs = engine.generate(prompts, GREEDY)
    assert engine.stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 10)
    assert_idle(engine)


def test_abort_frees_every_block_wherever_the_request_is(llama):
    _, path = llama
    engine = make_engine(path, max_num_batched_tokens=8, max_num_seqs=2)
    ids = [engine.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True, n=2 if i == 0 else 1))
           for i, p in enumerate(make_prompts([12, 30, 9], seed=12))]
    for _ in range(4):
        engine.step()
    running = {r.request_id for r in engine.scheduler.running}
    waiting = {r.request_id for r in engine.scheduler.waiting}
    assert running and waiting  # one aborted while running (forked), one mid-prefill or waiting
    for rid in ids:
        assert engine.abort(rid)
    assert not engine.abort("never-added")
    assert engine.step() == []
    assert_idle(engine)


def test_n_samples_share_the_prompt_blocks(llama):
    _, path = llama
    engine = make_engine(path)
    prompt = make_prompts([10], seed=13)[0]  # 2 full blocks + a partial one
    rid = engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=1, ignore_eos=True))
    engine.step()  # prefill + first token of each sample
    seqs = engine.groups[rid]
    assert len(seqs) == 3
    tables = [engine.kv.get_block_ids(s.seq_id) for s in seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert [b.ref_cnt for b in engine.kv.tables[rid][:2]] == [3, 3]
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    [out] = outs
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert_idle(engine)
    # the same seed gives the same three samples
    [again] = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=1, ignore_eos=True))
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_forked_samples_never_take_the_running_set_past_max_num_seqs(llama):
    """A request of n samples is admitted only with a seat for each of them: before, its
    forks joined the running set past ``max_num_seqs``."""
    _, path = llama
    engine = make_engine(path, max_num_seqs=4)
    params = SamplingParams(max_tokens=5, temperature=1.0, n=3, seed=2, ignore_eos=True)
    first, second = (engine.add_request(p, params) for p in make_prompts([6, 7], seed=14))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, len(engine.scheduler.running))
        if first in engine.groups and second in engine.groups:
            assert len(engine.groups[first]) + len(engine.groups[second]) <= 4
    assert most == 3  # 3 + 3 never ran together on 4 seats
    assert_idle(engine)


def test_stop_token_and_eos(llama):
    _, path = llama
    engine = make_engine(path)
    prompt = make_prompts([7], seed=14)[0]
    [free] = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    stop = free.token_ids[3]
    [stopped] = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop],
                                                         ignore_eos=True))
    first = free.token_ids.index(stop)
    assert stopped.token_ids == free.token_ids[:first + 1] and stopped.finish_reason == "stop"
    # the model's EOS stops unless ignore_eos: declare the same token the model's EOS
    engine.model_config = dataclasses.replace(engine.model_config, eos_token_ids=(stop,))
    [eos] = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0))
    assert eos.token_ids == stopped.token_ids and eos.finish_reason == "stop"
    assert_idle(engine)


@pytest.mark.parametrize("prompt, params, field", [
    ([], SamplingParams(), "prompt is empty"),
    ([1, 128], SamplingParams(), "outside the vocabulary"),
    ([-1, 5], SamplingParams(), "outside the vocabulary"),
    ([1] * 500, SamplingParams(max_tokens=100), "exceeds the maximum model length"),
    ([1, 2], SamplingParams(n=1000), "n must be <="),
    ([1, 2], SamplingParams(stop_token_ids=[999]), "stop_token_ids"),
])
def test_invalid_requests_fail_alone_before_scheduling(llama, prompt, params, field):
    _, path = llama
    engine = make_engine(path)
    with pytest.raises(InvalidRequest, match=field):
        engine.add_request(prompt, params)
    assert_idle(engine)


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"n": 0}, "n must"), ({"seed": -1}, "seed"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
])
def test_sampling_params_are_validated_on_construction(kwargs, field):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(**kwargs)


def test_duplicate_request_id_is_refused(llama):
    _, path = llama
    engine = make_engine(path)
    engine.add_request([3, 4, 5], request_id="x")
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request([3, 4, 5], request_id="x")
    engine.abort("x")
    assert_idle(engine)


def test_step_streams_new_tokens_incrementally(llama):
    _, path = llama
    engine = make_engine(path)
    rid = engine.add_request(make_prompts([6])[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    streamed, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.outputs[0].new_token_ids
            final = out
    assert final.finished and final.request_id == rid and streamed == final.token_ids


def test_kv_events_announce_stored_and_evicted_blocks_in_sequence(llama):
    from kervan.kv_events import BlockRemoved, BlockStored
    _, path = llama
    engine = make_engine(path, num_kv_blocks=8)
    first, second = make_prompts([17, 17], seed=15)
    # 17 prompt tokens + 4 computed outputs: the prompt's 4 full blocks, then a 5th while decoding
    engine.generate([first], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    stored = engine.take_events()
    assert [type(e) for e in stored] == [BlockStored, BlockStored]
    assert stored[0].block_hashes == engine_hashes(first, 4)[:4] and stored[0].parent_block_hash is None
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]
    engine.generate([second], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    events = engine.take_events()
    seqs = [e.seq for e in stored + events]
    assert seqs == list(range(1, len(seqs) + 1))  # one gap-free sequence per engine
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= {h for e in stored for h in e.block_hashes}
    assert engine.take_events() == []


def engine_hashes(tokens, block_size):
    from kervan.block_hash import hash_blocks
    return hash_blocks(tokens, block_size)


def test_stats_and_cached_blocks_are_the_engines_public_view(llama):
    from worker import EngineStats
    engine = make_engine(llama[1])
    assert engine.stats() == EngineStats(num_running=0, num_waiting=0, num_free_blocks=128, num_blocks=128,
                                         num_prefill_tokens=0, num_evictable_blocks=0, num_preemptions=0,
                                         num_kv_slots_allocated=0, num_kv_slots_used=0, kv_capacity_blocks=128,
                                         kv_block_bytes=2 * 2 * 2 * 4 * 16 * 4)  # layers, K/V, heads, block, dim, fp32
    prompt = make_prompts([10], seed=12)[0]
    engine.add_request(prompt, GREEDY, request_id="s")
    assert engine.stats().num_waiting == 1 and engine.stats().num_prefill_tokens == 10
    engine.step()
    stats = engine.stats()
    assert stats.num_running == 1 and stats.num_prefill_tokens == 0
    # the prompt's KV in three blocks of four slots (the third holds two, and the next token's slot)
    assert (stats.num_kv_slots_allocated, stats.num_kv_slots_used) == (12, 10)
    while engine.has_unfinished_requests():
        engine.step()
    seq, hashes = engine.cached_blocks()  # the prompt's two full blocks, then full blocks of its output
    assert hashes[:2] == engine_block_hashes(prompt) and seq >= 1
    assert engine.stats().num_evictable_blocks == len(hashes)


def engine_block_hashes(tokens):
    from kervan.block_hash import hash_blocks
    return hash_blocks(tokens, 4)


def test_max_model_len_is_the_models_limit_cut_to_what_the_kv_cache_holds(llama):
    from worker.config import ConfigError
    assert make_engine(llama[1], num_kv_blocks=128).config.max_model_len == 512  # the model's limit (128 x 4 = 512)
    assert make_engine(llama[1], num_kv_blocks=20).config.max_model_len == 80  # one sequence must always fit
    assert make_engine(llama[1], num_kv_blocks=20, max_model_len=64).config.max_model_len == 64
    with pytest.raises(ConfigError, match="does not fit the KV cache"):
        make_engine(llama[1], num_kv_blocks=20, max_model_len=100)
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings 512"):
        make_engine(llama[1], max_model_len=600)


def test_outputs_carry_the_queue_time_and_the_prompt_chunks_as_computed(llama):
    """What a worker's trace and metrics report: how long a request waited for its first
    step, and each chunk of its prompt with its step's times."""
    engine = make_engine(llama[1], max_num_batched_tokens=16)
    engine.add_request(make_prompts([35], seed=48)[0], SamplingParams(max_tokens=2, temperature=0),
                       request_id="r")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    first = outs[0]
    assert first.queue_time_s is not None and first.queue_time_s >= 0
    assert [(start, n) for start, n, _, _ in first.prefill_chunks] == [(0, 16), (16, 16), (32, 3)]
    assert all(began <= ended for _, _, began, ended in first.prefill_chunks)


@pytest.mark.parametrize("cap", [0, 4])
def test_the_prefill_cap_lets_a_new_stream_in_beside_a_long_prompt(llama, cap):
    """Without a cap a long prompt that came first takes the whole budget of 8 each step,
    and a short prompt behind it waits until it is done; with ``long_prefill_token_threshold``
    4 its chunks are 4 tokens and the short prompt is admitted, and answers, in the first
    step. Once admitted, a stream gets its token every step. Outputs are unchanged."""
    hf, path = llama
    engine = make_engine(path, max_num_batched_tokens=8, long_prefill_token_threshold=cap)
    long, short = make_prompts([40, 3], seed=52)
    engine.add_request(long, GREEDY, request_id="long")
    engine.add_request(short, GREEDY, request_id="short")
    progressed, chunks, tokens = [], {}, {"long": [], "short": []}
    while engine.has_unfinished_requests():
        outs = {out.request_id: out for out in engine.step()}
        progressed.append(set(outs))
        for rid, out in outs.items():
            tokens[rid] += out.outputs[0].new_token_ids
            chunks.setdefault(rid, out.prefill_chunks)
    assert tokens["long"] == hf_greedy(hf, long, 10) and tokens["short"] == hf_greedy(hf, short, 10)
    assert {n for _, n, _, _ in chunks["long"]} == ({4} if cap else {8})
    first = next(k for k, steps in enumerate(progressed) if "short" in steps)
    assert first == (0 if cap else 5)  # 40 tokens in chunks of 8 take steps 0-4: the short prompt comes in after
    assert all("short" in steps for steps in progressed[first:first + 10])
    with pytest.raises(ConfigError, match="long_prefill_token_threshold"):
        make_engine(path, long_prefill_token_threshold=-1)
