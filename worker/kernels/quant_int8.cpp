// Quantized linears with int8 activations: llama.cpp's Q8 path for Kervan's weight codes.
// Decoding 4-bit codes to float32 for FMAs costs several instructions per weight (widen,
// convert, scale, multiply-add, 8 or 16 at a time); here each row of x is quantized once per
// call, by blocks of 32, to int8 with a float32 scale (amax / 127, rounded to nearest even:
// llama.cpp's Q8_0), and the codes are multiplied as bytes, 32 or 64 per instruction:
//
//   x[m, k] ~= xd[m, k / 32] * xq[m, k]                       xq in -127..127
//   out[m, n] = sum over blocks b (group g) of
//               xd[m, b] * (scale[n, g] * (codes[n, b] . xq[m, b]) + zero'[n, g] * sum(xq[m, b]))
//
// with zero' = zero + offset * scale (codes standing for offset + 0..15: Q4_0's -8; int8 codes
// shifted to unsigned for vpdpbusd: -128). Both terms see the same rounded x, so the error is
// the weight times x's rounding (llama.cpp's), not the codes' offset times it. Codes: 4-bit
// (int4 with zeros, GGUF Q4_0 and Q4_1) and int8 (int8 per channel, GGUF Q8_0); groups a
// multiple of 32. ``terms`` 2 rounds x to two int8 rows, x's and its remainder's (the LM head).
// ``worker/quant/kernel_choice.py`` chooses this kernel or the float one by timing both on this
// CPU; ``benchmarks/quant_activations.py`` measures speed, perplexity and greedy agreement.
// Rows of x never mix: batch-invariant.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#if defined(CPU_CAPABILITY_AVX512)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "moe_experts.h"
#include "vec.h"

namespace kervan::q8 {

constexpr int64_t kAheadBytes = 2048;  // how far ahead of its reads a tile's stream is prefetched

// x as int8 by blocks of 32: q [M, K], and per block its scale d and the sum of its int8
// values, as a float (for the zeros' term) [M, K / 32]; rows past M, where the vectors hold
// them (padding to whole tiles of rows), are zero
struct QuantizedRows {
  int64_t M, K;
  std::vector<int8_t> q;
  std::vector<float> d, sum;
};

// 32 floats -> 32 int8 and their scale
inline void quantize_block(const float* v, int8_t* q, float* d, float* sum) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  __m256 a[4];
  __m256 mx = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < 4; ++i) {
    a[i] = _mm256_loadu_ps(v + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, a[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float scale = _mm_cvtss_f32(m4) / 127.0f;
  *d = scale;
  const __m256 inv = _mm256_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
  __m256i i[4];
  for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(a[j], inv));  // nearest, ties to even
  // packs work within 128-bit lanes: dwords come out as 0 2 4 6 1 3 5 7 of the wanted order
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
  *sum = static_cast<float>(_mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1))));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
  *d = scale;
  int total = 0;
  for (int i = 0; i < 32; ++i) total += q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
  *sum = static_cast<float>(total);
#endif
}

// ``terms`` 2: each row of x becomes two int8 rows, x's and its remainder's (x - d * q, itself
// rounded to int8 by blocks), whose products the caller adds: x to about 1/127 of int8's error,
// for the same weight bytes read (the LM head's logits)
template <typename T>
QuantizedRows quantize_rows(const at::Tensor& x, int64_t terms, int64_t row_tile) {
  const int64_t M = x.size(0) * terms, K = x.size(1), blocks = K / 32, rows = (M + row_tile - 1) / row_tile * row_tile;
  QuantizedRows out{M, K, std::vector<int8_t>(rows * K), std::vector<float>(rows * blocks),
                    std::vector<float>(rows * blocks)};
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t r0, int64_t r1) {  // each row of x and its terms alone
    std::vector<float> row(K);
    for (int64_t m = r0 * terms; m < r1 * terms; ++m) {
      if (m % terms == 0) {
        for (int64_t k = 0; k < K; k += kW) load_floats(xp + m / terms * x.stride(0) + k).store(row.data() + k);
      } else {  // the remainder of the row before
        for (int64_t k = 0; k < K; ++k) row[k] -= out.d[(m - 1) * blocks + k / 32] * out.q[(m - 1) * K + k];
      }
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t i = m * blocks + b;
        quantize_block(row.data() + b * 32, out.q.data() + m * K + b * 32, &out.d[i], &out.sum[i]);
      }
    }
  });
  return out;
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
namespace plain {
#define KERVAN_Q8_VNNI 0
#include "quant_int8_kernel.h"
#undef KERVAN_Q8_VNNI
}  // namespace plain
#endif

#if defined(CPU_CAPABILITY_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512vnni")
namespace vnni {
#define KERVAN_Q8_VNNI 1
#include "quant_int8_kernel.h"
#undef KERVAN_Q8_VNNI
#pragma GCC push_options
#pragma GCC target("avx512vnni,amx-tile,amx-int8")
#include "quant_int8_amx.h"
#pragma GCC pop_options
}  // namespace vnni
#pragma GCC pop_options
#endif

// rows of x (its terms counted) from which a call takes AMX tiles where the CPU has them. From 4
// rows, the AMX Xeon's 1B Q4_0 decode fell from 48 to 20 tok/s at 2 sequences; from 16, 8 sequences
// gained in one ad hoc run and not in llama_cpp_parity's (78 tok/s either way)
constexpr int64_t kAmxMinRows = 32;

// the instructions this process's kernel multiplies with: "vnni" (tiles of 16 features,
// int8 codes stored shifted to unsigned), "avx2" (tiles of 8, int8 codes signed) or "" (none)
const char* instructions() {
#if defined(CPU_CAPABILITY_AVX512)
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  return vnni ? "vnni" : "avx2";
#elif defined(CPU_CAPABILITY_AVX2)
  return "avx2";
#else
  return "";
#endif
}

// A weight's layout as ``worker/quant/int8_layout.py`` packed it
struct Format {
  int64_t group;
  bool four_bit, signed_codes, half_params;
  int64_t terms;  // int8 rows x is rounded to

  int64_t tile_bytes(int64_t K, int64_t tile) const {
    return (K / group) * 2 * tile * (half_params ? 2 : 4) + K / 32 * tile * (four_bit ? 16 : 32);
  }
};

// Checks ``data`` [tiles, bytes] is a weight of at least out_features packed in ``f`` for K columns
// and this CPU's kernel
void check_packed(const at::Tensor& data, const Format& f, int64_t K, int64_t out_features) {
  const char* isa = instructions();
  TORCH_CHECK(*isa != '\0', "int8-activation matmuls need AVX2");
  const bool vnni = isa[0] == 'v';
  const int64_t tile = vnni ? 16 : 8;
  TORCH_CHECK(f.terms == 1 || f.terms == 2, "x is rounded to one or two int8 terms, not ", f.terms);
  TORCH_CHECK(K % 32 == 0 && f.group % 32 == 0 && K % f.group == 0, "in_features ", K, " and the group ", f.group,
              " must be multiples of 32");
  TORCH_CHECK(vnni ? !f.signed_codes : (f.signed_codes || f.four_bit), "int8 codes are packed ",
              vnni ? "unsigned" : "signed", " for this CPU's kernel");
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous() && data.scalar_type() == at::kByte &&
                  data.size(1) == f.tile_bytes(K, tile) && data.size(0) * tile >= out_features,
              "the weight is not packed for ", tile, "-feature tiles of ", K, " columns");
}

// Whether a call of ``rows`` int8 rows (terms counted) takes AMX tiles: where the CPU has them
bool takes_amx(int64_t rows) {
#if defined(CPU_CAPABILITY_AVX512)
  return instructions()[0] == 'v' && rows >= kAmxMinRows && vnni::amx_allowed();
#else
  (void)rows;
  return false;
#endif
}

// Tiles [t0, t1) of x's rows against a weight into out (float32, [x.M, tiles * tile]), on the
// calling thread, by the kernel this CPU takes (AMX where ``amx``: the same bits)
template <typename S>
void tiles_range(const QuantizedRows& xq, const uint8_t* data, int64_t tiles, const Format& f, bool amx, float* out,
                 int64_t t0, int64_t t1) {
#if defined(CPU_CAPABILITY_AVX512)
  const bool vnni = instructions()[0] == 'v';
  if (amx && f.four_bit) return vnni::amx_tiles<true, S>(xq, data, tiles, f.group, out, t0, t1);
  if (amx) return vnni::amx_tiles<false, S>(xq, data, tiles, f.group, out, t0, t1);
  if (vnni && f.four_bit) return vnni::matmul_tiles<true, false, S>(xq, data, tiles, f.group, out, t0, t1);
  if (vnni) return vnni::matmul_tiles<false, false, S>(xq, data, tiles, f.group, out, t0, t1);
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (f.four_bit) return plain::matmul_tiles<true, false, S>(xq, data, tiles, f.group, out, t0, t1);
  plain::matmul_tiles<false, true, S>(xq, data, tiles, f.group, out, t0, t1);
#endif
}

void tiles_range(const QuantizedRows& xq, const uint8_t* data, int64_t tiles, const Format& f, bool amx, float* out,
                 int64_t t0, int64_t t1) {
  if (f.half_params) return tiles_range<c10::Half>(xq, data, tiles, f, amx, out, t0, t1);
  tiles_range<float>(xq, data, tiles, f, amx, out, t0, t1);
}

// Features [n0, n1) of every row of x's dtype: the terms' sum (o32 [M * terms, width]), plus the
// bias, rounded once to T (the same bits in a vector or the scalar tail)
template <typename T>
void store_rows(const float* o32, int64_t M, int64_t terms, int64_t width, const T* bias, T* out, int64_t ldo,
                int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; ++m) {
    const float* src = o32 + m * terms * width;
    T* dst = out + m * ldo;
    int64_t n = n0;
    for (; n + kW <= n1; n += kW) {
      Vec v = Vec::loadu(src + n);
      if (terms == 2) v = v + Vec::loadu(src + width + n);
      if (bias != nullptr) v = v + load_floats(bias + n);
      store_floats(dst + n, v);
    }
    for (; n < n1; ++n) {
      const float v = terms == 2 ? src[n] + src[width + n] : src[n];
      dst[n] = static_cast<T>(bias != nullptr ? v + static_cast<float>(bias[n]) : v);
    }
  }
}

// x [M, K] (dense rows) -> [M, out_features] in x's dtype, against a weight packed by
// ``worker/quant/int8_layout.py``: ``data`` uint8 [tiles, bytes], each tile's records of
// float32 (``half_params``: float16) scales and zeros, then codes
at::Tensor quant_matmul_i8(at::Tensor x, at::Tensor data, int64_t out_features, int64_t group, bool four_bit,
                           bool signed_codes, bool half_params, int64_t terms, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, in_features] with dense rows");
  const Format f{group, four_bit, signed_codes, half_params, terms};
  check_packed(data, f, x.size(1), out_features);
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == out_features && bias->scalar_type() == x.scalar_type(),
                "bias does not match the weight");
  const int64_t M = x.size(0), tiles = data.size(0), tile = instructions()[0] == 'v' ? 16 : 8, width = tiles * tile;
  auto out = at::empty({M, out_features}, x.options());
  if (M == 0) return out;
  std::unique_ptr<float[]> out32(new float[M * terms * width]);  // every element written: no zeroing
  const bool amx = takes_amx(M * terms);
  KERVAN_DISPATCH(x.scalar_type(), "quant_matmul_i8", [&] {
    using T = scalar_t;
    const QuantizedRows xq = quantize_rows<T>(x, terms, amx ? 16 : 1);
    const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      tiles_range(xq, data.data_ptr<uint8_t>(), tiles, f, amx, out32.get(), t0, t1);
      // this thread's features into x's dtype as its tiles finish (no serial pass after)
      store_rows(out32.get(), M, terms, width, bp, out.data_ptr<T>(), out_features, t0 * tile,
                 std::min(t1 * tile, out_features));
    });
  });
  return out;
}

// A MoE layer's experts in this layout (``moe_experts.h``): per expert, gate/up packed from
// [2 * inter, hidden] and down from [hidden, inter], each matrix kind in its format
template <typename T>
struct ExpertLinears {
  const std::vector<at::Tensor>& w13;
  const std::vector<at::Tensor>& w2;
  Format format[2];
  int64_t out_features[2];
  int64_t tile;
  std::vector<QuantizedRows> xq;           // this phase's rows of each expert, as int8
  std::vector<std::vector<float>> out32;   // and their outputs, float32 [rows * terms, tiles * tile]
  std::vector<char> amx;

  int64_t blocks(int which) const { return (which == 0 ? w13 : w2)[0].size(0); }
  void prepare(int which, const at::Tensor& x, const std::vector<int64_t>& offsets) {
    const int64_t experts = static_cast<int64_t>(offsets.size()) - 1, terms = format[which].terms;
    xq.assign(experts, QuantizedRows{});
    out32.assign(experts, {});
    amx.assign(experts, 0);
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t rows = offsets[e + 1] - offsets[e];
      if (rows == 0) continue;
      amx[e] = takes_amx(rows * terms);
      xq[e] = quantize_rows<T>(x.narrow(0, offsets[e], rows), terms, amx[e] ? 16 : 1);
      out32[e].resize(rows * terms * blocks(which) * tile);
    }
  }
  void run(int which, int64_t e, int64_t nb0, int64_t nb1, T* out, int64_t ldo) {
    const Format& f = format[which];
    const int64_t tiles = blocks(which), n = out_features[which];
    tiles_range(xq[e], (which == 0 ? w13 : w2)[e].template data_ptr<uint8_t>(), tiles, f, amx[e], out32[e].data(),
                nb0, nb1);
    store_rows<T>(out32[e].data(), xq[e].M / f.terms, f.terms, tiles * tile, nullptr, out, ldo, nb0 * tile,
                  std::min(nb1 * tile, n));
  }
  void release() {}
};

// x [M, hidden]; tokens, slots, weights: ``moe::run_experts``; w13[e] and w2[e] packed as
// ``quant_matmul_i8`` takes them, their formats [group, four_bit, signed_codes, half_params, terms]
at::Tensor moe_experts_i8(at::Tensor x, at::Tensor tokens, at::Tensor slots, std::optional<at::Tensor> weights,
                          std::vector<at::Tensor> w13, std::vector<at::Tensor> w2, int64_t inter,
                          std::vector<int64_t> format13, std::vector<int64_t> format2) {
  moe::check_routing(x, tokens, slots, weights);
  TORCH_CHECK(!w13.empty() && w13.size() == w2.size(), "one gate/up and one down matrix per expert");
  TORCH_CHECK(format13.size() == 5 && format2.size() == 5, "a format is [group, four_bit, signed_codes, "
              "half_params, terms]");
  auto format = [](const std::vector<int64_t>& v) { return Format{v[0], v[1] != 0, v[2] != 0, v[3] != 0, v[4]}; };
  const Format f13 = format(format13), f2 = format(format2);
  const int64_t H = x.size(1);
  for (size_t e = 0; e < w13.size(); ++e) {
    check_packed(w13[e], f13, H, 2 * inter);
    check_packed(w2[e], f2, inter, H);
    TORCH_CHECK(w13[e].sizes() == w13[0].sizes() && w2[e].sizes() == w2[0].sizes(), "experts of one shape");
  }
  const int64_t tile = instructions()[0] == 'v' ? 16 : 8;
  at::Tensor out;
  KERVAN_DISPATCH(x.scalar_type(), "moe_experts_i8", [&] {
    ExpertLinears<scalar_t> lin{w13, w2, {f13, f2}, {2 * inter, H}, tile};
    out = moe::run_experts<scalar_t>(x, tokens, slots, weights, static_cast<int64_t>(w13.size()), inter, lin);
  });
  return out;
}

std::string int8_instructions() { return instructions(); }

}  // namespace kervan::q8

TORCH_LIBRARY_FRAGMENT(kervan, m) {
  m.def("quant_matmul_i8(Tensor x, Tensor data, int out_features, int group, bool four_bit, bool signed_codes, "
        "bool half_params, int terms, Tensor? bias) -> Tensor", &kervan::q8::quant_matmul_i8);
  m.def("moe_experts_i8(Tensor x, Tensor tokens, Tensor slots, Tensor? weights, Tensor[] w13, Tensor[] w2, "
        "int inter, int[] format13, int[] format2) -> Tensor", &kervan::q8::moe_experts_i8);
  m.def("int8_instructions() -> str", &kervan::q8::int8_instructions);
}
