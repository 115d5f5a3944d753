// Weight-only quantized linears: the weight [N, K] stays in its codes, per-group scales
// and optional zeros, and is decoded to float32 in registers inside the matmul (never the
// whole matrix; ``worker/quant/`` holds the Python side and the formats).
//
// Codes, one row per output feature:
// - kLut4: 4-bit codes, [N, K / 2] bytes; each 32-element block is 16 bytes, byte j holding
//   element j in its low nibble and element j + 16 in its high one (GGUF's Q4_0/Q4_1 order,
//   so llama.cpp's blocks are repacked by copying). A code is an index into a 16-entry
//   float32 table: 0..15 (int4 with zeros, Q4_1), -8..7 (Q4_0), e2m1's values (NVFP4).
// - kInt8: int8 codes, [N, K] bytes (int8 per channel, Q8_0).
// - kE4m3: float8 e4m3fn codes, [N, K] bytes (FP8): decoded exactly through float16
//   (e4m3's bits moved into a half's, which has every e4m3 value, scaled by 2^-8).
// Scales [N, K / group] are float32, float16 or float8 e4m3fn (NVFP4's block scales);
// zeros, where present, have the scales' dtype. An element is
//   w = value(code) * (scale * tensor_scale) + zero
// with each operation rounded in float32, as the Python reference computes it: the
// ``dequantize`` op's output is bit-identical to ``QuantizedWeight.reference_dequantize``.
//
// ``quant_matmul`` is for few rows (decode steps): per output feature, each group's
// values dot each row of x (float32 FMAs, in K order), times the group's scale, plus the
// group's zero times the sum of x over the group; rows of x never mix, so a row's result is
// the same whatever else is in the call. Longer calls dequantize tiles of rows and use the
// dtype's matmul (``worker/quant/matmul.py``). bf16 activations on a CPU with AVX512_BF16
// take ``quant_bf16.h``'s kernels instead (codes made bf16 values, ``vdpbf16ps``), for the
// formats whose values bf16 holds exactly. Every path prefetches the codes a few blocks of
// features ahead: a decode step streams its weights from DRAM.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <vector>

#include "quant_bf16.h"
#include "vec.h"

namespace {

using kervan::kW;
using kervan::load_floats;
using kervan::store_floats;
using kervan::Vec;

enum CodeFormat : int64_t { kLut4 = 0, kInt8 = 1, kE4m3 = 2, kUint4 = 3 };
constexpr int64_t kSub = 16;           // elements decoded at a time
constexpr int64_t kParts = kSub / kW;  // vectors per 16 elements (1 with AVX-512, 2 with AVX2)
constexpr int64_t kOutAtOnce = 4;      // output features computed together: independent FMA chains, x loaded once
// codes prefetched this far ahead of the block of features computing: about a DRAM latency
// (~100 ns) of one core's share of the read bandwidth (~25 GB/s), doubled
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kSlab = 16;          // blocks of kOutAtOnce features whose scales are made float32 at once
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kRowsAtOnce = 4;     // rows of x at once: 16 accumulators of 32 registers
#else
constexpr int64_t kRowsAtOnce = 2;     // 8 of 16
#endif

// Raw vector registers for the dot kernel: GCC keeps arrays of these in registers, where
// arrays of ATen's Vectorized (passed by reference to its helpers) were spilled to the stack.
#if defined(CPU_CAPABILITY_AVX512)
using Reg = __m512;
inline Reg reg_zero() { return _mm512_setzero_ps(); }
inline Reg reg_set(float v) { return _mm512_set1_ps(v); }
inline Reg reg_load(const float* p) { return _mm512_loadu_ps(p); }
inline Reg reg_mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
inline Reg reg_fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
inline float reg_sum(Reg a) { return _mm512_reduce_add_ps(a); }
#elif defined(CPU_CAPABILITY_AVX2)
using Reg = __m256;
inline Reg reg_zero() { return _mm256_setzero_ps(); }
inline Reg reg_set(float v) { return _mm256_set1_ps(v); }
inline Reg reg_load(const float* p) { return _mm256_loadu_ps(p); }
inline Reg reg_mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
inline Reg reg_fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
inline float reg_sum(Reg a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#else
using Reg = Vec;
inline Reg reg_zero() { return Vec(0.0f); }
inline Reg reg_set(float v) { return Vec(v); }
inline Reg reg_load(const float* p) { return Vec::loadu(p); }
inline Reg reg_mul(Reg a, Reg b) { return a * b; }
inline Reg reg_fma(Reg a, Reg b, Reg c) { return at::vec::fmadd(a, b, c); }
inline float reg_sum(Reg a) { return at::vec::vec_reduce_all<float>([](Vec& u, Vec& v) { return u + v; }, a); }
#endif

// Codes of one format -> float32 vectors. kUint4 is kLut4 whose table is 0..15 (int4 with
// zeros, Q4_1): the codes convert to floats directly, one shuffle fewer than a lookup.
template <int64_t F>
struct Decoder {
  int64_t K;
  const float* lut;
#if defined(CPU_CAPABILITY_AVX512)
  __m512 table;
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 table_lo, table_hi;
#endif

  Decoder(int64_t K_, const float* lut_) : K(K_), lut(lut_) {
#if defined(CPU_CAPABILITY_AVX512)
    table = F == kLut4 ? _mm512_loadu_ps(lut) : _mm512_setzero_ps();
#elif defined(CPU_CAPABILITY_AVX2)
    table_lo = F == kLut4 ? _mm256_loadu_ps(lut) : _mm256_setzero_ps();
    table_hi = F == kLut4 ? _mm256_loadu_ps(lut + 8) : _mm256_setzero_ps();
#endif
  }

  // elements [32 * blk + 16 * h + p * kW, ... + kW) of one row's codes as float32 (a
  // 32-element block's two halves: the 4-bit codes' low and high nibbles)
  inline Reg decode(const uint8_t* row, int64_t blk, int h, int p) const {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    __m128i bytes;
    if constexpr (F == kLut4 || F == kUint4) {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + blk * 16));
      bytes = _mm_and_si128(h ? _mm_srli_epi16(packed, 4) : packed, _mm_set1_epi8(0x0F));
    } else {
      bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + blk * 32 + h * kSub));
    }
#endif
#if defined(CPU_CAPABILITY_AVX512)
    (void)p;
    if constexpr (F == kLut4) {
      return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(bytes), table);
    } else if constexpr (F == kUint4) {
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
    } else if constexpr (F == kInt8) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    } else {
      return _mm512_mul_ps(_mm512_cvtph_ps(e4m3_to_half(_mm256_cvtepu8_epi16(bytes))), _mm512_set1_ps(256.0f));
    }
#elif defined(CPU_CAPABILITY_AVX2)
    const __m128i part = p ? _mm_srli_si128(bytes, 8) : bytes;
    if constexpr (F == kE4m3) {
      return _mm256_mul_ps(_mm256_cvtph_ps(e4m3_to_half(_mm_cvtepu8_epi16(part))), _mm256_set1_ps(256.0f));
    } else if constexpr (F == kInt8) {
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part));
    } else if constexpr (F == kUint4) {
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part));
    } else {
      const __m256i idx = _mm256_cvtepu8_epi32(part);
      const __m256 lo = _mm256_permutevar8x32_ps(table_lo, idx);
      const __m256 hi = _mm256_permutevar8x32_ps(table_hi, idx);
      return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7))));
    }
#else
    alignas(64) float tmp[kW];
    for (int64_t e = 0; e < kW; ++e) tmp[e] = scalar(row, blk * 32 + h * kSub + p * kW + e);
    return Vec::loadu(tmp);
#endif
  }

  // one element, for the scalar build
  inline float scalar(const uint8_t* row, int64_t k) const {
    if constexpr (F == kLut4 || F == kUint4) {
      const uint8_t byte = row[(k / 32) * 16 + k % 16];
      const int code = (k % 32) < 16 ? (byte & 0x0F) : (byte >> 4);
      return F == kLut4 ? lut[code] : static_cast<float>(code);
    } else if constexpr (F == kInt8) {
      return static_cast<float>(static_cast<int8_t>(row[k]));
    } else {
      return static_cast<float>(c10::Float8_e4m3fn(row[k], c10::Float8_e4m3fn::from_bits()));
    }
  }

#if defined(CPU_CAPABILITY_AVX512)
  // e4m3 codes in 16-bit lanes -> the float16 whose value is the code's times 2^-8
  // (sign to bit 15, exponent and mantissa shifted into the half's: its bias is 8 more)
  static inline __m256i e4m3_to_half(__m256i b) {
    const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    return _mm256_or_si256(magnitude, sign);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  static inline __m128i e4m3_to_half(__m128i b) {  // as above, 8 lanes
    const __m128i magnitude = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7);
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
    return _mm_or_si128(magnitude, sign);
  }
#endif
};

// the kernels for each code format
#define KERVAN_DISPATCH_CODES(FORMAT, ...)                       \
  [&] {                                                          \
    switch (FORMAT) {                                            \
      case kLut4: { constexpr int64_t F = kLut4; return __VA_ARGS__(); }   \
      case kUint4: { constexpr int64_t F = kUint4; return __VA_ARGS__(); } \
      case kInt8: { constexpr int64_t F = kInt8; return __VA_ARGS__(); }   \
      default: { constexpr int64_t F = kE4m3; return __VA_ARGS__(); }      \
    }                                                            \
  }()

void check_weight(const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                  const std::optional<at::Tensor>& lut, int64_t format, int64_t group, int64_t K) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kByte,
              "codes must be contiguous uint8 [out_features, bytes]");
  TORCH_CHECK(format >= kLut4 && format <= kUint4, "unknown code format ", format);
  const bool four_bit = format == kLut4 || format == kUint4;
  TORCH_CHECK(codes.size(1) == (four_bit ? K / 2 : K), "codes ", codes.sizes(), " do not hold ", K, " columns");
  TORCH_CHECK(K % 32 == 0 && group % kSub == 0 && K % group == 0, "in_features ", K, " must be a multiple of 32 and ",
              "of the group ", group, ", itself a multiple of 16");
  TORCH_CHECK(scales.dim() == 2 && scales.is_contiguous() && scales.size(0) == codes.size(0) &&
                  scales.size(1) == K / group, "scales must be [out_features, in_features / group]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf ||
                  scales.scalar_type() == at::kFloat8_e4m3fn, "scales must be float32, float16 or float8_e4m3fn");
  if (zeros.has_value())
    TORCH_CHECK(zeros->sizes() == scales.sizes() && zeros->is_contiguous() &&
                    zeros->scalar_type() == scales.scalar_type(), "zeros must match the scales");
  if (format == kLut4)
    TORCH_CHECK(lut.has_value() && lut->numel() == 16 && lut->is_contiguous() && lut->scalar_type() == at::kFloat,
                "4-bit codes need a float32 table of 16 values");
}

// Rows [n0, n0 + count) of the scales (times the tensor scale) and zeros as float32:
// [count, groups] each, from float32, float16 or float8 e4m3 (a switch per load, not a
// template: a template per scales' dtype tripled the file's compile time).
struct GroupParams {
  const char* scales;
  const char* zeros;  // or null
  at::ScalarType dtype;
  int64_t groups, itemsize;
  float mult;
  std::vector<float> scale, zero;

  GroupParams(const at::Tensor& s, const std::optional<at::Tensor>& z, double tensor_scale)
      : scales(static_cast<const char*>(s.data_ptr())),
        zeros(z.has_value() ? static_cast<const char*>(z->data_ptr()) : nullptr), dtype(s.scalar_type()),
        groups(s.size(1)), itemsize(static_cast<int64_t>(s.element_size())), mult(static_cast<float>(tensor_scale)) {}

  // rows [n0, n0 + count) of the scales and zeros, into cache ahead of ``load``
  void prefetch(int64_t n0, int64_t count) const {
    const int64_t bytes = count * groups * itemsize, start = n0 * groups * itemsize;
    for (int64_t off = 0; off < bytes; off += 64) {
      __builtin_prefetch(scales + start + off, 0, 3);
      if (zeros != nullptr) __builtin_prefetch(zeros + start + off, 0, 3);
    }
  }

  void load(int64_t n0, int64_t count) {
    const int64_t start = n0 * groups * itemsize;
    convert(scales + start, count * groups, mult, scale);
    if (zeros != nullptr) convert(zeros + start, count * groups, 1.0f, zero);
  }

  // n values, then 16 zeros: the chunk kernel loads 16 from a row's last group on
  void convert(const char* src, int64_t n, float m, std::vector<float>& out) const {
    if (static_cast<int64_t>(out.size()) < n + 16) out.resize(n + 16);
    std::fill(out.begin() + n, out.begin() + n + 16, 0.0f);
    switch (dtype) {
      case at::kHalf: convert_as(reinterpret_cast<const c10::Half*>(src), n, out.data()); break;
      case at::kFloat8_e4m3fn: convert_as(reinterpret_cast<const c10::Float8_e4m3fn*>(src), n, out.data()); break;
      default: convert_as(reinterpret_cast<const float*>(src), n, out.data());
    }
    if (m != 1.0f)
      for (int64_t j = 0; j < n; ++j) out[j] *= m;
  }

  template <typename S>
  static void convert_as(const S* src, int64_t n, float* out) {
    int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<S, c10::Float8_e4m3fn>) {  // a table: c10's conversion is bit by bit
      static const std::array<float, 256> table = [] {
        std::array<float, 256> t{};
        for (int c = 0; c < 256; ++c)
          t[c] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(c), c10::Float8_e4m3fn::from_bits()));
        return t;
      }();
      for (; i < n; ++i) out[i] = table[src[i].x];
    }
    if constexpr (std::is_same_v<S, c10::Half>) {  // F16C, 8 at a time
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    }
#endif
    for (; i < n; ++i) out[i] = static_cast<float>(src[i]);
  }
};

template <int64_t F, typename T>
void dequantize_impl(const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                     const Decoder<F>& dec, double tensor_scale, at::Tensor& out) {
  const int64_t N = codes.size(0), K = dec.K, subs = K / kSub;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    GroupParams params(scales, zeros, tensor_scale);
    params.load(n0, n1 - n0);
    const int64_t groups = scales.size(1), per_group = (K / groups) / kSub;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = cp + n * codes.size(1);
      for (int64_t j = 0; j < subs; ++j) {
        const int64_t i = (n - n0) * groups + j / per_group;
        for (int p = 0; p < kParts; ++p) {
          // times the scale, then plus the zero: two roundings, as the reference's two ops
          Vec v = Vec(dec.decode(row, j / 2, j % 2, p)) * Vec(params.scale[i]);
          if (zeros.has_value()) v = v + Vec(params.zero[i]);
          store_floats(op + n * K + j * kSub + p * kW, v);
        }
      }
    }
  });
}

// Output features [n, n + B) against rows [0, R) of x (float32, [R, K] at xf): each 16
// decoded codes are scaled once by their group's scale (``scale``: [B, groups]) and
// multiplied into every row; result[b * R + r] gets the dot products, zeros' terms not
// yet added. A group is 16 elements (half a 32-element block) or whole blocks.
template <int64_t F, int B, int R>
inline void dot_block(const float* xf, const uint8_t* const* rows, const float* scale, const float* zero,
                      const float* xsum, int64_t group, const Decoder<F>& dec, float* result) {
  const int64_t K = dec.K, groups = K / group, blocks_per_group = group == kSub ? 1 : group / 32;
  Reg acc[B][R];
  float zacc[B][R];
#pragma GCC unroll 16
  for (int b = 0; b < B; ++b)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[b][r] = reg_zero(), zacc[b][r] = 0.0f;
  const int64_t g_step = group == kSub ? 2 : 1;  // groups a step of blocks_per_group blocks covers
  for (int64_t blk0 = 0, g = 0; blk0 < K / 32; blk0 += blocks_per_group, g += g_step) {
    Reg s[B][2];
#pragma GCC unroll 16
    for (int b = 0; b < B; ++b) {
      s[b][0] = reg_set(scale[b * groups + g]);
      s[b][1] = reg_set(scale[b * groups + g + g_step - 1]);
    }
    for (int64_t blk = blk0; blk < blk0 + blocks_per_group; ++blk) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 4
        for (int p = 0; p < kParts; ++p) {
          Reg x[R];
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r) x[r] = reg_load(xf + r * K + blk * 32 + h * kSub + p * kW);
#pragma GCC unroll 16
          for (int b = 0; b < B; ++b) {
            const Reg ws = reg_mul(dec.decode(rows[b], blk, h, p), s[b][h]);
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) acc[b][r] = reg_fma(ws, x[r], acc[b][r]);
          }
        }
      }
    }
    if (zero != nullptr) {  // the groups' zeros times x's sums over them
#pragma GCC unroll 16
      for (int b = 0; b < B; ++b)
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          zacc[b][r] = std::fma(zero[b * groups + g], xsum[r * groups + g], zacc[b][r]);
          if (group == kSub) zacc[b][r] = std::fma(zero[b * groups + g + 1], xsum[r * groups + g + 1], zacc[b][r]);
        }
    }
  }
#pragma GCC unroll 16
  for (int b = 0; b < B; ++b)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) result[b * R + r] = reg_sum(acc[b][r]) + zacc[b][r];
}

template <int64_t F, int B>
inline void dot_rows(int64_t rows_x, const float* xf, const uint8_t* const* rows, const float* scale,
                     const float* zero, const float* xsum, int64_t group, const Decoder<F>& dec, float* result) {
  switch (rows_x) {
#if defined(CPU_CAPABILITY_AVX512)
    case 4: return dot_block<F, B, 4>(xf, rows, scale, zero, xsum, group, dec, result);
    case 3: return dot_block<F, B, 3>(xf, rows, scale, zero, xsum, group, dec, result);
#endif
    case 2: return dot_block<F, B, 2>(xf, rows, scale, zero, xsum, group, dec, result);
    default: return dot_block<F, B, 1>(xf, rows, scale, zero, xsum, group, dec, result);
  }
}

template <int64_t F, typename T>
void matmul_impl(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                 const std::optional<at::Tensor>& zeros, const Decoder<F>& dec, double tensor_scale,
                 const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = dec.K, N = codes.size(0), group = K / scales.size(1), groups = scales.size(1);
  // x in float32 once, and its sums over each group where zeros need them (and the chunk
  // kernel's 0..15 codes: ``quant_bf16.h``)
  const bool sums = zeros.has_value() || F == kUint4;
  std::vector<float> xf(M * K), xsum(sums ? M * groups : 0);
  const T* xp = x.data_ptr<T>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; k += kW) load_floats(xp + m * x.stride(0) + k).store(xf.data() + m * K + k);
    for (int64_t g = 0; g < (sums ? groups : 0); ++g) {
      float s = 0.0f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) s += xf[m * K + k];
      xsum[m * groups + g] = s;
    }
  }
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  const int64_t blocks = (N + kOutAtOnce - 1) / kOutAtOnce;
#if defined(CPU_CAPABILITY_AVX512)
  // bf16 activations and codes whose values bf16 holds exactly: the vdpbf16ps path
  uint16_t table16[16] = {};
  bool bf16_dot = false;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    bf16_dot = true;
    for (int c = 0; c < 16 && (F == kUint4 || F == kLut4); ++c) {
      const float v = F == kUint4 ? static_cast<float>(c) : dec.lut[c];
      table16[c] = c10::BFloat16(v).x;
      bf16_dot = bf16_dot && static_cast<float>(c10::BFloat16(v)) == v;
    }
    for (int m = 0; m < 8 && F == kE4m3; ++m) table16[m] = c10::BFloat16(std::ldexp(static_cast<float>(m), -9)).x;
    bf16_dot = bf16_dot && kervan::quant_bf16::available();
  }
  const kervan::quant_bf16::Table table(table16);
  const uint16_t* x16 = reinterpret_cast<const uint16_t*>(xp);
  // 4-bit codes whose groups tile 128-element chunks: the chunk kernel, x permuted for it once
  const bool chunked = bf16_dot && (F == kUint4 || F == kLut4) && kervan::quant_bf16::chunk_group(group, K);
  const auto kind = F == kInt8   ? kervan::quant_bf16::kInt8Codes
                    : F == kE4m3 ? kervan::quant_bf16::kE4m3Codes
                                 : kervan::quant_bf16::kFourBit;
  std::optional<kervan::quant_bf16::ChunkX> cx;
  if (chunked) cx.emplace(x16, x.stride(0), M, K);
  const kervan::quant_bf16::ChunkGroups cg(group);
#endif
  const int64_t row_bytes = codes.size(1), ldx = x.stride(0);
  const int64_t ahead_blocks = std::clamp<int64_t>(kPrefetchBytes / (kOutAtOnce * row_bytes), 1, kSlab - 1);
  at::parallel_for(0, blocks, 4, [&](int64_t nb0, int64_t nb1) {
    GroupParams params(scales, zeros, tensor_scale);
    float result[kOutAtOnce * kRowsAtOnce];
    // this range's outputs in float32 [M, width], plus bias, converted to T at the end
    const int64_t first = nb0 * kOutAtOnce, width = std::min(N, nb1 * kOutAtOnce) - first;
    std::vector<float> out32(M * width);
    int64_t f0 = 0;  // the first feature whose scales params holds
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      const int64_t n0 = nb * kOutAtOnce, count = std::min(kOutAtOnce, N - n0);
      if ((nb - nb0) % kSlab == 0) {  // the scales of the next kSlab blocks of features, converted at once
        f0 = n0;
        params.load(f0, std::min(N, std::min(nb1, nb + kSlab) * kOutAtOnce) - f0);
      }
      const uint8_t* rows[kOutAtOnce];
      for (int64_t b = 0; b < count; ++b) rows[b] = cp + (n0 + b) * row_bytes;
      // the codes ahead_blocks blocks of features ahead, into cache while these compute: a
      // decode step reads weights from DRAM, and short rows give the hardware prefetcher
      // too little of a stream to ramp up on (without it 4-bit codes came at half of
      // int8's bytes per second)
      if (nb + ahead_blocks < nb1) {
        const uint8_t* ahead = cp + (n0 + ahead_blocks * kOutAtOnce) * row_bytes;
        for (int64_t off = 0; off < kOutAtOnce * row_bytes; off += 64) __builtin_prefetch(ahead + off, 0, 3);
        if ((nb - nb0) % kSlab == kSlab - ahead_blocks)
          params.prefetch(n0 + ahead_blocks * kOutAtOnce, kSlab * kOutAtOnce);
      }
      for (int64_t m0 = 0; m0 < M; m0 += kRowsAtOnce) {
        const int64_t rx = std::min(kRowsAtOnce, M - m0);
        // 4 features at once, or the last few one at a time
        for (int64_t b = 0; b < count; b += count == kOutAtOnce ? kOutAtOnce : 1) {
          const float* scale = params.scale.data() + (n0 - f0 + b) * groups;
          const float* zero = zeros.has_value() ? params.zero.data() + (n0 - f0 + b) * groups : nullptr;
          const float* xs = zeros.has_value() ? xsum.data() + m0 * groups : nullptr;
#if defined(CPU_CAPABILITY_AVX512)
          if (chunked) {
            const float* xsg = xsum.data() + m0 * groups;
            if (count == kOutAtOnce)
              kervan::quant_bf16::dot_rows_chunks<kOutAtOnce>(F == kUint4, rx, *cx, m0, K, rows, scale, zero, xsg,
                                                              groups, cg, table, result);
            else
              kervan::quant_bf16::dot_rows_chunks<1>(F == kUint4, rx, *cx, m0, K, rows + b, scale, zero, xsg, groups,
                                                     cg, table, result + b * rx);
            continue;
          }
          if (bf16_dot) {
            const uint16_t* xb = x16 + m0 * ldx;
            if (count == kOutAtOnce)
              kervan::quant_bf16::dot_rows<kOutAtOnce>(kind, rx, xb, ldx, K, rows, scale, zero, xs, group, table,
                                                       result);
            else
              kervan::quant_bf16::dot_rows<1>(kind, rx, xb, ldx, K, rows + b, scale, zero, xs, group, table,
                                              result + b * rx);
            continue;
          }
#endif
          const float* xr = xf.data() + m0 * K;
          if (count == kOutAtOnce)
            dot_rows<F, kOutAtOnce>(rx, xr, rows, scale, zero, xs, group, dec, result);
          else
            dot_rows<F, 1>(rx, xr, rows + b, scale, zero, xs, group, dec, result + b * rx);
        }
        for (int64_t b = 0; b < count; ++b)
          for (int64_t r = 0; r < rx; ++r) out32[(m0 + r) * width + n0 - first + b] = result[b * rx + r];
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      float* src = out32.data() + m * width;
      if (bp != nullptr)
        for (int64_t j = 0; j < width; ++j) src[j] += static_cast<float>(bp[first + j]);
      T* dst = op + m * N + first;
      int64_t j = 0;
      for (; j + kW <= width; j += kW) store_floats(dst + j, Vec::loadu(src + j));
      for (; j < width; ++j) dst[j] = static_cast<T>(src[j]);
    }
  });
}

const float* table_of(const std::optional<at::Tensor>& lut, int64_t format) {
  return format == kLut4 ? lut->data_ptr<float>() : nullptr;
}

// -> [N, K] in ``dtype``
at::Tensor quant_dequantize(at::Tensor codes, at::Tensor scales, std::optional<at::Tensor> zeros,
                            std::optional<at::Tensor> lut, int64_t format, int64_t group, double tensor_scale,
                            at::ScalarType dtype) {
  const int64_t K = (format == kLut4 || format == kUint4) ? codes.size(1) * 2 : codes.size(1);
  check_weight(codes, scales, zeros, lut, format, group, K);
  auto out = at::empty({codes.size(0), K}, codes.options().dtype(dtype));
  KERVAN_DISPATCH(dtype, "quant_dequantize", [&] {
    using T = scalar_t;
    KERVAN_DISPATCH_CODES(format, [&] {
      dequantize_impl<F, T>(codes, scales, zeros, Decoder<F>(K, table_of(lut, format)), tensor_scale, out);
    });
  });
  return out;
}

// x [M, K] (dense rows) -> [M, N] in x's dtype
at::Tensor quant_matmul(at::Tensor x, at::Tensor codes, at::Tensor scales, std::optional<at::Tensor> zeros,
                        std::optional<at::Tensor> lut, int64_t format, int64_t group, double tensor_scale,
                        std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, in_features] with dense rows");
  const int64_t K = x.size(1);
  check_weight(codes, scales, zeros, lut, format, group, K);
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == codes.size(0) && bias->scalar_type() == x.scalar_type(),
                "bias does not match the weight");
  auto out = at::empty({x.size(0), codes.size(0)}, x.options());
  if (x.size(0) == 0) return out;
  KERVAN_DISPATCH(x.scalar_type(), "quant_matmul", [&] {
    using T = scalar_t;
    KERVAN_DISPATCH_CODES(format, [&] {
      matmul_impl<F, T>(x, codes, scales, zeros, Decoder<F>(K, table_of(lut, format)), tensor_scale, bias, out);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kervan, m) {
  m.def("quant_dequantize(Tensor codes, Tensor scales, Tensor? zeros, Tensor? lut, int format, int group, "
        "float tensor_scale, ScalarType dtype) -> Tensor", &quant_dequantize);
  m.def("quant_matmul(Tensor x, Tensor codes, Tensor scales, Tensor? zeros, Tensor? lut, int format, int group, "
        "float tensor_scale, Tensor? bias) -> Tensor", &quant_matmul);
}
