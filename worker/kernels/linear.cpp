// Linear layers through oneDNN's batch-reduce GEMM micro-kernel (brgemm), as PyTorch
// exposes it (at::native::cpublas, the micro-kernel of inductor's CPU GEMM template):
// AMX tiles on CPUs that have them, where oneDNN's micro-kernel API packs the dtype.
//
// Why not oneDNN's linear (``mkldnn::_linear_pointwise``)? Each of its calls costs
// ~20 us before any arithmetic (descriptors, primitive-cache lookup, scratchpad; ~4 us
// here), and a decode step of a deep, narrow model is hundreds of small calls
// (``benchmarks/linear_kernels.py`` times SmolLM2-135M's 120 at each row count). Here a
// call is one parallel region over column blocks; the micro-kernel is created once per
// shape and reused. oneDNN's linear stays faster on long prompt chunks, which keep it
// (``worker/layers/packing.py``).
//
// The weight [N, K] is packed once at load: column blocks of kBlockN, each [K, kBlockN]
// in the micro-kernel's layout (bf16: pairs of K interleaved, "VNNI"), stored as
// [N / kBlockN, K / 2, 2 * kBlockN]. A thread takes a range of column blocks and, for
// each block of up to kBlockM rows, multiplies it by every block of its range: a
// decode step's few rows read each weight byte once, from one contiguous run.
//
// Each output element is one dot product over K in the micro-kernel's fixed order,
// accumulated in float32 and rounded once, whatever the other rows: the deterministic
// mode's probe (``batch_invariant.py``) finds every call size row-invariant.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "moe_experts.h"
#include "vec.h"

namespace {

using kervan::kW;
using kervan::load_floats;
using kervan::store_floats;
using kervan::Vec;

constexpr int64_t kBlockN = 32;   // columns per packed block (the micro-kernel packs 32 at most for bf16)
constexpr int64_t kBlockM = 128;  // rows per micro-kernel call: more rows per weight byte in cache

bool brgemm_packs(at::ScalarType dtype) { return at::native::cpublas::could_pack(dtype); }

// weight [N, K] -> [N / kBlockN, K / 2, 2 * kBlockN]
at::Tensor pack_linear(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be [out_features, in_features]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kBlockN == 0 && K % 2 == 0, "brgemm packing needs out_features a multiple of ", kBlockN,
              " and even in_features, not [", N, ", ", K, "]");
  TORCH_CHECK(brgemm_packs(weight.scalar_type()), "oneDNN's micro-kernel does not pack ", weight.scalar_type(),
              " on this CPU");
  auto out = at::empty({N / kBlockN, K / 2, 2 * kBlockN}, weight.options());
  for (int64_t nb = 0; nb < N / kBlockN; ++nb) {
    const at::Tensor block = weight.narrow(0, nb * kBlockN, kBlockN).t().contiguous();  // [K, kBlockN]
    at::native::cpublas::pack(K, kBlockN, kBlockN, kBlockN, weight.scalar_type(), weight.scalar_type(),
                              block.data_ptr(), out[nb].data_ptr());
  }
  return out;
}

// Column blocks [nb0, nb1) of x [M, K] (row stride lda) times the packed weight, into out (row
// stride ldo), plus bias, on the calling thread: each block of up to kBlockM rows against every
// block of the range, so a decode step's few rows read each weight byte once, front to back
template <typename T>
void linear_blocks(const T* xp, int64_t M, int64_t K, int64_t lda, const T* wp, const T* bp, T* op, int64_t ldo,
                   int64_t nb0, int64_t nb1) {
  alignas(64) float acc[kBlockM * kBlockN];
  for (int64_t m0 = 0; m0 < M; m0 += kBlockM) {
    const int64_t rows = std::min(kBlockM, M - m0);
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      at::native::cpublas::brgemm(rows, kBlockN, K, lda, kBlockN, kBlockN, false, xp + m0 * lda, wp + nb * K * kBlockN,
                                  acc, true);
      for (int64_t r = 0; r < rows; ++r) {
        T* dst = op + (m0 + r) * ldo + nb * kBlockN;
        for (int64_t j = 0; j < kBlockN; j += kW) {
          Vec v = Vec::loadu(acc + r * kBlockN + j);
          if (bp != nullptr) v = v + load_floats(bp + nb * kBlockN + j);
          store_floats(dst + j, v);
        }
      }
    }
  }
}

template <typename T>
void linear_impl(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                 at::Tensor& out) {
  const int64_t NB = packed.size(0);
  const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
    linear_blocks(x.data_ptr<T>(), x.size(0), x.size(1), x.stride(0), packed.data_ptr<T>(), bp, out.data_ptr<T>(),
                  NB * kBlockN, nb0, nb1);
    at::native::cpublas::brgemm_release(true);
  });
}

// x [M, K] (rows may be strided), packed from pack_linear -> [M, N]
at::Tensor brgemm_linear(at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, in_features] with dense rows");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == 2 * kBlockN &&
                  packed.size(1) * 2 == x.size(1),
              "packed weight does not match x: ", packed.sizes(), " for ", x.sizes());
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "x and weight dtypes differ");
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == packed.size(0) * kBlockN &&
                    bias->scalar_type() == x.scalar_type(), "bias does not match the weight");
  auto out = at::empty({x.size(0), packed.size(0) * kBlockN}, x.options());
  if (x.size(0) == 0) return out;
  AT_DISPATCH_SWITCH(x.scalar_type(), "brgemm_linear",
                     AT_DISPATCH_CASE(at::ScalarType::BFloat16, [&] { linear_impl<scalar_t>(x, packed, bias, out); })
                     AT_DISPATCH_CASE(at::ScalarType::Half, [&] { linear_impl<scalar_t>(x, packed, bias, out); }));
  return out;
}

// A MoE layer's experts in this layout (``moe_experts.h``): per expert, gate/up packed from
// [2 * inter, hidden] and down from [hidden, inter]
template <typename T>
struct ExpertLinears {
  const std::vector<at::Tensor>& w13;
  const std::vector<at::Tensor>& w2;
  at::Tensor x;  // this phase's rows
  const std::vector<int64_t>* offsets = nullptr;

  int64_t blocks(int which) const { return (which == 0 ? w13 : w2)[0].size(0); }
  void prepare(int, const at::Tensor& rows, const std::vector<int64_t>& offs) {
    x = rows;
    offsets = &offs;
  }
  void run(int which, int64_t e, int64_t nb0, int64_t nb1, T* out, int64_t ldo) {
    const int64_t K = x.size(1), r0 = (*offsets)[e];
    linear_blocks(x.data_ptr<T>() + r0 * K, (*offsets)[e + 1] - r0, K, K,
                  (which == 0 ? w13 : w2)[e].template data_ptr<T>(), static_cast<const T*>(nullptr), out, ldo, nb0,
                  nb1);
  }
  void release() { at::native::cpublas::brgemm_release(true); }
};

// x [M, hidden]; tokens, slots, weights: ``moe::run_experts``; w13[e] packed from
// [2 * inter, hidden], w2[e] from [hidden, inter], by pack_linear
at::Tensor moe_experts_brgemm(at::Tensor x, at::Tensor tokens, at::Tensor slots, std::optional<at::Tensor> weights,
                              std::vector<at::Tensor> w13, std::vector<at::Tensor> w2, int64_t inter) {
  kervan::moe::check_routing(x, tokens, slots, weights);
  const int64_t H = x.size(1);
  TORCH_CHECK(!w13.empty() && w13.size() == w2.size(), "one gate/up and one down matrix per expert");
  for (size_t e = 0; e < w13.size(); ++e) {
    TORCH_CHECK(w13[e].dim() == 3 && w13[e].is_contiguous() && w13[e].size(0) * kBlockN == 2 * inter &&
                    w13[e].size(1) * 2 == H && w13[e].scalar_type() == x.scalar_type(),
                "expert ", e, "'s gate/up is not packed from [", 2 * inter, ", ", H, "] in x's dtype");
    TORCH_CHECK(w2[e].dim() == 3 && w2[e].is_contiguous() && w2[e].size(0) * kBlockN == H &&
                    w2[e].size(1) * 2 == inter && w2[e].scalar_type() == x.scalar_type(),
                "expert ", e, "'s down is not packed from [", H, ", ", inter, "] in x's dtype");
  }
  auto run = [&](auto zero) {
    using T = decltype(zero);
    ExpertLinears<T> lin{w13, w2};
    return kervan::moe::run_experts<T>(x, tokens, slots, weights, static_cast<int64_t>(w13.size()), inter, lin);
  };
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, "brgemm experts take bf16 or fp16");
  const at::Tensor out = x.scalar_type() == at::kBFloat16 ? run(c10::BFloat16()) : run(c10::Half());
  return out;
}

bool brgemm_packs_dtype(at::ScalarType dtype) { return brgemm_packs(dtype); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kervan, m) {
  m.def("brgemm_packs(ScalarType dtype) -> bool", &brgemm_packs_dtype);
  m.def("pack_linear(Tensor weight) -> Tensor", &pack_linear);
  m.def("brgemm_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &brgemm_linear);
  m.def("moe_experts_brgemm(Tensor x, Tensor tokens, Tensor slots, Tensor? weights, Tensor[] w13, Tensor[] w2, "
        "int inter) -> Tensor", &moe_experts_brgemm);
}
