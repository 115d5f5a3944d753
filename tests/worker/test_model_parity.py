"""Logits and greedy tokens match Hugging Face transformers on the same weights,
through the native CPU kernels and through the plain PyTorch path alike."""

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


def prompt_logits(model_dir, prompt, block_size=4):
    model = load_model(model_dir, torch.float32, 512)
    cfg = model.cfg
    n = len(prompt)
    num_blocks = -(-n // block_size)
    caches = allocate_kv_caches(cfg.num_layers, num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim,
                                torch.float32, torch.device("cpu"))
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
