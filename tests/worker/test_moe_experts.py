"""A MoE layer's routed experts in one native call (``worker/kernels/moe_experts.h``): every
token gets the bits the per-expert path gives it (each expert's linears one call at a time,
summed with ``index_add_`` in slot order) and a plain PyTorch float64 answer to the dtype's
precision, at odd shapes: one-token experts, empty experts, pairs of another rank's experts,
widths that are no whole number of blocks, many rows (row panels and k chunks), and no rows.
Each layout that serves experts is checked: the invariant kernel's, brgemm's (where oneDNN
packs it: AMX) and the int8-activation kernel's (where the CPU has AVX2)."""

import pytest
import torch
import torch.nn.functional as F

from worker.kernels import has_native_kernels
from worker.layers.fused import silu_and_mul
from worker.layers.packing import PackKind, brgemm_packs, pack_as, packed_linear

pytestmark = [pytest.mark.isa, pytest.mark.skipif(not has_native_kernels(), reason="the native kernels are not built")]


def routing(tokens: int, experts: int, top_k: int, seed: int, skewed: bool = False):
    """ids [tokens, top_k] (distinct per token) and weights; skewed: every token's first choice
    is expert 0 and the last expert is never chosen (an empty expert)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen)
    if skewed:
        scores[:, 0] = 2.0
        scores[:, -1] = -1.0
    weights, ids = scores.topk(top_k, dim=-1)
    return ids, weights.softmax(dim=-1)


def expert_weights(experts, hidden, inter, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    return w13, w2


def per_expert(x, ids, weights, linear13, linear2):
    """SparseMoe's PyTorch path: each expert's rows through its linears, summed per expert in x's dtype."""
    out = torch.zeros_like(x)
    flat = ids.flatten()
    for e in flat.unique().tolist():
        sel = (flat == e).nonzero().flatten()
        tokens = sel // ids.shape[1]
        y = linear2(e, silu_and_mul(linear13(e, x[tokens])))
        out.index_add_(0, tokens, y * weights.flatten()[sel, None].to(y.dtype))
    return out


def reference(x, ids, weights, w13, w2):
    """float64, no rounding between steps"""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    out = torch.zeros_like(x)
    for t in range(len(x)):
        for k, e in enumerate(ids[t].tolist()):
            gate, up = (x[t] @ w13[e].t()).chunk(2)
            out[t] += weights[t, k].double() * ((F.silu(gate) * up) @ w2[e].t())
    return out


def flat_args(x, ids, weights, num_local=None, offset=0):
    tokens = torch.arange(len(x)).repeat_interleave(ids.shape[1])
    slots = ids.flatten() - offset
    if num_local is not None:  # another rank's experts get the slot past the last
        slots = torch.where((slots >= 0) & (slots < num_local), slots, torch.full_like(slots, num_local))
    return tokens, slots, weights.flatten().float()


def packed_kinds():
    kinds = [(PackKind.INVARIANT, torch.float32), (PackKind.INVARIANT, torch.bfloat16)]
    if brgemm_packs(torch.bfloat16):
        kinds.append((PackKind.BRGEMM, torch.bfloat16))
    return kinds


def fused_op(kind):
    return (torch.ops.kervan.moe_experts_brgemm if kind == PackKind.BRGEMM
            else torch.ops.kervan.moe_experts_invariant)


SHAPES = [  # (tokens, experts, top_k, hidden, inter)
    (1, 4, 2, 64, 32),      # batch 1
    (3, 8, 2, 96, 48),      # one-token experts
    (16, 6, 3, 128, 96),
    (150, 5, 2, 64, 64),    # many rows an expert: row panels
    (0, 4, 2, 64, 32),      # no tokens
]


@pytest.mark.parametrize("kind,dtype", packed_kinds())
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_experts_give_every_token_the_per_expert_bits(kind, dtype, shape):
    tokens, experts, top_k, hidden, inter = shape
    w13, w2 = expert_weights(experts, hidden, inter, dtype, seed=1)
    packs = [(pack_as(kind, w13[e]), pack_as(kind, w2[e])) for e in range(experts)]
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    for skewed in (False, True):
        ids, weights = routing(tokens, experts, top_k, seed=3, skewed=skewed)
        got = fused_op(kind)(x, *flat_args(x, ids, weights), [a.data for a, _ in packs],
                             [b.data for _, b in packs], inter)
        want = per_expert(x, ids, weights, lambda e, v: packed_linear(v, None, packs[e][0], None),
                          lambda e, v: packed_linear(v, None, packs[e][1], None))
        assert torch.equal(got, want), (skewed, (got.float() - want.float()).abs().max())
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.double(), reference(x, ids, weights, w13, w2), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("hidden,inter", [(80, 40), (33, 70)])  # no whole number of 32-column blocks
def test_invariant_experts_take_widths_of_partial_blocks(hidden, inter):
    w13, w2 = expert_weights(5, hidden, inter, torch.float32, seed=4)
    packs = [(pack_as(PackKind.INVARIANT, w13[e]), pack_as(PackKind.INVARIANT, w2[e])) for e in range(5)]
    x = torch.randn(9, hidden, generator=torch.Generator().manual_seed(5))
    ids, weights = routing(9, 5, 2, seed=6)
    got = torch.ops.kervan.moe_experts_invariant(x, *flat_args(x, ids, weights), [a.data for a, _ in packs],
                                                 [b.data for _, b in packs], inter)
    torch.testing.assert_close(got.double(), reference(x, ids, weights, w13, w2), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,dtype", packed_kinds())
def test_pairs_of_another_ranks_experts_are_skipped_and_unweighted_calls_give_each_pair(kind, dtype):
    experts, local, hidden, inter = 8, 3, 64, 32
    w13, w2 = expert_weights(experts, hidden, inter, dtype, seed=7)
    offset = 2  # this rank holds experts 2, 3, 4
    packs = [(pack_as(kind, w13[e]), pack_as(kind, w2[e])) for e in range(offset, offset + local)]
    x = torch.randn(10, hidden, generator=torch.Generator().manual_seed(8)).to(dtype)
    ids, weights = routing(10, experts, 2, seed=9)
    tokens, slots, flat_weights = flat_args(x, ids, weights, num_local=local, offset=offset)
    args = ([a.data for a, _ in packs], [b.data for _, b in packs], inter)
    summed = fused_op(kind)(x, tokens, slots, flat_weights, *args)
    mine = ((ids >= offset) & (ids < offset + local)).float()
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(summed.double(), reference(x, ids, weights * mine, w13, w2), rtol=tolerance,
                               atol=tolerance)
    pairs = fused_op(kind)(x, tokens, slots, None, *args)  # [pairs, hidden]: the expert-parallel path's
    assert pairs.shape == (len(tokens), hidden)
    for p in range(len(tokens)):
        if slots[p] == local:
            assert not pairs[p].any()
        else:
            e = int(ids.flatten()[p])
            h = x[tokens[p]].double() @ w13[e].double().t()
            want = (F.silu(h[:inter]) * h[inter:]) @ w2[e].double().t()
            torch.testing.assert_close(pairs[p].double(), want, rtol=tolerance, atol=tolerance)


def test_bad_routing_is_refused_with_a_message():
    w13, w2 = expert_weights(2, 64, 32, torch.float32, seed=10)
    packs = [(pack_as(PackKind.INVARIANT, w13[e]), pack_as(PackKind.INVARIANT, w2[e])) for e in range(2)]
    args = ([a.data for a, _ in packs], [b.data for _, b in packs], 32)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="names row 5"):
        torch.ops.kervan.moe_experts_invariant(x, torch.tensor([0, 5]), torch.tensor([0, 1]), None, *args)
    with pytest.raises(RuntimeError, match="not packed from"):
        torch.ops.kervan.moe_experts_invariant(x, torch.tensor([0, 1]), torch.tensor([0, 1]), None,
                                               args[0], args[1], 48)


int8_kernel = pytest.mark.skipif(not torch.ops.kervan.int8_instructions(), reason="the int8 dot needs AVX2")


@int8_kernel
@pytest.mark.parametrize("method,terms", [("int4", 2), ("int4", 1), ("int8", 2)])
@pytest.mark.parametrize("shape", [(1, 4, 2, 128, 128), (5, 8, 3, 256, 128), (70, 4, 2, 128, 128), (0, 4, 2, 128, 128)])
def test_int8_activation_experts_give_every_token_the_per_expert_bits(method, terms, shape):
    """Quantized experts through the int8-activation kernel (AMX tiles for an expert's 32+ rows
    where the CPU has them), against each expert's ``quant_linear`` calls."""
    from worker.quant.kernel_choice import with_int8
    from worker.quant.matmul import quant_linear
    from worker.quant.method import get_method

    tokens, experts, top_k, hidden, inter = shape
    w13, w2 = expert_weights(experts, hidden, inter, torch.float32, seed=11)
    quantize = get_method(method).quantize
    quants = [(with_int8(quantize(w13[e]), terms), with_int8(quantize(w2[e]), terms)) for e in range(experts)]
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    ids, weights = routing(tokens, experts, top_k, seed=13, skewed=True)

    def layout(w):
        return [w.group, int(w.int8.four_bit), int(w.int8.signed_codes), int(w.int8.half_params), w.int8.terms]
    got = torch.ops.kervan.moe_experts_i8(x, *flat_args(x, ids, weights), [a.int8.data for a, _ in quants],
                                          [b.int8.data for _, b in quants], inter, layout(quants[0][0]),
                                          layout(quants[0][1]))
    want = per_expert(x, ids, weights, lambda e, v: quant_linear(v, quants[e][0]),
                      lambda e, v: quant_linear(v, quants[e][1]))
    assert torch.equal(got, want)
    dequantized = (torch.stack([a.reference_dequantize(torch.float32) for a, _ in quants]),
                   torch.stack([b.reference_dequantize(torch.float32) for _, b in quants]))
    torch.testing.assert_close(got.double(), reference(x, ids, weights, *dequantized), rtol=5e-2, atol=5e-2)
