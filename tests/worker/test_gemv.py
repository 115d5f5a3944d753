"""float32 linears of up to eight rows through the gemv layout (``worker/kernels/gemv.cpp``): each
row the float64 answer to float32's precision, independent of the other rows, for strided
rows and a bias; the decoder's narrow linears get the layout beside oneDNN's, calls of at
most ``GEMV_MAX_ROWS`` rows take it, and deterministic mode's row plans never do."""

import pytest
import torch

from tests.conftest import make_prompts
from tests.worker.test_linear_packing import logits, plain_model
from worker.kernels import has_native_kernels
from worker.layers.packing import GEMV_MAX_ROWS, packed_linear
from worker.loader import load_model
from worker.platform import current_platform

pytestmark = [pytest.mark.isa, pytest.mark.skipif(not has_native_kernels(), reason="the native kernels are not built")]


@pytest.mark.parametrize("bias", [False, True])
def test_each_row_is_the_dot_product_whatever_the_other_rows(bias):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 161, generator=gen) / 8  # an odd K: the last k outside the pairs
    b = torch.randn(96, generator=gen) if bias else None
    packed = torch.ops.kervan.pack_gemv(weight)
    wide = torch.randn(8, 200, generator=gen)
    for rows in (0, 1, 2, 3, 8):
        x = wide[:rows, :161]  # strided rows
        got = torch.ops.kervan.gemv_linear(x, packed, b)
        want = x.double() @ weight.double().t() + (0 if b is None else b.double())
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        for i in range(rows):
            assert torch.equal(got[i], torch.ops.kervan.gemv_linear(x[i:i + 1], packed, b)[0])


def test_shapes_it_cannot_take_are_refused():
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.kervan.pack_gemv(torch.zeros(40, 16))
    packed = torch.ops.kervan.pack_gemv(torch.zeros(32, 16))
    with pytest.raises(RuntimeError, match="rows <= 8"):
        torch.ops.kervan.gemv_linear(torch.zeros(9, 16), packed, None)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.kervan.gemv_linear(torch.zeros(1, 8), packed, None)


def test_the_decoders_float32_linears_take_it_for_few_rows_and_give_the_same_logits(llama, monkeypatch):
    _, path = llama
    if not current_platform().can_pack(torch.float32, "cpu"):
        pytest.skip("float32 packing does not pay on this CPU")
    model = load_model(path, torch.float32, 512)
    assert all(m.gemv_weight is not None for m in model.dense_linears())  # the LM head's included
    layer = model.dense_linears()[0]
    x = torch.randn(GEMV_MAX_ROWS + 1, layer.input_size)
    small = packed_linear(x[:GEMV_MAX_ROWS], None, layer.packed_weight, None, None, None, layer.gemv_weight)
    assert torch.equal(small, torch.ops.kervan.gemv_linear(x[:GEMV_MAX_ROWS], layer.gemv_weight, None))
    onednn = packed_linear(x, None, layer.packed_weight, None, None, None, layer.gemv_weight)  # one row too many
    torch.testing.assert_close(small, onednn[:GEMV_MAX_ROWS], rtol=1e-5, atol=1e-5)
    # the copies sit side by side in step order (one arena on huge pages): each starts where the one before ends
    copies = [m.gemv_weight for m in model.dense_linears()]
    assert all(b.data_ptr() == a.data_ptr() + a.nbytes for a, b in zip(copies, copies[1:]))
    prompt = make_prompts([3])[0]  # three rows: every linear through gemv
    torch.testing.assert_close(logits(model, prompt), logits(plain_model(path, torch.float32, monkeypatch), prompt),
                               rtol=1e-5, atol=1e-5)


def test_deterministic_mode_keeps_onednn(llama):
    from tests.conftest import make_engine
    _, path = llama
    model = make_engine(path, deterministic=True).runner.model
    layer = model.layers[0].attn.qkv
    assert layer.row_plan is not None
    x = torch.randn(2, layer.input_size)
    from worker.layers.linear import _linear
    want = packed_linear(x, None, layer.packed_weight, None)  # oneDNN's arithmetic
    assert torch.equal(_linear(x, layer, None), want)
