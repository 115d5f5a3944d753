"""The fused native CPU ops agree with the PyTorch path they replace (the
reference, Hugging Face's arithmetic), op by op, in float32 and bf16."""

import pytest
import torch

from worker.kernels import has_native_kernels
from worker.layers import fused

pytestmark = [pytest.mark.isa,
              pytest.mark.skipif(not has_native_kernels(), reason="native kernels unavailable here")]

DTYPES = [torch.float32, torch.bfloat16]


def tolerance(dtype):
    # float32: summation order only; bf16: the same roundings, so at most one bf16 ulp apart
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)


def randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100, 512])  # 100: a tail past the last whole vector
def test_rms_norm(dtype, hidden):
    x, w = randn(37, hidden, dtype=dtype), randn(hidden, dtype=dtype, seed=1)
    out = torch.empty_like(x)
    torch.ops.kervan.rms_norm(out, x, w, 1e-5)
    torch.testing.assert_close(out, fused.rms_norm_torch(x, w, 1e-5), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100])
def test_add_rms_norm_updates_both_in_place(dtype, hidden):
    x, residual = randn(9, hidden, dtype=dtype), randn(9, hidden, dtype=dtype, seed=1)
    w = randn(hidden, dtype=dtype, seed=2)
    want_sum = x + residual  # one rounding to the dtype, as PyTorch does
    want = fused.rms_norm_torch(want_sum, w, 1e-6)
    torch.ops.kervan.add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(residual, want_sum)
    torch.testing.assert_close(x, want, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [96, 1536, 52])
def test_silu_and_mul(dtype, inter):
    x = randn(17, 2 * inter, dtype=dtype) * 4
    out = x.new_empty(17, inter)
    torch.ops.kervan.silu_and_mul(out, x)
    gate, up = x.float().chunk(2, dim=-1)
    # the reference in float32, rounded once: PyTorch's bf16 path rounds silu(gate) and then the
    # product, as the kernel does, and the two double roundings could land two ulps apart
    want = (torch.nn.functional.silu(gate) * up).to(dtype)
    one_ulp = dict(rtol=2 ** -7, atol=1e-6) if dtype == torch.bfloat16 else tolerance(dtype)
    torch.testing.assert_close(out, want, **one_ulp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (16, 8), (128, 128), (32, 20)])
def test_rotary_in_place_on_strided_views(dtype, head_dim, rotary_dim):
    """q and k are views into one qkv output (strided rows), as the attention layer has them."""
    n, heads, kv_heads = 11, 4, 2
    qkv = randn(n, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, :heads * head_dim].view(n, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    freqs = torch.arange(64.0)[:, None] * (1.0 / 10000 ** (torch.arange(0, rotary_dim, 2) / rotary_dim))[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    positions = torch.tensor([0, 5, 63, 1, 2, 9, 30, 31, 7, 8, 40])
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    want_q, want_k = fused._rotate(q.clone(), c, s), fused._rotate(k.clone(), c, s)
    torch.ops.kervan.rotary(q, k, cos, sin, positions)
    torch.testing.assert_close(q, want_q, **tolerance(dtype))
    torch.testing.assert_close(k, want_k, **tolerance(dtype))
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_stay_in_their_own_row(dtype):
    """IEEE semantics kept (no -ffast-math): a NaN or an Inf poisons its own row's output,
    never vanishes, never reaches another row."""
    x = randn(4, 64, dtype=dtype)
    x[1, 3], x[2, 5] = float("nan"), float("inf")
    out = torch.empty_like(x)
    torch.ops.kervan.rms_norm(out, x, torch.ones(64, dtype=dtype), 1e-5)
    assert out[1].isnan().all() and out[2].isnan().any() and torch.isfinite(out[[0, 3]]).all()
    gate_up = randn(4, 128, dtype=dtype)
    gate_up[1, 70] = float("nan")
    act = gate_up.new_empty(4, 64)
    torch.ops.kervan.silu_and_mul(act, gate_up)
    assert act[1, 6].isnan() and torch.isfinite(act[[0, 2, 3]]).all()


def test_bad_shapes_are_refused_not_crashes():
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.kervan.rms_norm(torch.empty(4, 64), x.t(), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError):
        torch.ops.kervan.silu_and_mul(torch.empty(4, 64), torch.randn(4, 63))
    q, k, table = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="position 8 is outside the rotary table of 8 positions"):
        torch.ops.kervan.rotary(q, k, table, table, torch.tensor([0, 8]))
