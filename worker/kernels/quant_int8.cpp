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

// rows of x (its terms counted) from which a call takes AMX tiles where the CPU has them
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

// x [M, K] (dense rows) -> [M, out_features] in x's dtype, against a weight packed by
// ``worker/quant/int8_layout.py``: ``data`` uint8 [tiles, bytes], each tile's records of
// float32 (``half_params``: float16) scales and zeros, then codes
at::Tensor quant_matmul_i8(at::Tensor x, at::Tensor data, int64_t out_features, int64_t group, bool four_bit,
                           bool signed_codes, bool half_params, int64_t terms, std::optional<at::Tensor> bias) {
  const char* isa = instructions();
  TORCH_CHECK(*isa != '\0', "int8-activation matmuls need AVX2");
  const bool vnni = isa[0] == 'v';
  const int64_t tile = vnni ? 16 : 8;
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, in_features] with dense rows");
  TORCH_CHECK(terms == 1 || terms == 2, "x is rounded to one or two int8 terms, not ", terms);
  const int64_t K = x.size(1), tiles = data.size(0);
  TORCH_CHECK(K % 32 == 0 && group % 32 == 0 && K % group == 0, "in_features ", K, " and the group ", group,
              " must be multiples of 32");
  TORCH_CHECK(vnni ? !signed_codes : (signed_codes || four_bit), "int8 codes are packed ",
              vnni ? "unsigned" : "signed", " for this CPU's kernel");
  const int64_t tile_bytes = (K / group) * 2 * tile * (half_params ? 2 : 4) + K / 32 * tile * (four_bit ? 16 : 32);
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous() && data.scalar_type() == at::kByte &&
                  data.size(1) == tile_bytes && tiles * tile >= out_features,
              "the weight is not packed for ", tile, "-feature tiles of ", K, " columns");
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == out_features && bias->scalar_type() == x.scalar_type(),
                "bias does not match the weight");
  const int64_t M = x.size(0), width = tiles * tile;
  auto out = at::empty({M, out_features}, x.options());
  if (M == 0) return out;
  std::unique_ptr<float[]> out32(new float[M * terms * width]);  // every element written: no zeroing
#if defined(CPU_CAPABILITY_AVX512)
  const bool amx = vnni && M * terms >= kAmxMinRows && vnni::amx_allowed();
#else
  const bool amx = false;
#endif
  KERVAN_DISPATCH(x.scalar_type(), "quant_matmul_i8", [&] {
    using T = scalar_t;
    const QuantizedRows xq = quantize_rows<T>(x, terms, amx ? 16 : 1);
    const uint8_t* dp = data.data_ptr<uint8_t>();
    float* o = out32.get();
    const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
    T* op = out.data_ptr<T>();
    // each thread's features into x's dtype as its tiles finish (no serial pass after)
    // (the terms' sum, plus the bias, rounded once to T: the same bits in a vector or the scalar tail)
    auto done = [&](int64_t n0, int64_t n1) {
      n1 = std::min(n1, out_features);
      for (int64_t m = 0; m < M; ++m) {
        const float* src = o + m * terms * width;
        T* dst = op + m * out_features;
        int64_t n = n0;
        for (; n + kW <= n1; n += kW) {
          Vec v = Vec::loadu(src + n);
          if (terms == 2) v = v + Vec::loadu(src + width + n);
          if (bp != nullptr) v = v + load_floats(bp + n);
          store_floats(dst + n, v);
        }
        for (; n < n1; ++n) {
          const float v = terms == 2 ? src[n] + src[width + n] : src[n];
          dst[n] = static_cast<T>(bp != nullptr ? v + static_cast<float>(bp[n]) : v);
        }
      }
    };
    auto run = [&](auto params) {
      using S = decltype(params);
#if defined(CPU_CAPABILITY_AVX512)
      if (amx && four_bit) return vnni::amx_matmul<true, S>(xq, dp, tiles, group, o, done);
      if (amx) return vnni::amx_matmul<false, S>(xq, dp, tiles, group, o, done);
      if (vnni && four_bit) return vnni::matmul<true, false, S>(xq, dp, tiles, group, o, done);
      if (vnni) return vnni::matmul<false, false, S>(xq, dp, tiles, group, o, done);
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
      if (four_bit) return plain::matmul<true, false, S>(xq, dp, tiles, group, o, done);
      plain::matmul<false, true, S>(xq, dp, tiles, group, o, done);
#endif
    };
    if (half_params)
      run(c10::Half());
    else
      run(0.0f);
  });
  return out;
}

std::string int8_instructions() { return instructions(); }

}  // namespace kervan::q8

TORCH_LIBRARY_FRAGMENT(kervan, m) {
  m.def("quant_matmul_i8(Tensor x, Tensor data, int out_features, int group, bool four_bit, bool signed_codes, "
        "bool half_params, int terms, Tensor? bias) -> Tensor", &kervan::q8::quant_matmul_i8);
  m.def("int8_instructions() -> str", &kervan::q8::int8_instructions);
}
