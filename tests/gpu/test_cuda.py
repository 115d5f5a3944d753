"""The CUDA path: engine parity with transformers on the GPU in bf16 and float32,
paged attention against a plain reference, and one request through a cluster
whose workers run on the GPU. Skipped without CUDA; ``tests/gpu/run.sh`` runs
these (and the engine benchmark) on a GPU machine."""

import asyncio
import copy

import pytest
import torch

from kervan.engine_args import EngineArgs
from tests.conftest import make_prompts
from worker import Engine, SamplingParams
from worker.layers.paged_attention import AttentionMetadata, paged_attention
from worker.runner.model_runner import allocate_kv_caches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cuda_engine(path, dtype):
    return Engine.from_pretrained(path, dtype=dtype, device="cuda", block_size=16, num_kv_blocks=256)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mixtral"])
def test_greedy_tokens_match_transformers_in_float32(hf_models, kind):
    hf, path = hf_models(kind)
    engine = cuda_engine(path, "float32")
    assert engine.runner.kv_caches[0].is_cuda and not engine.runner.native_kernels
    model = copy.deepcopy(hf).to("cuda")  # the session's model stays on the CPU for other tests
    prompts = make_prompts([5, 13, 40], seed=1)
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ref = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref


def test_bf16_logits_match_transformers_within_bf16_precision(hf_models):
    hf, path = hf_models("llama")
    engine = cuda_engine(path, "auto")
    assert engine.config.dtype == torch.bfloat16  # every GPU this runs on has bf16 (Ampere and later)
    prompt = make_prompts([21], seed=2)[0]
    [out] = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=True))
    model = copy.deepcopy(hf).to("cuda", torch.bfloat16)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt], device="cuda")).logits[0, -1].float(), dim=-1)
    assert out.token_ids[0] == int(ref.argmax())
    assert out.logprobs[0] == pytest.approx(ref[out.token_ids[0]].item(), abs=5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_a_plain_reference(dtype):
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block_size, num_blocks = 8, 2, 64, 16, 32
    [cache] = allocate_kv_caches(1, num_blocks, kv_heads, block_size, head_dim, dtype, torch.device("cuda"))
    cache.copy_(torch.randn(cache.shape, generator=g).to(dtype))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    lens = [1, 17, 40]
    tables = [[perm.pop() for _ in range(-(-n // block_size))] for n in lens]
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, lens)]
    q, k, v = (torch.randn(len(lens), h, head_dim, generator=g).to(dtype).cuda() for h in (heads, kv_heads, kv_heads))
    meta = AttentionMetadata.build(slots, tables, lens, [], block_size, torch.device("cuda"))
    out = paged_attention(q, k, v, cache, meta, head_dim ** -0.5).float().cpu()
    keys = cache[0].view(num_blocks, kv_heads, head_dim, block_size).float().cpu()
    values = cache[1].view(num_blocks, kv_heads, block_size, head_dim).float().cpu()
    for i, (table, n) in enumerate(zip(tables, lens)):
        ks = torch.cat([keys[b].transpose(1, 2) for b in table], dim=1)[:, :n]  # [kv_heads, n, head_dim]
        vs = torch.cat([values[b] for b in table], dim=1)[:, :n]
        qi = q[i].float().cpu().view(kv_heads, heads // kv_heads, head_dim)
        ref = torch.softmax(qi @ ks.transpose(1, 2) * head_dim ** -0.5, dim=-1) @ vs
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out[i], ref.reshape(heads, head_dim), rtol=tol, atol=tol)


def test_one_request_through_a_disaggregated_cluster_on_the_gpu(llama, tmp_path):
    from control_plane.cli.launcher import Cluster, ClusterSpec
    from tests.cluster_helpers import complete
    _, path = llama
    cluster = Cluster(ClusterSpec(path, num_prefill=1, num_decode=1, engine=EngineArgs(num_kv_blocks=256)), tmp_path)
    cluster.start(timeout=300)
    try:
        prompt = make_prompts([45], seed=40)[0]  # 2 full blocks: prefilled remotely, KV moved from GPU to GPU
        out = asyncio.run(complete(cluster, token_ids=prompt, max_tokens=8, temperature=0.0, ignore_eos=True))
    finally:
        cluster.stop()
    [alone] = cuda_engine(path, "auto").generate([prompt], SamplingParams(max_tokens=8, temperature=0,
                                                                          ignore_eos=True))
    assert out.token_ids == alone.token_ids and out.finish_reason == "length"
    for worker in ("prefill-0", "decode-0"):
        assert "cuda" in (tmp_path / f"{worker}.log").read_text()
