"""DeepSeek-V2/V3's multi-head latent attention (``worker/layers/mla.py``): transformers'
logits at several shapes (queries through q_proj or a low-rank projection, rotary pairs
interleaved or not, YaRN's long-context rotary, grouped and plain routing), one latent per token in the KV pool (the
engine's block shape says so), the latent handed from a prefill engine to a decode engine
gives one engine's tokens, and ``--deterministic`` refuses these models with a reason.
(The families' default tiny configs also run every test over ``MODEL_KINDS``: parity, the
engine, the host tier, tensor, expert and pipeline parallel groups, the plan's counts.)"""

import dataclasses

import pytest
import torch

from tests.conftest import TINY, hf_greedy, make_engine, make_prompts
from worker import SamplingParams
from worker.config import ConfigError
from worker.engine.engine import ImportedKV

from .test_kv_handoff import prefill
from .test_model_parity import prompt_logits


def deepseek(version: int, **overrides):
    import transformers
    cfg = dict(TINY, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
               moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=1.5)
    cfg.update(overrides)
    config = getattr(transformers, f"DeepseekV{version}Config")(**cfg)
    torch.manual_seed(5)
    return getattr(transformers, f"DeepseekV{version}ForCausalLM")(config).eval()


SHAPES = {
    "v2-plain-routing": (2, dict(q_lora_rank=None, topk_method="greedy")),
    "v2-low-rank-queries": (2, dict(q_lora_rank=40, topk_method="group_limited_greedy", n_group=4, topk_group=2)),
    "v3-rope-in-halves": (3, dict(q_lora_rank=24, rope_interleave=False, n_group=2, topk_group=1)),
    # DeepSeek-V3's long-context rotary: YaRN frequencies, cos/sin and the softmax scale by its mscales
    "v3-yarn": (3, dict(q_lora_rank=24, n_group=2, topk_group=1, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})),
    "v3-wide-latent": (3, dict(q_lora_rank=None, kv_lora_rank=64, qk_rope_head_dim=16, v_head_dim=24,
                               num_attention_heads=8, num_key_value_heads=8, n_group=1, topk_group=1)),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def shaped(request, tmp_path_factory):
    version, overrides = SHAPES[request.param]
    hf = deepseek(version, **overrides)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, path


def test_logits_and_greedy_tokens_match_transformers(shaped):
    hf, path = shaped
    prompt = make_prompts([33], seed=4)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(prompt_logits(path, prompt), ref, rtol=1e-4, atol=1e-4)
    engine = make_engine(path)
    prompts = make_prompts([5, 19], seed=6)
    for p, out in zip(prompts, engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0,
                                                                           ignore_eos=True))):
        assert out.token_ids == hf_greedy(hf, p, 8)


def test_the_pool_holds_one_latent_a_token(shaped):
    hf, path = shaped
    cfg = hf.config
    engine = make_engine(path)
    shape = engine.kv_block_shape(16)  # 16 tokens' KV, every layer
    assert torch.Size(shape).numel() == 16 * cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    engine.close()


def test_the_latent_handed_to_a_decode_engine_gives_one_engines_tokens(shaped):
    _, path = shaped
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, logprobs=True)
    prompt = make_prompts([21], seed=8)[0]
    [whole] = make_engine(path).generate([prompt], params)
    p_engine, d_engine = make_engine(path), make_engine(path)
    rid, first = prefill(p_engine, prompt, params)
    data = p_engine.export_kv(rid)
    d_engine.add_request(prompt, params, request_id="r",
                         imported=ImportedKV(first.token_ids[0], first.logprobs[0], data))
    final = None
    while d_engine.has_unfinished_requests():
        for out in d_engine.step():
            final = out
    assert final.token_ids == whole.token_ids
    assert final.logprobs == pytest.approx(whole.logprobs, abs=1e-4)


def test_deterministic_mode_refuses_latent_attention(shaped):
    _, path = shaped
    with pytest.raises(ConfigError, match="latent attention"):
        make_engine(path, deterministic=True)


def test_an_odd_latent_is_refused(tmp_path):
    hf = deepseek(3, kv_lora_rank=33, q_lora_rank=None, n_group=1, topk_group=1)
    hf.config.save_pretrained(tmp_path)
    from worker.config import ModelConfig
    with pytest.raises(ConfigError, match="must be even"):
        ModelConfig.from_dir(tmp_path)


def test_chunked_prompts_and_cached_prefixes_answer_alike(shaped):
    _, path = shaped
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = make_prompts([30], seed=9)[0]
    [cold] = make_engine(path).generate([prompt], params)
    engine = make_engine(path, max_num_batched_tokens=8)  # the prompt in chunks of 8
    [chunked] = engine.generate([prompt], params)
    [cached] = engine.generate([prompt[:24] + prompt[24:]], dataclasses.replace(params))  # its prefix cached
    assert chunked.token_ids == cold.token_ids == cached.token_ids
