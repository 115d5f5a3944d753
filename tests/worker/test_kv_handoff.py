"""Disaggregated serving at the engine level: one engine computes the prompt and
the first token and holds its KV; another imports that KV and decodes on."""

import dataclasses

import pytest

from tests.conftest import make_engine, make_prompts
from worker import InvalidRequest, SamplingParams
from worker.engine.engine import ImportedKV


def prefill(engine, prompt, params):
    first_params = dataclasses.replace(params, max_tokens=1)
    rid = engine.add_request(prompt, first_params, hold_kv=True)
    while engine.has_unfinished_requests():
        outs = engine.step()
    [out] = outs
    return rid, out


@pytest.mark.parametrize("prompt_len", [7, 16, 23])
def test_decode_from_imported_kv_equals_one_engine(llama, prompt_len):
    _, path = llama
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, logprobs=True)
    prompt = make_prompts([prompt_len], seed=30)[0]
    [whole] = make_engine(path).generate([prompt], params)

    p_engine, d_engine = make_engine(path), make_engine(path)
    rid, first = prefill(p_engine, prompt, params)
    assert first.token_ids == whole.token_ids[:1]
    data = p_engine.export_kv(rid)
    assert tuple(data.shape) == p_engine.kv_block_shape(prompt_len)
    # while held, the prefill side keeps the prompt's blocks
    held_blocks = -(-prompt_len // 4)
    assert p_engine.kv.num_free_blocks == p_engine.config.num_kv_blocks - held_blocks
    assert p_engine.release_kv(rid) and not p_engine.release_kv(rid)
    assert p_engine.kv.num_free_blocks == p_engine.config.num_kv_blocks

    d_engine.add_request(prompt, params, request_id="r", imported=ImportedKV(first.token_ids[0], first.logprobs[0],
                                                                             data))
    streamed, final = [], None
    while d_engine.has_unfinished_requests():
        for out in d_engine.step():
            streamed += out.outputs[0].new_token_ids
            final = out
    assert final.token_ids == whole.token_ids
    assert streamed == whole.token_ids[1:]  # the first token belongs to the prefill side's stream
    assert final.logprobs == pytest.approx(whole.logprobs, abs=1e-4)
    assert d_engine.kv.num_free_blocks == d_engine.config.num_kv_blocks
    d_engine.kv.pool.check_integrity()


def test_import_reuses_local_prefix_cache(llama):
    _, path = llama
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = make_prompts([18], seed=31)[0]
    p_engine, d_engine = make_engine(path), make_engine(path)
    d_engine.generate([prompt[:16] + [5, 6, 7]], params)  # the decode side already caches 4 blocks
    rid, first = prefill(p_engine, prompt, params)
    d_engine.add_request(prompt, params, request_id="r",
                         imported=ImportedKV(first.token_ids[0], None, p_engine.export_kv(rid)))
    outs = []
    while d_engine.has_unfinished_requests():
        outs += d_engine.step()
    assert outs[-1].num_cached_tokens == 16
    assert outs[-1].token_ids == make_engine(path).generate([prompt], params)[0].token_ids


def test_abort_releases_held_kv_and_bad_imports_are_refused(llama):
    _, path = llama
    engine = make_engine(path)
    prompt = make_prompts([10], seed=32)[0]
    rid, first = prefill(engine, prompt, SamplingParams(max_tokens=3, temperature=0))
    data = engine.export_kv(rid)
    assert engine.abort(rid)
    assert engine.kv.num_free_blocks == engine.config.num_kv_blocks
    with pytest.raises(KeyError):
        engine.export_kv(rid)
    with pytest.raises(InvalidRequest, match="imported KV"):
        engine.add_request(prompt + [1, 1, 1], SamplingParams(), imported=ImportedKV(5, None, data))
    with pytest.raises(InvalidRequest, match="n > 1"):
        engine.add_request(prompt, SamplingParams(n=2), imported=ImportedKV(5, None, data))


def test_prefill_queue_counts_uncomputed_prompt_tokens_but_not_imports(llama):
    _, path = llama
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    prompt = make_prompts([10], seed=32)[0]
    p_engine = make_engine(path)
    rid, first = prefill(p_engine, prompt, params)
    data = p_engine.export_kv(rid)
    engine = make_engine(path, max_num_batched_tokens=8)
    engine.add_request(make_prompts([20], seed=33)[0], params)
    engine.add_request(prompt, params, imported=ImportedKV(first.token_ids[0], None, data))
    assert engine.scheduler.num_prefill_tokens == 20
    engine.step()  # a chunk of 8
    assert engine.scheduler.num_prefill_tokens == 12
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_prefill_tokens == 0
