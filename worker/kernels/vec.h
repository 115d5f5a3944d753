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

template <typename T>
inline void store_floats(T* p, const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, kW);
  }
}

// What a PyTorch op in dtype T would have stored, back in float32.
template <typename T>
inline Vec round_to(const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
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
