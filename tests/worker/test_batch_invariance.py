"""Batch invariance, the engine's default on the CPU: a request's greedy tokens and logprobs
are bit-identical (``==`` on the floats, never a tolerance) whatever else runs beside it,
however its prompt is chunked, and wherever its prefix KV came from: the cache, another
engine's push, or a migration's re-prefill of prompt plus generated tokens. In float32 and
bfloat16 (on an AVX2 CPU bf16 runs emulated, the same promise); ``-m isa`` runs it capped to
AVX2. ``deterministic=True`` only refuses to start where this cannot hold.

With oneDNN's layouts and SDPA for prompts (``KERVAN_WEIGHT_PACKING=onednn``) the same
comparisons differ in the logprobs' last bits (the control test below), so these tests would
fail were the invariant kernels replaced."""

import dataclasses

import pytest
import torch

from tests.conftest import make_engine, make_prompts
from worker import SamplingParams
from worker.config import ConfigError
from worker.engine.engine import ImportedKV
from worker.kernels import has_native_kernels

pytestmark = [pytest.mark.isa,
              pytest.mark.skipif(not has_native_kernels(), reason="batch invariance needs the native kernels")]

DTYPES = ["float32", "bfloat16"]
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=True)


def det_engine(path, dtype, **options):
    return make_engine(path, dtype=dtype, **options)


def answer(out):
    return out.token_ids, out.logprobs


def run_alone(path, dtype, prompt, params=PARAMS, **options):
    engine = make_engine(path, dtype=dtype, max_num_batched_tokens=512, **options)
    [out] = engine.generate([prompt], params)
    return answer(out)


def migrate(path, dtype, prompt, reference, k):
    """The request continued elsewhere after its first ``k`` tokens: prompt plus those
    tokens re-prefilled as one prompt, the remaining budget decoded."""
    tokens, logprobs = reference
    rest = dataclasses.replace(PARAMS, max_tokens=PARAMS.max_tokens - k)
    got_tokens, got_logprobs = run_alone(path, dtype, prompt + tokens[:k], rest)
    return tokens[:k] + got_tokens, logprobs[:k] + got_logprobs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_greedy_is_bit_identical_across_batches_chunks_prefix_hits_and_migration(hf_models, kind, dtype):
    _, path = hf_models(kind)
    prompt = make_prompts([37], seed=40)[0]
    reference = run_alone(path, dtype, prompt)

    # in a batch whose size changes every few steps as requests of other lengths finish
    engine = det_engine(path, dtype)
    assert engine.runner.batch_invariant  # every linear, the experts and routers included, has its kernel
    others = make_prompts([3, 29, 70, 8, 45, 1], seed=41)
    budgets = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (4, 15, 7, 30, 3, 11)]
    outs = engine.generate(others[:3] + [prompt] + others[3:], budgets[:3] + [PARAMS] + budgets[3:])
    assert answer(outs[3]) == reference

    # chunked prefill of 5 tokens a step, beside decodes
    chunked = det_engine(path, dtype, max_num_batched_tokens=5)
    outs = chunked.generate([others[2], prompt], [budgets[3], PARAMS])
    assert answer(outs[1]) == reference

    # the prompt's first blocks from the prefix cache
    cached = det_engine(path, dtype)
    cached.generate([prompt[:30] + [5, 6]], budgets[0])
    [hit] = cached.generate([prompt], PARAMS)
    assert hit.num_cached_tokens == 28 and answer(hit) == reference

    # a migration after 9 tokens, and after 1: prompt and output re-prefilled elsewhere
    for k in (9, 1):
        assert migrate(path, dtype, prompt, reference, k) == reference


@pytest.mark.parametrize("quantization,dtype", [("int4-g32", "float32"), ("int4-g32", "bfloat16"),
                                                ("fp8", "bfloat16")])
def test_quantized_weights_keep_the_bits_across_batches_and_chunks(llama, dtype, quantization):
    """One quantized kernel a weight, whose rows never mix: the same promise with low-precision
    weights (int8 activations for int4, the float kernel for FP8's codes)."""
    _, path = llama
    prompt = make_prompts([37], seed=40)[0]
    reference = run_alone(path, dtype, prompt, quantization=quantization)
    engine = det_engine(path, dtype, quantization=quantization)
    others = make_prompts([3, 29, 70, 8], seed=41)
    budgets = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (4, 15, 7, 30)]
    outs = engine.generate(others[:2] + [prompt] + others[2:], budgets[:2] + [PARAMS] + budgets[2:])
    assert answer(outs[2]) == reference
    chunked = det_engine(path, dtype, quantization=quantization, max_num_batched_tokens=5)
    assert answer(chunked.generate([others[1], prompt], [budgets[3], PARAMS])[1]) == reference


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_from_pushed_kv_is_bit_identical(llama, dtype):
    """Prefilled in chunks of 8 beside another prompt, decoded beside three other requests."""
    _, path = llama
    prompt = make_prompts([45], seed=42)[0]
    reference = run_alone(path, dtype, prompt)
    p_engine, d_engine = det_engine(path, dtype, max_num_batched_tokens=8), det_engine(path, dtype)
    p_engine.add_request(make_prompts([30], seed=44)[0], dataclasses.replace(PARAMS, max_tokens=3))
    rid = p_engine.add_request(prompt, dataclasses.replace(PARAMS, max_tokens=1), hold_kv=True)
    first = None
    while p_engine.has_unfinished_requests():
        first = next((o for o in p_engine.step() if o.request_id == rid), first)
    imported = ImportedKV(first.token_ids[0], first.logprobs[0], p_engine.export_kv(rid))
    d_engine.add_request(prompt, PARAMS, request_id="r", imported=imported)
    for n in (50, 7, 3):
        d_engine.add_request(make_prompts([n], seed=n)[0], PARAMS)
    finished = {}
    while d_engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in d_engine.step() if o.finished})
    assert answer(finished["r"]) == reference


def test_a_tensor_parallel_group_is_bit_identical_across_batches(llama):
    """Two ranks (each its own shard, partial sums all-reduced in rank order): the same
    request alone and in a batch gives the same bits."""
    _, path = llama
    prompt = make_prompts([37], seed=46)[0]
    engine = det_engine(path, "auto", tensor_parallel_size=2, max_num_batched_tokens=512)
    try:
        [alone] = engine.generate([prompt], PARAMS)
        others = make_prompts([60, 9, 3], seed=47)
        budgets = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (5, 30, 12)]
        outs = engine.generate(others[:2] + [prompt] + others[2:], budgets[:2] + [PARAMS] + budgets[2:])
        assert answer(outs[2]) == answer(alone)
    finally:
        engine.close()


def test_a_bf16_pipeline_gives_one_process_bits(llama):
    """Two pipeline stages in bf16: the last stage hands rank 0 its logits as float32 (the
    model computes them in bf16), and the request's tokens and logprobs are one process's."""
    _, path = llama
    prompt = make_prompts([37], seed=48)[0]
    reference = run_alone(path, "bfloat16", prompt)
    engine = det_engine(path, "bfloat16", pipeline_parallel_size=2, max_num_batched_tokens=512)
    try:
        others = make_prompts([21, 9], seed=49)
        outs = engine.generate([others[0], prompt, others[1]], PARAMS)
        assert answer(outs[1]) == reference
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_thread_count_does_not_change_the_bits(llama, dtype):
    """Workers of a mesh get different thread counts (``kervan up`` divides the cores)."""
    _, path = llama
    prompt = make_prompts([37], seed=45)[0]
    threads = torch.get_num_threads()
    reference = run_alone(path, dtype, prompt)
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        assert run_alone(path, dtype, prompt) == reference
    finally:
        torch.set_num_threads(threads)


def test_with_onednns_layouts_the_same_comparisons_differ(llama, monkeypatch):
    """The control: these tests can fail. With oneDNN's linears (their blocking chosen by the
    row count) and SDPA for prompts, a migration's re-prefill runs the generated tokens
    through other arithmetic than the decode steps that made them, and the logprobs move in
    their last bits (the tokens may or may not)."""
    _, path = llama
    monkeypatch.setenv("KERVAN_WEIGHT_PACKING", "onednn")
    prompt = make_prompts([37], seed=40)[0]
    reference = run_alone(path, "float32", prompt)
    moved = migrate(path, "float32", prompt, reference, 9)
    assert moved[1] != reference[1]


def test_deterministic_mode_is_refused_where_it_cannot_hold(llama, monkeypatch):
    _, path = llama
    if torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CPU"):
            make_engine(path, device="cuda", deterministic=True)
    assert make_engine(path, deterministic=True).runner.batch_invariant
    monkeypatch.setenv("KERVAN_WEIGHT_PACKING", "onednn")
    with pytest.raises(ConfigError, match="qkv"):  # names the layers without an invariant kernel
        make_engine(path, deterministic=True)
    monkeypatch.delenv("KERVAN_WEIGHT_PACKING")
    import worker.runner.model_runner as model_runner
    monkeypatch.setattr(model_runner, "has_native_kernels", lambda: False)
    with pytest.raises(ConfigError, match="native CPU kernels"):
        make_engine(path, deterministic=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_sequence_preempted_and_swapped_back_from_host_memory_is_bit_identical(llama, dtype):
    """Deterministic mode with a host tier: four long generations in a pool too small for them
    are preempted and resume from host memory; each gives the tokens and logprobs of a run in
    a pool large enough never to preempt."""
    _, path = llama
    prompts = make_prompts([20, 19, 21, 18], seed=63)
    params = dataclasses.replace(PARAMS, max_tokens=30)
    roomy = det_engine(path, dtype).generate(prompts, params)
    tight = det_engine(path, dtype, num_kv_blocks=24, kv_host_bytes=256 << 10)
    swapped = tight.generate(prompts, params)
    assert tight.stats().num_preemptions > 0 and tight.stats().num_host_promoted > 0
    assert [answer(o) for o in swapped] == [answer(o) for o in roomy]
