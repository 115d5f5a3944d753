"""Linears through oneDNN's micro-kernel (``worker/kernels/linear.cpp``): taken where
oneDNN packs the dtype for it on this CPU (bf16 with AMX; never on an ISA capped
below), each row the float64 answer rounded once and independent of the other rows,
for every row count, strided rows and a bias; shapes it cannot block refused clearly;
the decoder's linears in its layout beside oneDNN's (small calls take it, long prompt
chunks oneDNN's), the LM head in oneDNN's only, and no second copy for a large model."""

import logging

import pytest
import torch

from tests.conftest import make_prompts
from tests.worker.test_linear_packing import logits, plain_model
from worker.layers import packing
from worker.layers.packing import BRGEMM_MAX_ROWS, brgemm_packs, packed_linear
from worker.loader import load_model
from worker.platform import current_platform

pytestmark = pytest.mark.isa
needs_brgemm = pytest.mark.skipif(not brgemm_packs(torch.bfloat16),
                                  reason="oneDNN's micro-kernel does not pack bf16 on this (capped) CPU")


@needs_brgemm
@pytest.mark.parametrize("bias", [False, True])
def test_each_row_is_the_exact_dot_product_rounded_once_whatever_the_other_rows(bias):
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(96, 160, generator=gen) / 8).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16() if bias else None
    packed = torch.ops.kervan.pack_linear(weight)
    wide = torch.randn(300, 200, generator=gen).bfloat16()
    for rows in (0, 1, 5, 64, 129, 300):
        x = wide[:rows, :160]  # strided rows: a view into a wider tensor
        got = torch.ops.kervan.brgemm_linear(x, packed, b)
        want = x.double() @ weight.double().t() + (0 if b is None else b.double())
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-2)
        for i in range(0, rows, 37):
            assert torch.equal(got[i], torch.ops.kervan.brgemm_linear(x[i:i + 1], packed, b)[0])
    assert torch.equal(packed_linear(wide[:7, :160], None, None, b, None, packed), torch.ops.kervan.brgemm_linear(
        wide[:7, :160], packed, b))  # a small call with a brgemm layout routes here


@needs_brgemm
def test_shapes_it_cannot_block_are_refused_with_what_is_wrong():
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.kervan.pack_linear(torch.zeros(40, 64, dtype=torch.bfloat16))
    packed = torch.ops.kervan.pack_linear(torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.kervan.brgemm_linear(torch.zeros(2, 32, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        torch.ops.kervan.brgemm_linear(torch.zeros(2, 64), packed, None)


def test_small_calls_take_the_brgemm_layout_where_it_packs_and_long_ones_onednns(llama, monkeypatch):
    _, path = llama
    if not current_platform().can_pack(torch.bfloat16, "cpu"):
        pytest.skip("bf16 weights are not packed on this (capped) CPU")
    model = load_model(path, torch.bfloat16, 512)
    layers = [m for m in model.dense_linears() if m is not model.lm_head]
    assert {m.packed_weight.dim() for m in model.dense_linears()} == {2}  # oneDNN's, for every call size
    if brgemm_packs(torch.bfloat16):
        assert all(m.brgemm_weight.dim() == 3 for m in layers) and model.lm_head.brgemm_weight is None
    else:
        assert all(m.brgemm_weight is None for m in layers)
    layer = layers[0]
    for rows in (1, BRGEMM_MAX_ROWS, BRGEMM_MAX_ROWS + 1):
        x = torch.randn(rows, layer.input_size).bfloat16()
        small = rows <= BRGEMM_MAX_ROWS and layer.brgemm_weight is not None
        want = (torch.ops.kervan.brgemm_linear(x, layer.brgemm_weight, None) if small else
                torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, None, "none", [], ""))
        assert torch.equal(layer(x), want)
    prompt = make_prompts([19])[0]
    plain = logits(plain_model(path, torch.bfloat16, monkeypatch), prompt)
    torch.testing.assert_close(logits(model, prompt).float(), plain.float(), rtol=2e-2, atol=2e-2)
    monkeypatch.setenv("KERVAN_WEIGHT_PACKING", "onednn")
    onednn = load_model(path, torch.bfloat16, 512)
    assert all(m.brgemm_weight is None for m in onednn.dense_linears())
    assert torch.equal(logits(onednn, prompt), plain)  # oneDNN's packed bf16 linear is the plain one, bit for bit
    monkeypatch.setattr(packing, "BRGEMM_BUDGET_BYTES", 0)  # a model too large for the second copy
    monkeypatch.setenv("KERVAN_WEIGHT_PACKING", "auto")
    assert all(m.brgemm_weight is None for m in load_model(path, torch.bfloat16, 512).dense_linears())


@needs_brgemm
def test_a_brgemm_layout_that_fails_its_check_leaves_oneDNNs_with_one_warning(llama, monkeypatch, caplog):
    _, path = llama
    check = packing._check

    def refuse_brgemm(weight, packed):
        if packed.dim() == 3:
            raise RuntimeError("packed and plain results differ")
        check(weight, packed)
    monkeypatch.setattr(packing, "_check", refuse_brgemm)
    with caplog.at_level(logging.WARNING, logger="worker.layers.packing"):
        model = load_model(path, torch.bfloat16, 512)
    [record] = caplog.records
    assert "micro-kernel cannot pack" in record.message and "results differ" in record.message
    assert all(m.brgemm_weight is None and m.packed_weight is not None for m in model.dense_linears())


@needs_brgemm
def test_deterministic_plans_keep_a_brgemm_layer_on_brgemm(llama):
    """A plan's calls past BRGEMM_MAX_ROWS would take oneDNN's linear, whose rows agree with
    brgemm's only as far as a probe can tell: a re-prefill of a long migrated request once
    came out different. The plan stops at BRGEMM_MAX_ROWS instead."""
    _, path = llama
    model = load_model(path, torch.bfloat16, 512)
    model.make_batch_invariant(2048, 64)
    layers = [m for m in model.dense_linears() if m.brgemm_weight is not None]
    assert layers and all(max(m.row_plan.sizes) <= BRGEMM_MAX_ROWS for m in layers)
