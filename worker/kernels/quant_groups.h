// The per-group scales and zeros of a quantized weight as float32, a slab of output
// features at a time (``quant_linear.cpp`` and ``quant_int8.cpp``).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <optional>
#include <type_traits>
#include <vector>

namespace kervan {

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

}  // namespace kervan
