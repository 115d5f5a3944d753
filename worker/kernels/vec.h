// Float32 vectors for the kernels here: ATen's Vectorized, whose width the
// library's build flags choose (8 floats with AVX2, 16 with AVX-512), and loads
// and stores that convert the model's dtype (float32, bf16, fp16) on the way.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <tuple>
#include <type_traits>

namespace kervan {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();

template <typename T>
inline Vec load_floats(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

// One vector of floats stored as kW elements of T, rounded as PyTorch rounds (the
// 16-bit cases convert one vector: the generic path converts two and masks half away,
// which made bf16 norms 2.5x slower than float32 ones).
template <typename T>
inline void store_floats(T* p, const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
#if defined(CPU_CAPABILITY_AVX512)
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), at::vec::cvtfp32_bf16(__m512(v)));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), at::vec::cvtfp32_fp16(__m512(v)));
#elif defined(CPU_CAPABILITY_AVX2)
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), at::vec::cvtfp32_bf16(__m256(v)));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), at::vec::cvtfp32_fp16(__m256(v)));
#endif
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, kW);
  }
}

// bf16's rounding of float lanes (to nearest, ties to even; NaN stays NaN), kept in
// float32: integer arithmetic on the float's bits, as PyTorch's conversion rounds, in a
// quarter of the instructions of converting two vectors to bf16 and back.
inline Vec round_to_bf16(const Vec& v) {
  using IVec = at::vec::Vectorized<int32_t>;
  const IVec bits = at::vec::cast<int32_t>(v);
  const IVec lsb = (bits >> IVec(16)) & IVec(1);
  const IVec rounded = (bits + IVec(0x7FFF) + lsb) & IVec(static_cast<int32_t>(0xFFFF0000u));
  return Vec::blendv(at::vec::cast<float>(rounded), v, v.isnan());
}

// What a PyTorch op in dtype T would have stored, back in float32.
template <typename T>
inline Vec round_to(const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return round_to_bf16(v);
  } else {
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v)));
  }
}

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// float32, bf16 and fp16: the dtypes Kervan serves in
#define KERVAN_DISPATCH(TYPE, NAME, ...)                                              \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__)          \
                     AT_DISPATCH_CASE(at::ScalarType::Half, __VA_ARGS__))

}  // namespace kervan
