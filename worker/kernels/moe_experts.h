// A mixture-of-experts layer's routed experts in one native call: the (token, expert) pairs
// grouped by expert, then every expert's gate/up projection, SiLU-and-multiply, and down
// projection, each phase one parallel region over (expert, column block) tasks, so two threads
// (or sixty) split the layer's chosen experts' weights between them and each streams a
// contiguous run of them, however few tokens an expert has. Then each token's outputs are
// weighted and summed.
//
// The weights' layout is the caller's (``Lin``, below): the invariant float kernel's, oneDNN's
// brgemm (AMX), or the int8-activation kernel's, each computing a token's row alone, so the
// fused layer gives every token the bits it would get from its experts one call at a time, and
// the same bits whatever else is in the batch. The sum replays ``SparseMoe``'s PyTorch path
// (``index_add_`` per expert in slot order, in x's dtype): equal bits, which the tests check.
//
// ``Lin`` provides, for ``which`` 0 (gate/up, 2 * inter outputs) and 1 (down, hidden outputs):
//   int64_t blocks(int which)                    column blocks of each expert's matrix
//   void prepare(int which, const at::Tensor& x, const std::vector<int64_t>& offsets)
//                                                x [rows, in] in T: every expert's rows, expert e's
//                                                at offsets[e] .. offsets[e + 1]
//   void run(int which, int64_t e, int64_t nb0, int64_t nb1, T* out, int64_t ldo)
//                                                expert e's output blocks [nb0, nb1) for its rows,
//                                                into out (its first row) in T, on this thread
//   void release()                               the thread is done (brgemm's AMX state)
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <optional>
#include <utility>
#include <vector>

#include "silu_mul.h"
#include "vec.h"

namespace kervan::moe {

// The pairs of expert e are order[offsets[e] .. offsets[e + 1]), by pair index (stable)
struct Groups {
  std::vector<int64_t> order, offsets;
};

inline Groups group_pairs(const int64_t* slots, int64_t pairs, int64_t experts) {
  Groups g{std::vector<int64_t>(), std::vector<int64_t>(experts + 1, 0)};
  for (int64_t p = 0; p < pairs; ++p)
    if (slots[p] >= 0 && slots[p] < experts) ++g.offsets[slots[p] + 1];
  for (int64_t e = 0; e < experts; ++e) g.offsets[e + 1] += g.offsets[e];
  g.order.resize(g.offsets[experts]);
  std::vector<int64_t> next(g.offsets.begin(), g.offsets.end() - 1);
  for (int64_t p = 0; p < pairs; ++p)
    if (slots[p] >= 0 && slots[p] < experts) g.order[next[slots[p]]++] = p;
  return g;
}

// One phase: every used expert's blocks as tasks, threads taking contiguous runs of them
template <typename T, typename Lin>
void run_phase(Lin& lin, int which, const std::vector<int64_t>& offsets, T* out, int64_t ldo) {
  const int64_t experts = static_cast<int64_t>(offsets.size()) - 1, nb = lin.blocks(which);
  std::vector<int64_t> used;
  for (int64_t e = 0; e < experts; ++e)
    if (offsets[e + 1] > offsets[e]) used.push_back(e);
  const int64_t tasks = static_cast<int64_t>(used.size()) * nb;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1;) {
      const int64_t u = t / nb, b0 = t % nb, b1 = std::min(nb, b0 + (t1 - t));
      const int64_t e = used[u];
      lin.run(which, e, b0, b1, out + offsets[e] * ldo, ldo);
      t += b1 - b0;
    }
    lin.release();
  });
}

// a * b rounded to float32 on its own, as PyTorch's multiply stores it: never contracted with a
// following add into one FMA (which rounds once)
inline Vec product(const Vec& a, const Vec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 p = a * b;
  asm("" : "+v"(p));
  return p;
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 p = a * b;
  asm("" : "+x"(p));
  return p;
#else
  alignas(64) float p[kW];
  (a * b).store(p);
  asm volatile("" ::: "memory");
  return Vec::loadu(p);
#endif
}

inline float product(float a, float b) {
  volatile float p = a * b;
  return p;
}

// x [M, H] in T; tokens, slots [P] (a pair's row of x and its expert's local slot; a slot
// outside [0, experts) is another rank's expert, skipped); weights [P] float32 or none.
// With weights: [M, H], each token's pairs weighted and summed in slot order. Without: [P, H],
// each pair's expert output (zero for skipped pairs).
template <typename T, typename Lin>
at::Tensor run_experts(const at::Tensor& x, const at::Tensor& tokens, const at::Tensor& slots,
                       const std::optional<at::Tensor>& weights, int64_t experts, int64_t inter, Lin& lin) {
  const int64_t M = x.size(0), H = x.size(1), P = tokens.numel();
  const int64_t* tp = tokens.data_ptr<int64_t>();
  const Groups g = group_pairs(slots.data_ptr<int64_t>(), P, experts);
  const int64_t R = static_cast<int64_t>(g.order.size());
  const auto opts = x.options();
  // every expert's rows of x, side by side
  at::Tensor xg = at::empty({R, H}, opts);
  {
    const T* xp = x.data_ptr<T>();
    T* gp = xg.data_ptr<T>();
    at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) std::copy(xp + tp[g.order[r]] * x.stride(0),
                                                  xp + tp[g.order[r]] * x.stride(0) + H, gp + r * H);
    });
  }
  at::Tensor h13 = at::empty({R, 2 * inter}, opts), act = at::empty({R, inter}, opts), y = at::empty({R, H}, opts);
  lin.prepare(0, xg, g.offsets);
  run_phase<T>(lin, 0, g.offsets, h13.data_ptr<T>(), 2 * inter);
  {
    const T* hp = h13.data_ptr<T>();
    T* ap = act.data_ptr<T>();
    at::parallel_for(0, R, 8, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) silu_mul_row(hp + r * 2 * inter, ap + r * inter, inter);
    });
  }
  lin.prepare(1, act, g.offsets);
  run_phase<T>(lin, 1, g.offsets, y.data_ptr<T>(), H);
  const T* yp = y.data_ptr<T>();
  if (!weights.has_value()) {
    at::Tensor out = at::zeros({P, H}, opts);
    T* op = out.data_ptr<T>();
    for (int64_t r = 0; r < R; ++r) std::copy(yp + r * H, yp + (r + 1) * H, op + g.order[r] * H);
    return out;
  }
  // each token's rows of y in slot order (the order of g.order), then weighted and summed as
  // PyTorch's out.index_add_(0, tokens, y * w.to(T)) per expert rounds: w to T, the product to T,
  // each sum to T
  std::vector<std::vector<int64_t>> rows_of(M);
  for (int64_t r = 0; r < R; ++r) rows_of[tp[g.order[r]]].push_back(r);
  const float* wp = weights->data_ptr<float>();
  at::Tensor out = at::zeros({M, H}, opts);
  T* op = out.data_ptr<T>();
  at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      T* dst = op + m * H;
      for (const int64_t r : rows_of[m]) {
        const float w = round_to<T>(wp[g.order[r]]);
        const Vec wv(w);
        const T* src = yp + r * H;
        int64_t h = 0;
        for (; h + kW <= H; h += kW)
          store_floats(dst + h, load_floats(dst + h) + round_to<T>(product(load_floats(src + h), wv)));
        for (; h < H; ++h)
          dst[h] = static_cast<T>(static_cast<float>(dst[h]) + round_to<T>(product(static_cast<float>(src[h]), w)));
      }
    }
  });
  return out;
}

// The checks every kind's op makes of its routing arguments
inline void check_routing(const at::Tensor& x, const at::Tensor& tokens, const at::Tensor& slots,
                          const std::optional<at::Tensor>& weights) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [tokens, hidden] with dense rows");
  TORCH_CHECK(tokens.dim() == 1 && slots.dim() == 1 && tokens.numel() == slots.numel() && tokens.is_contiguous() &&
                  slots.is_contiguous() && tokens.scalar_type() == at::kLong && slots.scalar_type() == at::kLong,
              "tokens and slots must be int64 [pairs]");
  const int64_t* tp = tokens.data_ptr<int64_t>();
  for (int64_t p = 0; p < tokens.numel(); ++p)
    TORCH_CHECK(tp[p] >= 0 && tp[p] < x.size(0), "pair ", p, " names row ", tp[p], " of ", x.size(0));
  if (weights.has_value())
    TORCH_CHECK(weights->dim() == 1 && weights->numel() == tokens.numel() && weights->is_contiguous() &&
                    weights->scalar_type() == at::kFloat, "weights must be float32 [pairs]");
}

}  // namespace kervan::moe
