"""A prompt's tokens as rows of the native decode kernel: runs of consecutive tokens take the
tiled path (``worker/kernels/prompt_runs.h``) and every row keeps the bits it has alone."""

import pytest
import torch

from worker.kernels import has_native_kernels
from worker.runner.model_runner import allocate_kv_caches

pytestmark = [pytest.mark.isa, pytest.mark.skipif(not has_native_kernels(), reason="native kernels unavailable here"),
              pytest.mark.usefixtures("two_threads")]


def prompt_rows(dtype, heads, kv_heads, head_dim, block_size, runs, seed=0):
    """q, cache, tables and lens for prompt chunks given as (context, tokens): each token a row
    attending to its prefix through its chunk's table, as the engine's per-token metadata has them."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-(ctx + n) // block_size) for ctx, n in runs]
    num_blocks = sum(widths) + 1
    [cache] = allocate_kv_caches(1, num_blocks, kv_heads, block_size, head_dim, dtype, torch.device("cpu"))
    cache.copy_(torch.randn(cache.shape, generator=g).to(dtype))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, lens = [], []
    for (ctx, n), width in zip(runs, widths):
        blocks = [perm.pop() for _ in range(width)] + [0] * (max(widths) - width)
        tables += [blocks] * n
        lens += range(ctx + 1, ctx + n + 1)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    return q, cache, torch.tensor(tables), torch.tensor(lens)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 8, 64), (8, 4, 64), (9, 3, 64), (32, 8, 64),
                                                       (16, 2, 64), (8, 8, 128), (16, 4, 128), (16, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_rows_keep_their_bits_alone(dtype, heads, kv_heads, head_dim):
    """Runs long and short, odd lengths, cached contexts, rows past a 512-token part (runs of them
    walk their parts in one item) and past two: each row of the whole call equals the same row
    computed alone (the decode path's arithmetic, its parts combined after)."""
    q, cache, tables, lens = prompt_rows(dtype, heads, kv_heads, head_dim, 16,
                                         [(0, 37), (5, 3), (500, 30), (0, 1), (13, 21), (1010, 40)])
    together = torch.ops.kervan.paged_decode(q, cache, tables, lens, head_dim ** -0.5)
    for i in range(len(lens)):
        alone = torch.ops.kervan.paged_decode(q[i:i + 1], cache, tables[i:i + 1], lens[i:i + 1], head_dim ** -0.5)
        assert torch.equal(alone[0], together[i]), f"row {i} (length {lens[i]}) differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_rows_match_a_float64_reference(dtype):
    """The tiled path against causal attention in float64 (the alone-equality above cannot catch
    an error both paths share)."""
    heads, kv_heads, head_dim, bs = 32, 8, 64, 16
    q, cache, tables, lens = prompt_rows(dtype, heads, kv_heads, head_dim, bs, [(7, 40)])
    out = torch.ops.kervan.paged_decode(q, cache, tables, lens, head_dim ** -0.5)
    blocks = cache[:, tables[0]].double()  # [2, blocks, kv_heads, bs * head_dim]
    keys = blocks[0].view(-1, kv_heads, head_dim, bs).permute(0, 3, 1, 2).reshape(-1, kv_heads, head_dim)
    values = blocks[1].view(-1, kv_heads, bs, head_dim).transpose(1, 2).reshape(-1, kv_heads, head_dim)
    group = heads // kv_heads
    for i, n in enumerate(lens.tolist()):
        k, v = (t[:n].repeat_interleave(group, 1) for t in (keys, values))  # [n, heads, head_dim]
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double() * head_dim ** -0.5, k), -1)
        ref = torch.einsum("hn,nhd->hd", p, v)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i].double(), ref, rtol=tol, atol=tol)
