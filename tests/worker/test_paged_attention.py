"""The native CPU kernels agree with the plain PyTorch path, shape by shape."""

import pytest
import torch

from worker.kernels import has_native_kernels
from worker.layers.paged_attention import AttentionMetadata, paged_attention
from worker.runner.model_runner import allocate_kv_caches

pytestmark = [pytest.mark.isa, pytest.mark.skipif(not has_native_kernels(), reason="native kernels unavailable here"),
              pytest.mark.usefixtures("two_threads")]


def run(native, dtype, heads, kv_heads, head_dim, block_size, decode_lens, prefill, seed=0, num_blocks=64):
    """One step: decodes of the given lengths, plus one prefill chunk (n, context) if given."""
    g = torch.Generator().manual_seed(seed)
    [cache] = allocate_kv_caches(1, num_blocks, kv_heads, block_size, head_dim, dtype, torch.device("cpu"))
    cache.copy_(torch.randn(cache.shape, generator=g).to(dtype))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, spans = [], [], []
    for n in decode_lens:
        blocks = [perm.pop() for _ in range(-(-n // block_size))]
        tables.append(blocks)
        p = n - 1
        slots.append(blocks[p // block_size] * block_size + p % block_size)
    if prefill:
        n, ctx = prefill
        blocks = [perm.pop() for _ in range(-(-(n + ctx) // block_size))]
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + n)]
        spans.append((len(decode_lens), n, ctx, blocks))
    num_tokens = len(slots)
    # q, k and v as the attention layer has them: views into one qkv output, rows strided
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                                     kv_heads * head_dim], dim=-1))
    meta = AttentionMetadata.build(slots, tables, decode_lens, spans, block_size, torch.device("cpu"), native)
    out = paged_attention(q, k, v, cache, meta, head_dim ** -0.5)
    return out, cache


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (8, 4, 64, 16), (8, 8, 64, 16), (16, 4, 128, 16), (16, 2, 64, 16), (16, 2, 128, 16),  # specialised
    (6, 2, 32, 4), (12, 4, 16, 8), (3, 1, 8, 2), (4, 4, 64, 32)])  # any other shape
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs", [1, 5])  # few sequences: a work item per (sequence, kv head); many: per sequence
def test_native_kernels_match_torch(dtype, heads, kv_heads, head_dim, block_size, num_seqs):
    lens = [1, 5, block_size, 3 * block_size + 1, 70][-num_seqs:]
    args = (dtype, heads, kv_heads, head_dim, block_size, lens, (9, 2 * block_size + 3))
    out_native, cache_native = run(True, *args)
    out_torch, cache_torch = run(False, *args)
    assert torch.equal(cache_native, cache_torch)  # the same bytes land in the same slots
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out_native, out_torch, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[1300], [1300, 512, 513, 40, 1024]])  # one row: parts are the only parallelism
def test_rows_past_a_part_are_walked_in_parts_and_match_torch(dtype, lens):
    """Rows longer than 512 tokens run as parts of 512 (flash-decoding), combined after."""
    args = (dtype, 9, 3, 64, 16, lens, None)
    out_native, _ = run(True, *args, num_blocks=320)
    out_torch, _ = run(False, *args, num_blocks=320)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out_native, out_torch, rtol=tol, atol=tol)


def test_a_long_row_is_computed_alike_alone_and_in_a_batch():
    """Where a row's parts fall depends on its own length only: batch-invariant (deterministic mode)."""
    g = torch.Generator().manual_seed(4)
    [cache] = allocate_kv_caches(1, 300, 3, 16, 64, torch.bfloat16, torch.device("cpu"))
    cache.copy_(torch.randn(cache.shape, generator=g).to(torch.bfloat16))
    lens = torch.tensor([1100, 37, 700, 512])
    tables = torch.randperm(300, generator=g)[:4 * 69].view(4, 69)
    q = torch.randn(4, 9, 64, generator=g).to(torch.bfloat16)
    together = torch.ops.kervan.paged_decode(q, cache, tables, lens, 0.125)
    for i in range(4):
        alone = torch.ops.kervan.paged_decode(q[i:i + 1], cache, tables[i:i + 1].contiguous(), lens[i:i + 1], 0.125)
        assert torch.equal(alone[0], together[i])
