// float32 linears of one to eight rows (a decode step of a few sequences) streaming a blocked
// copy of the weight. oneDNN's float32 linear reads SmolLM2's weights at ~18 GB/s at one row
// on an AVX2 CPU (the step profile, capped AVX2 on the AMX Xeon, where a 1 GiB sum reads 27):
// its packed layout is tuned for many rows. Here the weight [N, K] is kept as column blocks
// of kBlock, each [K, kBlock] contiguous ([N / kBlock, K, kBlock]): a thread takes a range of
// blocks and reads each once, front to back, with every accumulator in a register.
//
// Each output is one float32 dot product over K, in k order (two interleaved partial sums
// for one row, added at the end), whatever the other rows: rows never mix. The arithmetic
// differs from oneDNN's, so deterministic mode's row plans keep oneDNN
// (``packing.packed_linear`` takes this kernel only without a row plan).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "vec.h"

namespace {

using kervan::kW;
using kervan::Vec;

constexpr int64_t kBlock = 32;     // columns per block
constexpr int64_t kMaxRows = 8;    // rows per call
constexpr int64_t kV = kBlock / kW;  // vectors per block row: 4 with AVX2, 2 with AVX-512

// weight [N, K] -> [N / kBlock, K, kBlock]
at::Tensor pack_gemv(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "weight must be float32 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kBlock == 0, "out_features must be a multiple of ", kBlock, ", not ", N);
  return weight.view({N / kBlock, kBlock, K}).transpose(1, 2).contiguous();
}

// one row against one block: two chains over k (even and odd), so each add waits on the one
// two steps back
inline void row_block(const float* x, const float* w, int64_t K, Vec* out) {
  Vec a[2][kV];
  for (auto& chain : a)
    for (auto& v : chain) v = Vec(0.f);
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) {
      const Vec xv(x[k + c]);
#pragma GCC unroll 4
      for (int64_t v = 0; v < kV; ++v) a[c][v] = at::vec::fmadd(xv, Vec::loadu(w + (k + c) * kBlock + v * kW), a[c][v]);
    }
  }
  if (k < K) {
    const Vec xv(x[k]);
#pragma GCC unroll 4
    for (int64_t v = 0; v < kV; ++v) a[0][v] = at::vec::fmadd(xv, Vec::loadu(w + k * kBlock + v * kW), a[0][v]);
  }
#pragma GCC unroll 4
  for (int64_t v = 0; v < kV; ++v) out[v] = a[0][v] + a[1][v];
}

at::Tensor gemv_linear(at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(0) <= kMaxRows, "x must be [rows <= ", kMaxRows,
              ", in_features] with dense rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kBlock && packed.size(1) == x.size(1),
              "packed weight does not match x: ", packed.sizes(), " for ", x.sizes());
  const int64_t M = x.size(0), NB = packed.size(0), K = x.size(1), N = NB * kBlock, ldx = x.stride(0);
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kFloat,
                "bias does not match the weight");
  auto out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      const float* w = wp + nb * K * kBlock;
      // a row at a time: a block is 72 KB at K 576, and rows after the first read it from L2 (two rows
      // sharing each weight load were no faster, capped to AVX2 on the AMX Xeon)
      for (int64_t m = 0; m < M; ++m) {
        Vec acc[kV];
        row_block(xp + m * ldx, w, K, acc);
        for (int64_t v = 0; v < kV; ++v) {
          Vec r = acc[v];
          if (bp != nullptr) r = r + Vec::loadu(bp + nb * kBlock + v * kW);
          r.store(op + m * N + nb * kBlock + v * kW);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kervan, m) {
  m.def("pack_gemv(Tensor weight) -> Tensor", &pack_gemv);
  m.def("gemv_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &gemv_linear);
}
