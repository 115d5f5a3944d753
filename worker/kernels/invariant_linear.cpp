// Batch-invariant linears for float weights: x [M, K] (float32, bf16 or fp16) times a weight
// packed as column blocks [NB, K, 32] (float32, bf16 or fp16 elements), giving [M, N].
//
// Every call computes each output element the same way, whatever M, the row's place among
// the rows, the thread count, or the CPU's vector width:
//
//   acc = 0;  for k = 0 .. K-1:  acc = fma(float(x[m, k]), float(w[n, k]), acc);
//   out[m, n] = T(acc + float(bias[n]))
//
// one float32 FMA chain per element, in k order. FMA rounds exactly once, so AVX2 and
// AVX-512 (8 or 16 columns a vector) give the same bits, and so does any blocking of the
// loops: a chain cut into chunks of k is stored and reloaded exactly. That is what lets a
// token's row be computed alone in a decode step, among 2,000 prompt rows, or after its
// prefix came from the cache, with one result (``worker/layers/packing.py`` gives every
// float linear on the CPU this kernel unless oneDNN's AMX micro-kernel serves its dtype).
//
// Speed: a decode step's few rows stream each block of the weight once, front to back; a
// prompt's many rows take tiles of kRows rows x 32 columns, every accumulator in a register,
// the block's weights a chunk of kChunk k at a time kept in L1 while every row tile passes.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "moe_experts.h"
#include "vec.h"

namespace kervan::invariant {

using kervan::kW;
using kervan::load_floats;
using kervan::store_floats;
using kervan::Vec;

constexpr int64_t kBlock = 32;       // columns per block
constexpr int64_t kV = kBlock / kW;  // vectors per block row: 4 with AVX2, 2 with AVX-512
// A tile is R rows x kTileV vectors of columns, every accumulator in a register. AVX-512: 12 rows
// x a whole block (24 of 32 registers). AVX2: 6 rows x half a block (12 of 16, two vectors of
// weights, one broadcast of x), and a decode step's 1-2 rows x a whole block, which reads each
// row of the block's weights in one pass instead of two.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kTileV = kV;
constexpr int kRows = 12;
constexpr int kFewRows = 0;
#else
constexpr int64_t kTileV = 2;
constexpr int kRows = 6;
constexpr int kFewRows = 2;  // rows that take whole-block tiles
#endif
constexpr int64_t kChunk = 512;             // k per pass over a panel of rows
constexpr int64_t kPanelBytes = 256 << 10;  // a panel of x's rows (float32, kChunk k): within L2

// weight [N, K] -> [ceil(N / kBlock), K, kBlock], the columns past N zero
at::Tensor pack_invariant(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be [out_features, in_features]");
  const int64_t N = weight.size(0), K = weight.size(1), NB = (N + kBlock - 1) / kBlock;
  at::Tensor padded = weight;
  if (NB * kBlock != N) {
    padded = at::zeros({NB * kBlock, K}, weight.options());
    padded.narrow(0, 0, N).copy_(weight);
  }
  return padded.view({NB, kBlock, K}).transpose(1, 2).contiguous();
}

// Where a tile's chains start and end: at 0 (first) or at ``partial``'s sums (float32, row
// stride ldp), and in ``partial`` or, the last chunk, in out (cols: its valid columns)
template <typename T>
struct Ends {
  float* partial;
  int64_t ldp;
  bool first, last;
  T* out;
  int64_t ldo;
  const float* bias;
  int64_t cols;
};

// R rows of x (float32, row stride ldx) against V vectors of columns of a block's k range
// [0, kn) (w: the block's row k = 0 at the tile's first column)
template <typename W, typename T, int R, int64_t V>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t kn, const Ends<T>& e) {
  Vec acc[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int64_t v = 0; v < V; ++v) acc[r][v] = e.first ? Vec(0.f) : Vec::loadu(e.partial + r * e.ldp + v * kW);
  for (int64_t k = 0; k < kn; ++k) {
    Vec wv[V];
#pragma GCC unroll 4
    for (int64_t v = 0; v < V; ++v) wv[v] = load_floats(w + k * kBlock + v * kW);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const Vec xb(x[r * ldx + k]);
#pragma GCC unroll 4
      for (int64_t v = 0; v < V; ++v) acc[r][v] = at::vec::fmadd(xb, wv[v], acc[r][v]);
    }
  }
  if (!e.last) {
    for (int r = 0; r < R; ++r)
      for (int64_t v = 0; v < V; ++v) acc[r][v].store(e.partial + r * e.ldp + v * kW);
    return;
  }
  constexpr int64_t kCols = V * kW;
  for (int r = 0; r < R; ++r) {
    alignas(64) T row[kCols];
    T* dst = e.cols >= kCols ? e.out + r * e.ldo : row;
    for (int64_t v = 0; v < V; ++v) {
      const Vec b = e.bias != nullptr ? Vec::loadu(e.bias + v * kW) : Vec(0.f);
      store_floats(dst + v * kW, acc[r][v] + b);
    }
    if (e.cols < kCols) std::copy(row, row + std::max<int64_t>(e.cols, 0), e.out + r * e.ldo);
  }
}

template <typename W, typename T, int64_t V>
void tile_rows(int rows, const float* x, int64_t ldx, const W* w, int64_t kn, const Ends<T>& e) {
  switch (rows) {
#if defined(CPU_CAPABILITY_AVX512)
    case 12: return tile<W, T, 12, V>(x, ldx, w, kn, e);
    case 11: return tile<W, T, 11, V>(x, ldx, w, kn, e);
    case 10: return tile<W, T, 10, V>(x, ldx, w, kn, e);
    case 9: return tile<W, T, 9, V>(x, ldx, w, kn, e);
    case 8: return tile<W, T, 8, V>(x, ldx, w, kn, e);
    case 7: return tile<W, T, 7, V>(x, ldx, w, kn, e);
#endif
    case 6: return tile<W, T, 6, V>(x, ldx, w, kn, e);
    case 5: return tile<W, T, 5, V>(x, ldx, w, kn, e);
    case 4: return tile<W, T, 4, V>(x, ldx, w, kn, e);
    case 3: return tile<W, T, 3, V>(x, ldx, w, kn, e);
    case 2: return tile<W, T, 2, V>(x, ldx, w, kn, e);
    default: return tile<W, T, 1, V>(x, ldx, w, kn, e);
  }
}

// How a call of M rows walks K: a decode step's rows are one tile, so each block of the
// weight streams once, whole. More rows go by panels of x, kChunk k by as many rows as fit
// kPanelBytes (in L2), and each block's weights for that k range pass every row tile of the
// panel; chains cut at a chunk's end wait in a float32 ``partial`` [M, NB * kBlock].
struct Plan {
  int64_t chunk, panel;
};

inline Plan plan_rows(int64_t M, int64_t K) {
  const bool few = M <= kRows;
  const int64_t chunk = few ? K : std::min(K, kChunk);
  return Plan{chunk, few ? M : std::max<int64_t>(kRows, kPanelBytes / (chunk * 4) / kRows * kRows)};
}

// floats of ``partial`` a call of M rows needs
inline int64_t partial_size(int64_t M, int64_t K, int64_t NB) { return plan_rows(M, K).chunk < K ? M * NB * kBlock : 0; }

// Blocks [nb0, nb1) of the output for all M rows, on the calling thread
template <typename W, typename T>
void linear_blocks(const float* x, int64_t M, int64_t K, int64_t ldx, const W* w, int64_t NB, const float* bias,
                   T* out, int64_t N, int64_t ldo, int64_t nb0, int64_t nb1, float* partial) {
  const auto [chunk, panel] = plan_rows(M, K);
  const int64_t NP = NB * kBlock;
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t kn = std::min(chunk, K - k0);
    for (int64_t p0 = 0; p0 < M; p0 += panel) {
      const int64_t p1 = std::min(M, p0 + panel), tiles = (p1 - p0 + kRows - 1) / kRows;
      for (int64_t nb = nb0; nb < nb1; ++nb) {
        const W* wb = w + nb * K * kBlock + k0 * kBlock;
        if (p1 - p0 <= kFewRows) {  // AVX2's decode rows: a whole block a tile
          Ends<T> e{partial + p0 * NP + nb * kBlock, NP, k0 == 0, k0 + kn == K, out + p0 * ldo + nb * kBlock,
                    ldo, bias != nullptr ? bias + nb * kBlock : nullptr, N - nb * kBlock};
          tile_rows<W, T, kV>(static_cast<int>(p1 - p0), x + p0 * ldx + k0, ldx, wb, kn, e);
          continue;
        }
        for (int64_t c0 = 0; c0 < kBlock; c0 += kTileV * kW) {
          const int64_t col = nb * kBlock + c0;
          for (int64_t t = 0, m0 = p0; t < tiles; ++t) {  // tiles of even sizes: none of a few rows
            const int rows = static_cast<int>((p1 - m0) / (tiles - t));
            Ends<T> e{partial + m0 * NP + col, NP, k0 == 0, k0 + kn == K, out + m0 * ldo + col, ldo,
                      bias != nullptr ? bias + col : nullptr, N - col};
            tile_rows<W, T, kTileV>(rows, x + m0 * ldx + k0, ldx, wb + c0, kn, e);
            m0 += rows;
          }
        }
      }
    }
  }
}

template <typename W, typename T>
void linear_impl(const float* x, int64_t M, int64_t K, int64_t ldx, const W* w, int64_t NB, const float* bias,
                 T* out, int64_t N) {
  std::vector<float> partial(partial_size(M, K, NB));
  at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
    linear_blocks(x, M, K, ldx, w, NB, bias, out, N, N, nb0, nb1, partial.data());
  });
}

// x [M, K] (dense rows), packed from pack_invariant, bias [N] -> [M, N] in x's dtype
at::Tensor invariant_linear(at::Tensor x, at::Tensor packed, int64_t out_features, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, in_features] with dense rows");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kBlock && packed.size(1) == x.size(1),
              "packed weight does not match x: ", packed.sizes(), " for ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), N = out_features;
  TORCH_CHECK(N > (NB - 1) * kBlock && N <= NB * kBlock, "out_features ", N, " does not match ", NB, " blocks");
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "bias does not match the weight");
    b32 = at::zeros({NB * kBlock}, x.options().dtype(at::kFloat));
    b32.narrow(0, 0, N).copy_(*bias);
  }
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat).contiguous();
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  KERVAN_DISPATCH(x.scalar_type(), "invariant_linear", [&] {
    using T = scalar_t;
    auto run = [&](auto* w) {
      linear_impl(xf.data_ptr<float>(), M, K, xf.stride(0), w, NB, bp, out.data_ptr<T>(), N);
    };
    switch (packed.scalar_type()) {
      case at::kFloat: return run(packed.data_ptr<float>());
      case at::kBFloat16: return run(packed.data_ptr<c10::BFloat16>());
      case at::kHalf: return run(packed.data_ptr<c10::Half>());
      default: TORCH_CHECK(false, "weights in float32, bf16 or fp16, not ", packed.scalar_type());
    }
  });
  return out;
}

// A MoE layer's experts in this layout (``moe_experts.h``): per expert, gate/up packed from
// [2 * inter, hidden] and down from [hidden, inter], all of one weight dtype W
template <typename W, typename T>
struct ExpertLinears {
  const std::vector<at::Tensor>& w13;
  const std::vector<at::Tensor>& w2;
  int64_t out_features[2];
  at::Tensor xf;                  // this phase's rows in float32
  const std::vector<int64_t>* offsets = nullptr;
  std::vector<float> partial;     // every expert's chains between chunks, side by side
  std::vector<int64_t> partial_at;

  int64_t blocks(int which) const { return (which == 0 ? w13 : w2)[0].size(0); }
  void prepare(int which, const at::Tensor& x, const std::vector<int64_t>& offs) {
    xf = x.to(at::kFloat).contiguous();
    offsets = &offs;
    const int64_t K = x.size(1), NB = blocks(which), experts = static_cast<int64_t>(offs.size()) - 1;
    partial_at.assign(experts + 1, 0);
    for (int64_t e = 0; e < experts; ++e) partial_at[e + 1] = partial_at[e] + partial_size(offs[e + 1] - offs[e], K, NB);
    partial.resize(partial_at[experts]);
  }
  void run(int which, int64_t e, int64_t nb0, int64_t nb1, T* out, int64_t ldo) {
    const at::Tensor& w = (which == 0 ? w13 : w2)[e];
    const int64_t K = xf.size(1), r0 = (*offsets)[e];
    linear_blocks(xf.data_ptr<float>() + r0 * K, (*offsets)[e + 1] - r0, K, K, w.data_ptr<W>(), w.size(0), nullptr,
                  out, out_features[which], ldo, nb0, nb1, partial.data() + partial_at[e]);
  }
  void release() {}
};

// x [M, hidden]; tokens, slots, weights: ``moe::run_experts``; w13[e] packed [2 * inter],
// w2[e] packed [hidden]
at::Tensor moe_experts_invariant(at::Tensor x, at::Tensor tokens, at::Tensor slots, std::optional<at::Tensor> weights,
                                 std::vector<at::Tensor> w13, std::vector<at::Tensor> w2, int64_t inter) {
  moe::check_routing(x, tokens, slots, weights);
  const int64_t H = x.size(1);
  TORCH_CHECK(!w13.empty() && w13.size() == w2.size(), "one gate/up and one down matrix per expert");
  for (size_t e = 0; e < w13.size(); ++e) {
    TORCH_CHECK(w13[e].dim() == 3 && w13[e].is_contiguous() && w13[e].size(1) == H && w13[e].size(2) == kBlock &&
                    w13[e].size(0) == (2 * inter + kBlock - 1) / kBlock && w13[e].sizes() == w13[0].sizes(),
                "expert ", e, "'s gate/up is not packed from [", 2 * inter, ", ", H, "]");
    TORCH_CHECK(w2[e].dim() == 3 && w2[e].is_contiguous() && w2[e].size(1) == inter && w2[e].size(2) == kBlock &&
                    w2[e].size(0) == (H + kBlock - 1) / kBlock && w2[e].sizes() == w2[0].sizes(),
                "expert ", e, "'s down is not packed from [", H, ", ", inter, "]");
    TORCH_CHECK(w13[e].scalar_type() == w13[0].scalar_type() && w2[e].scalar_type() == w13[0].scalar_type(),
                "every expert's weights in one dtype");
  }
  at::Tensor out;
  KERVAN_DISPATCH(x.scalar_type(), "moe_experts_invariant", [&] {
    using T = scalar_t;
    auto run = [&](auto w) {
      ExpertLinears<decltype(w), T> lin{w13, w2, {2 * inter, H}};
      out = moe::run_experts<T>(x, tokens, slots, weights, static_cast<int64_t>(w13.size()), inter, lin);
    };
    switch (w13[0].scalar_type()) {
      case at::kFloat: return run(0.0f);
      case at::kBFloat16: return run(c10::BFloat16());
      case at::kHalf: return run(c10::Half());
      default: TORCH_CHECK(false, "weights in float32, bf16 or fp16, not ", w13[0].scalar_type());
    }
  });
  return out;
}

}  // namespace kervan::invariant

TORCH_LIBRARY_FRAGMENT(kervan, m) {
  m.def("pack_invariant(Tensor weight) -> Tensor", &kervan::invariant::pack_invariant);
  m.def("invariant_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor",
        &kervan::invariant::invariant_linear);
  m.def("moe_experts_invariant(Tensor x, Tensor tokens, Tensor slots, Tensor? weights, Tensor[] w13, Tensor[] w2, "
        "int inter) -> Tensor", &kervan::invariant::moe_experts_invariant);
}
