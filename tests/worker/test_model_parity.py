"""Logits and greedy tokens match Hugging Face transformers on the same weights,
through the native CPU kernels and through the plain PyTorch path alike."""

import copy

import pytest
import torch

from tests.conftest import MODEL_KINDS, hf_greedy, make_engine, make_prompts
from worker import SamplingParams
from worker.kernels import has_native_kernels
from worker.layers.paged_attention import AttentionMetadata
from worker.loader import load_model
from worker.runner.model_runner import allocate_kv_caches

pytestmark = pytest.mark.isa


@pytest.fixture(params=["native", "torch"])
def backend(request, monkeypatch):
    """``KERVAN_ATTENTION_BACKEND`` for one test: the native kernels or plain PyTorch."""
    monkeypatch.setenv("KERVAN_ATTENTION_BACKEND", "auto" if request.param == "native" else "torch")
    has_native_kernels.cache_clear()
    if request.param == "native" and not has_native_kernels():
        pytest.skip("native kernels unavailable here")
    yield request.param
    has_native_kernels.cache_clear()


def prompt_logits(model_dir, prompt, block_size=4, dtype=torch.float32, quantization=None):
    return model_logits(load_model(model_dir, dtype, 512, quantization=quantization), prompt, block_size, dtype)


def model_logits(model, prompt, block_size=4, dtype=torch.float32):
    cfg = model.cfg
    n = len(prompt)
    num_blocks = -(-n // block_size)
    caches = allocate_kv_caches(cfg.num_layers, num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim,
                                dtype, torch.device("cpu"))
    meta = AttentionMetadata.build(list(range(n)), [], [], [(0, n, 0, list(range(num_blocks)))],
                                   block_size, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), torch.arange(n), caches, meta)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_prompt_logits_match_transformers(hf_models, kind, backend):
    hf, path = hf_models(kind)
    prompt = make_prompts([37])[0]
    ours = prompt_logits(path, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_greedy_tokens_match_transformers(hf_models, kind, backend):
    hf, path = hf_models(kind)
    engine = make_engine(path)
    assert engine.runner.native_kernels is (backend == "native")
    prompts = make_prompts([5, 13, 22], seed=1)
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 12)
        assert out.finish_reason == "length"


def test_logprobs_are_the_models_log_softmax(llama):
    hf, path = llama
    engine = make_engine(path)
    prompt = make_prompts([9])[0]
    [out] = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=True))
    seq = prompt + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
    expected = [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(out.token_ids)]
    assert out.logprobs == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen2_moe"])
@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_the_default_dtype_and_bf16_match_transformers_in_that_dtype(hf_models, kind, dtype):
    """``auto`` is what every command runs (bf16 on AVX-512-BF16 and AMX CPUs, float32
    elsewhere); bf16 is also checked where it is only emulated, so each machine proves both."""
    from worker.platform import current_platform, parse_dtype
    resolved = current_platform().auto_dtype("cpu") if dtype == "auto" else parse_dtype(dtype)
    hf, path = hf_models(kind)
    prompt = make_prompts([37], seed=2)[0]
    ours = prompt_logits(path, prompt, dtype=resolved).float()
    with torch.no_grad():  # a copy: the session's model stays float32 for every other test
        ref = copy.deepcopy(hf).to(resolved)(torch.tensor([prompt])).logits[0].float()
    tol = 1e-4 if resolved == torch.float32 else 0.1  # bf16 keeps 8 bits of mantissa
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_the_embedded_default_model_matches_transformers(tmp_path):
    """The model ``kervan up`` serves when given none, with its own tokenizer."""
    from transformers import AutoModelForCausalLM

    from worker.default_model import write_model
    write_model(tmp_path)
    engine = make_engine(tmp_path, block_size=16)
    [out] = engine.generate(["Once upon a time"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    prompt = engine.tokenizer.encode("Once upon a time")
    assert out.token_ids == hf_greedy(hf, prompt, 10)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prompt_logits(tmp_path, prompt, block_size=16), ref, rtol=1e-4, atol=1e-4)
