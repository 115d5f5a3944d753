"""Float linears through the invariant layout (``worker/kernels/invariant_linear.cpp``): each
output element one float32 FMA chain in k order, so a row's bits are the same at every row
count and position, on one thread or two, on AVX2 and AVX-512 alike; the float64 answer to
float32's precision; any out_features (padded blocks), strided rows, a bias, float32, bf16
and fp16."""

import os
import subprocess
import sys

import pytest
import torch

from worker.kernels import has_native_kernels

pytestmark = [pytest.mark.isa, pytest.mark.skipif(not has_native_kernels(), reason="the native kernels are not built")]

ROWS = (1, 2, 3, 7, 8, 12, 13, 37, 130, 600)  # decode rows, whole and partial tiles, row panels


def linear(x, packed, out_features, bias=None):
    return torch.ops.kervan.invariant_linear(x, packed, out_features, bias)


@pytest.mark.parametrize("out_features,in_features", [(96, 161), (70, 48), (33, 1100)])  # K past one chunk
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_row_has_the_same_bits_at_every_row_count_and_position(dtype, out_features, in_features):
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(out_features, in_features, generator=gen) / 8).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    packed = torch.ops.kervan.pack_invariant(weight)
    row = torch.randn(1, in_features, generator=gen).to(dtype)
    want = linear(row, packed, out_features, bias)[0]
    exact = row.double() @ weight.double().t() + bias.double()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(want.double(), exact[0], rtol=tolerance, atol=tolerance)
    for rows in ROWS:
        wide = torch.randn(rows, in_features + 9, generator=gen).to(dtype)
        x = wide[:, :in_features]  # strided rows: a view into a wider tensor
        for pos in {0, rows // 2, rows - 1}:
            x[pos] = row[0]
            assert torch.equal(linear(x, packed, out_features, bias)[pos], want), (rows, pos)


def test_the_thread_count_does_not_change_the_bits():
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(320, 700, generator=gen)
    packed = torch.ops.kervan.pack_invariant(weight)
    x = torch.randn(50, 700, generator=gen)
    threads = torch.get_num_threads()
    want = linear(x, packed, 320)
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        assert torch.equal(linear(x, packed, 320), want)
    finally:
        torch.set_num_threads(threads)


SCRIPT = """
import sys, torch
from worker.kernels import has_native_kernels
assert has_native_kernels()
gen = torch.Generator().manual_seed(5)
weight = torch.randn(100, 600, generator=gen)
x = torch.randn(20, 600, generator=gen)
out = torch.ops.kervan.invariant_linear(x, torch.ops.kervan.pack_invariant(weight), 100, None)
sys.stdout.write(out.numpy().tobytes().hex())
"""


def test_avx2_and_avx512_builds_give_the_same_bits():
    """FMA rounds once, and a vector lane is an output column, never a part of a sum: the
    chain is the same at any vector width (a worker on AVX2 and one on AVX-512 agree)."""
    from worker.platform import current_platform
    if current_platform().cpu.isa != "avx512":
        pytest.skip("this CPU has no AVX-512 build to compare with the AVX2 one")
    bits = {}
    for isa in ("avx512", "avx2"):
        env = dict(os.environ, ATEN_CPU_CAPABILITY=isa)
        done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        bits[isa] = done.stdout
    assert bits["avx512"] == bits["avx2"]


def test_what_it_cannot_take_is_refused_with_what_is_wrong():
    packed = torch.ops.kervan.pack_invariant(torch.zeros(40, 16))
    assert packed.shape == (2, 16, 32)  # 40 features padded to two blocks of 32
    with pytest.raises(RuntimeError, match="does not match"):
        linear(torch.zeros(1, 8), packed, 40)
    with pytest.raises(RuntimeError, match="out_features 70"):
        linear(torch.zeros(1, 16), packed, 70)
    with pytest.raises(RuntimeError, match="bias"):
        linear(torch.zeros(1, 16), packed, 40, torch.zeros(41))
    assert linear(torch.zeros(0, 16), packed, 40).shape == (0, 40)
