// SiLU-and-multiply of one row, as ``fused_ops.cpp``'s op and the fused MoE layer compute it:
// out[:I] = round(round(silu(gate)) * up), row = [gate (I) | up (I)], in T.
#pragma once

#include <cmath>

#include "vec.h"

namespace kervan {

template <typename T>
inline void silu_mul_row(const T* row, T* out, int64_t I) {
  const T* g = row;
  const T* u = row + I;
  const Vec one(1.f);
  int64_t i = 0;
  for (; i + kW <= I; i += kW) {
    const Vec gv = load_floats(g + i);
    const Vec s = round_to<T>(gv / (one + gv.neg().exp_u20()));
    store_floats(out + i, s * load_floats(u + i));
  }
  for (; i < I; ++i) {
    const float gv = static_cast<float>(g[i]);
    out[i] = static_cast<T>(round_to<T>(gv / (1.f + std::exp(-gv))) * static_cast<float>(u[i]));
  }
}

}  // namespace kervan
