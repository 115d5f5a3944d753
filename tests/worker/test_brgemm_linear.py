"""Linears through oneDNN's micro-kernel (``worker/kernels/linear.cpp``): taken where
oneDNN packs the dtype for it on this CPU (bf16 with AMX; never on an ISA capped
below), each row the float64 answer rounded once and the same bits whatever the other
rows, at every row count (past a block of 128 rows too), for strided rows and a bias;
shapes it cannot block refused clearly."""

import pytest
import torch

from worker.layers.packing import PackedLinear, PackKind, brgemm_packs, packed_linear

pytestmark = [pytest.mark.isa, pytest.mark.skipif(
    not brgemm_packs(torch.bfloat16), reason="oneDNN's micro-kernel does not pack bf16 on this (capped) CPU")]


@pytest.mark.parametrize("bias", [False, True])
def test_each_row_is_the_exact_dot_product_rounded_once_whatever_the_other_rows(bias):
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(96, 160, generator=gen) / 8).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16() if bias else None
    packed = torch.ops.kervan.pack_linear(weight)
    wide = torch.randn(700, 200, generator=gen).bfloat16()
    for rows in (0, 1, 5, 64, 129, 300, 700):
        x = wide[:rows, :160]  # strided rows: a view into a wider tensor
        got = torch.ops.kervan.brgemm_linear(x, packed, b)
        want = x.double() @ weight.double().t() + (0 if b is None else b.double())
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-2)
        for i in range(0, rows, 37):
            assert torch.equal(got[i], torch.ops.kervan.brgemm_linear(x[i:i + 1], packed, b)[0])
    layout = PackedLinear(PackKind.BRGEMM, packed, 96)
    assert torch.equal(packed_linear(wide[:7, :160], None, layout, b), torch.ops.kervan.brgemm_linear(
        wide[:7, :160], packed, b))


def test_shapes_it_cannot_block_are_refused_with_what_is_wrong():
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.kervan.pack_linear(torch.zeros(40, 64, dtype=torch.bfloat16))
    packed = torch.ops.kervan.pack_linear(torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.kervan.brgemm_linear(torch.zeros(2, 32, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        torch.ops.kervan.brgemm_linear(torch.zeros(2, 64), packed, None)
