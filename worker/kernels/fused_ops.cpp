// Fused element-wise CPU ops of a decoder layer: RMSNorm (with the residual add
// folded in), SiLU-and-multiply and rotary embedding. Each replaces a chain of
// 4-8 PyTorch ops that each read and write the whole activation; here one pass
// over a row does it all.
//
// Numerics follow the PyTorch path they replace (``worker/layers``, itself
// Hugging Face's): float32 inside, rounded to the model dtype at the same places
// (``round_to``), so in float32 the two agree to the last few ulps and in bf16
// almost always to the bit.
// the narrow headers, not <ATen/ATen.h> (every op's declaration): a first start compiles in a third of the time
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "silu_mul.h"
#include "vec.h"

namespace {

using kervan::kW;
using kervan::load_floats;
using kervan::round_to;
using kervan::store_floats;
using kervan::Vec;

// One row: out = w * round(x * rsqrt(mean(x^2) + eps)); x is already in float32 here.
template <typename T>
void norm_row(const float* x, const T* w, T* out, int64_t H, float eps) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kW <= H; i += kW) {
    const Vec v = Vec::loadu(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float ss = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < H; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  const Vec rv(r);
  for (i = 0; i + kW <= H; i += kW) store_floats(out + i, round_to<T>(load_floats(w + i) * round_to<T>(Vec::loadu(x + i) * rv)));
  for (; i < H; ++i) out[i] = static_cast<T>(static_cast<float>(w[i]) * round_to<T>(x[i] * r));
}

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t N = x.size(0), H = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t n = begin; n < end; ++n) {
      const T* xr = xp + n * H;
      int64_t i = 0;
      for (; i + kW <= H; i += kW) load_floats(xr + i).store(row.data() + i);
      for (; i < H; ++i) row[i] = static_cast<float>(xr[i]);
      norm_row<T>(row.data(), wp, op + n * H, H, static_cast<float>(eps));
    }
  });
}

// residual = round(x + residual); x = norm(residual) (both in place)
template <typename T>
void add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  const int64_t N = x.size(0), H = x.size(1);
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t n = begin; n < end; ++n) {
      T* xr = xp + n * H;
      T* rr = rp + n * H;
      int64_t i = 0;
      for (; i + kW <= H; i += kW) {
        const Vec s = round_to<T>(load_floats(xr + i) + load_floats(rr + i));
        store_floats(rr + i, s);
        s.store(row.data() + i);
      }
      for (; i < H; ++i) {
        rr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
        row[i] = static_cast<float>(rr[i]);
      }
      norm_row<T>(row.data(), wp, xr, H, static_cast<float>(eps));
    }
  });
}

// out[n, :I] = round(round(silu(gate)) * up), x[n] = [gate (I) | up (I)]
template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t N = x.size(0), I = x.size(1) / 2;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) kervan::silu_mul_row(xp + n * 2 * I, op + n * I, I);
  });
}

// Rotate-half rotary embedding of the first ``rot`` channels of every head, in
// place: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin (cos/sin: [positions, rot],
// the two halves equal), each product and sum rounded as PyTorch rounds them.
template <typename T>
void rotate_heads(T* base, int64_t heads, int64_t D, const T* cos, const T* sin, int64_t rot) {
  const int64_t half = rot / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* x = base + h * D;
    int64_t i = 0;
    for (; i + kW <= half; i += kW) {
      const Vec x1 = load_floats(x + i), x2 = load_floats(x + half + i);
      const Vec c1 = load_floats(cos + i), s1 = load_floats(sin + i), c2 = load_floats(cos + half + i), s2 = load_floats(sin + half + i);
      store_floats(x + i, round_to<T>(x1 * c1) - round_to<T>(x2 * s1));
      store_floats(x + half + i, round_to<T>(x2 * c2) + round_to<T>(x1 * s2));
    }
    for (; i < half; ++i) {
      const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[half + i]);
      const float c1 = static_cast<float>(cos[i]), s1 = static_cast<float>(sin[i]);
      const float c2 = static_cast<float>(cos[half + i]), s2 = static_cast<float>(sin[half + i]);
      x[i] = static_cast<T>(round_to<T>(x1 * c1) - round_to<T>(x2 * s1));
      x[half + i] = static_cast<T>(round_to<T>(x2 * c2) + round_to<T>(x1 * s2));
    }
  }
}

template <typename T>
void rotary_impl(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                 const at::Tensor& positions) {
  const int64_t N = q.size(0), Hq = q.size(1), Hk = k.size(1), D = q.size(2), rot = cos.size(1);
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const int64_t qs = q.stride(0), ks = k.stride(0);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const T* c = cp + pp[n] * rot;
      const T* s = sp + pp[n] * rot;
      rotate_heads(qp + n * qs, Hq, D, c, s, rot);
      rotate_heads(kp + n * ks, Hk, D, c, s, rot);
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous [rows, features] tensor");
}

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && out.sizes() == x.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && out.scalar_type() == x.scalar_type());
  KERVAN_DISPATCH(x.scalar_type(), "rms_norm", [&] { rms_norm_impl<scalar_t>(out, x, weight, eps); });
}

void add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && residual.sizes() == x.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && residual.scalar_type() == x.scalar_type());
  KERVAN_DISPATCH(x.scalar_type(), "add_rms_norm", [&] { add_rms_norm_impl<scalar_t>(x, residual, weight, eps); });
}

void silu_and_mul(at::Tensor out, at::Tensor x) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.size(1) % 2 == 0 && out.size(0) == x.size(0) && out.size(1) == x.size(1) / 2);
  TORCH_CHECK(out.scalar_type() == x.scalar_type());
  KERVAN_DISPATCH(x.scalar_type(), "silu_and_mul", [&] { silu_and_mul_impl<scalar_t>(out, x); });
}

// q: [N, Hq, D], k: [N, Hk, D], rows may be strided (views into one qkv output)
// but heads and channels must be dense; cos, sin: [max_positions, rot]; positions: [N] int64
void rotary(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin, at::Tensor positions) {
  for (const at::Tensor* t : {&q, &k})
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "q and k must be [tokens, heads, head_dim] with dense heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && positions.is_contiguous());
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == q.size(0) && k.size(0) == q.size(0));
  TORCH_CHECK(cos.size(1) % 2 == 0 && cos.size(1) <= q.size(2) && k.size(2) == q.size(2));
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == q.scalar_type() &&
              sin.scalar_type() == q.scalar_type());
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t n = 0; n < positions.numel(); ++n)  // never read past the cos/sin tables
    TORCH_CHECK(pp[n] >= 0 && pp[n] < cos.size(0) && sin.size(0) == cos.size(0), "position ", pp[n],
                " is outside the rotary table of ", cos.size(0), " positions");
  KERVAN_DISPATCH(q.scalar_type(), "rotary", [&] { rotary_impl<scalar_t>(q, k, cos, sin, positions); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kervan, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()", &rms_norm);
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()", &add_rms_norm);
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()", &silu_and_mul);
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, Tensor positions) -> ()", &rotary);
}
